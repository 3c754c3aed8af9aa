"""CUDA backend: torch.cuda.CUDAGraph capture, Triton paged decode attention."""
