"""Host-to-device copies that never block the host (the overlap scheduler depends on it).

A copy from pageable host memory is synchronous with respect to the host: CUDA stages it and
the host waits until the stream reaches it, i.e. until every kernel launched before it has run.
One such copy while preparing step N + 1 makes the host wait for step N, and overlap scheduling
(`engine/engine.py`) hides nothing. `to_device` copies from pinned memory (torch's caching host
allocator: the block is reused only after the copy's stream has passed it) with
`non_blocking=True`, so the host returns at once.
"""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`host` (a CPU tensor, typically just built from a Python list) on `device`; on CUDA
    through pinned memory without blocking the host, elsewhere a plain copy (or `host` itself
    on the CPU)."""
    target = torch.device(device)
    if target.type == "cuda":
        return host.pin_memory().to(target, non_blocking=True)
    return host.to(target)


def copy_from_host(dst: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """`dst.copy_(host)` for a CPU `host` tensor, as `to_device`: pinned and non-blocking when
    `dst` is on CUDA. Returns `dst`."""
    if dst.is_cuda:
        return dst.copy_(host.pin_memory(), non_blocking=True)
    return dst.copy_(host)
