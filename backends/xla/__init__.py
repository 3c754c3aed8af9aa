"""XLA platform through torchax (PyTorch on JAX): `--device xla`. Run on JAX's CPU backend only; never on a TPU.

torchax and jax are imported lazily (backends/xla/vendor.py), so `import backends.xla` works on any machine."""
