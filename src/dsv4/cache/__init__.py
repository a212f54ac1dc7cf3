"""KV cache of the serving engine: page allocators, per-layer pools, the request page table."""
