"""ROCm backend (`--device rocm`): HIP graphs via torch.cuda.CUDAGraph on HIP builds of torch."""
