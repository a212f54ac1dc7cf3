"""Programmatic dependent launch (PDL) of the Triton kernels on Hopper and later.

A kernel launched with the PDL attribute (`launch_pdl=True`) may be scheduled before the kernel
ahead of it in the stream has finished: its programs start, then block in `gdc_wait()`
(`griddepcontrol.wait`) until every prior grid has completed and its memory is visible. What that
saves is the launch gap between two dependent kernels (inside a CUDA graph ~0.1-0.3 us per kernel
on the H200, `benchmarks/results/serving_h200_202612.md`), about 150 times per decode step.

Contract of every kernel that takes the `PDL` constexpr: its first statement is `if PDL:
gdc_wait()`, unconditionally, before any load, store or early return. So no program reads a prior
kernel's output early, and no grid completes before the grid ahead of it (a kernel C launched after
B reads what A wrote before B: C's wait covers B, and B finished only after its own wait covered
A). No kernel calls `gdc_launch_dependents()`: a dependent starts only once all programs of the
kernel ahead have exited, so its waiting programs never take SM slots from that kernel.

`pdl_args(device)` gives the two launch keywords, on where the device runs it: an NVIDIA GPU of
compute capability >= 9.0, and the `DSV4_PDL` environment variable not "0" (the A/B switch of the
benchmarks and tests; read at each launch, so it holds for kernels launched or graphs captured
after it is set). Off CUDA (the interpreter) PDL is off: `gdc_wait` is inline
PTX. Kernels of other libraries (cuBLAS, torch) stay ordinary launches; a PDL kernel after one
simply waits for it as usual.
"""

from __future__ import annotations

import functools
import os

import torch

ENV = "DSV4_PDL"


@functools.cache
def _hopper(index: int) -> bool:
    """An NVIDIA GPU of compute capability >= 9.0 (ROCm devices report their own numbers here
    and have no griddepcontrol)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL (see the module docstring)."""
    if device.type != "cuda" or os.environ.get(ENV, "1") == "0":
        return False
    return _hopper(device.index if device.index is not None else torch.cuda.current_device())


def pdl_args(device: torch.device) -> dict[str, bool]:
    """The launch keywords of a PDL-aware kernel: its `PDL` constexpr and Triton's `launch_pdl`."""
    on = pdl_enabled(device)
    return {"PDL": on, "launch_pdl": on}
