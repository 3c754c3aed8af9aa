"""LoRA adapters: PEFT folders loaded at run time into device slots, applied per row of a batch.

Each target projection (q/k/v, o, gate/up, down) holds its slots' A and B matrices stacked, so a batch that
mixes adapters and base rows runs two extra matmuls per projection, whatever its mix (engine/lora/layers.py).
"""
