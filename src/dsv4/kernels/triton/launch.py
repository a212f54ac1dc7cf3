"""Host-side checks and sizes shared by the Triton wrappers (the SM count by every grid planner;
the checks by the mHC wrappers `mhc.py`, `mhc_post.py`).

Owns the accepted stream dtypes, the shape / dtype / contiguity and one-device checks, the
power-of-two check of block sizes, and the SM count that sizes grids (1 off CUDA, so the
interpreter plans for 1 SM). Nothing here syncs with the device; the SM count is cached per index.
"""

from __future__ import annotations

import functools

import torch

X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.cache
def _num_sms(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def sms(device: torch.device) -> int:
    """The SM count of `device`; 1 off CUDA."""
    if device.type != "cuda":
        return 1
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def pow2(name: str, value: int, least: int) -> int:
    """Returns `value` if it is a power of two >= `least`; raises ValueError otherwise."""
    if value < least or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {least}; got {value}")
    return value


def expect(name: str, t: torch.Tensor, shape: tuple[int, ...],
           dtypes: tuple[torch.dtype, ...]) -> None:
    """Raises ValueError unless `t` is contiguous, of `shape` and of one of `dtypes`."""
    if tuple(t.shape) != shape or t.dtype not in dtypes:
        raise ValueError(f"{name} must be {list(shape)} of {[str(d) for d in dtypes]}; "
                         f"got {list(t.shape)} {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous; got strides {t.stride()} "
                         f"for shape {list(t.shape)}")


def one_device(*tensors: torch.Tensor) -> None:
    """Raises ValueError unless all `tensors` are on one device."""
    if len(devices := {t.device for t in tensors}) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(map(str, devices))}")
