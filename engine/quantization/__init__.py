"""Quantized weights: FP8 (engine/quantization/fp8.py) and what checkpoints declare (checkpoint.py)."""
