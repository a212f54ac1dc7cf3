"""Triton kernels with the same signatures as their `kernels/ref/` PyTorch specifications."""
