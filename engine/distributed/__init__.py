"""Tensor parallelism over torch.distributed (docs/tensor_parallel.md).

One process per rank; rank 0 is the engine's own process and spawns the
others. Small modules, one job each:

- state.py: this process's rank, world size and process groups (rank 0 of 1 without tensor parallelism)
- process_group.py: joining and leaving the group, with a collective timeout
- sharding.py: which slice of each weight a rank holds; which models can be split
- collectives.py: all-reduce / all-gather as opaque torch ops (kept inside compiled and captured
  graphs), the sampled tokens' broadcast, the KV pool's min over ranks
- wire.py, channel.py: each step's description from rank 0 to the others
- runner.py: rank 0's model runner (sends each step, samples, broadcasts the tokens)
- worker.py: the worker ranks' process and step loop
- launcher.py: spawning, readiness, monitoring and stopping the workers; failures named by rank
- consistency.py: every rank's decode state checked against rank 0's (the KV invariant on every rank)
- preflight.py: what rank 0 refuses before it spawns anything

Nothing is imported here, so `import engine.distributed.state` stays as light as the layers need.
"""
