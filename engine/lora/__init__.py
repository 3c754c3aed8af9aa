"""LoRA adapters: PEFT folders loaded at run time into device slots, applied per row of a batch.

Each target projection (q/k/v, o, gate/up, down) holds its slots' A and B matrices stacked per slot, and a batch
that mixes adapters and base rows runs one batched LoRA matmul per projection, whatever its mix: the platform's
kernel that reads only each row's slot (CUDA: grouped Triton kernels), or the dense torch path
(engine/lora/matmul.py, engine/lora/layers.py).
"""
