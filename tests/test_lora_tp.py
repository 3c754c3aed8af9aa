"""LoRA under tensor parallelism (gloo, two CPU processes): each rank holds its shard of the adapters' A and B
(column-parallel q/k/v and gate/up: their rows of B; row-parallel o and down: their columns of A, summed by
the layer's all-reduce), and follows rank 0's slot changes. Greedy ids must be the single rank's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import peft
import torch
from helpers import greedy

from engine.engine import Engine

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BASE: dict[str, Any] = dict(
    device="cpu", dtype="float32", page_size=16, kv_cache_tokens=1024, max_num_seqs=4, disable_graphs=True
)


def make_adapter(tiny_llama: str, folder: str, seed: int, rank: int, modules: list[str]) -> str:
    """A PEFT folder of random LoRA (B not zero) of this rank on these modules of the tiny Llama."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=modules, init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():  # B large enough that every adapter changes the greedy tokens
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    return folder


def _run(engine: Engine, adapters: dict[str, str]) -> list[list[int]]:
    """Base rows and both adapters in one batch; one slot, so the adapters take turns in it (the workers follow
    each change), the second loaded at run time."""
    engine.load_lora_adapter("late", adapters["late"])
    prompts = [[5, 17, 99, 23, 8, 41], [200, 3, 77, 77, 12], [9, 8, 7, 6, 5, 4, 3, 150]]
    names = [None, "start", "late", "start", None, "late"]
    params = [greedy(8, lora_name=name) for name in names]
    outputs = engine.generate([prompts[i % len(prompts)] for i in range(len(names))], params)
    return [o.token_ids for o in outputs]


def test_two_ranks_with_adapters_give_the_single_rank_greedy_ids(tiny_llama: str, tmp_path: Path) -> None:
    adapters = {
        "start": make_adapter(tiny_llama, str(tmp_path / "start"), 7, 8, ALL_MODULES),
        "late": make_adapter(tiny_llama, str(tmp_path / "late"), 8, 4, ["q_proj", "v_proj", "down_proj"]),
    }
    options: dict[str, Any] = dict(
        lora_modules=f"start={adapters['start']}", max_loras=1, max_cpu_loras=2, max_lora_rank=8
    )
    single = Engine(model=tiny_llama, **BASE, **options)
    want = _run(single, adapters)
    single.shutdown()
    assert want[1] != want[0] and want[2] != want[0]  # the adapters change the tokens (the test can fail)
    engine = Engine(model=tiny_llama, tensor_parallel_size=2, debug_kv_invariant=True, **BASE, **options)
    try:
        assert _run(engine, adapters) == want
    finally:
        engine.shutdown()
