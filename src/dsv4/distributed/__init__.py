"""Several processes over torch.distributed (gloo on CPU, NCCL on GPUs): tensor parallelism."""
