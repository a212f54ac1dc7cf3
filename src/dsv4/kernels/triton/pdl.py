"""Programmatic dependent launch (PDL) of the Triton kernels on Hopper and later.

A kernel launched with the PDL attribute (`launch_pdl=True`) may be scheduled before the kernel
ahead of it in the stream has finished: its programs start, then block in `gdc_wait()`
(`griddepcontrol.wait`) until every prior grid has completed and its memory is visible. What that
saves is the launch gap between two dependent kernels (inside a CUDA graph ~0.1-0.3 us per kernel
on the H200, `benchmarks/results/serving_h200_202612.md`), about 150 times per decode step.

Modes (the `PDL` constexpr, from `pdl_args`):
- WAIT (1): a dependent is launched only once every program of the kernel ahead has exited, so
  what overlaps is its launch, not its work.
- EARLY (2): every program calls `gdc_launch_dependents()` right after its wait, so the next
  kernel's programs are scheduled while this one runs (onto SM slots its own programs leave
  free: the hardware launches a dependent only once every program of the primary has started and
  triggered, so a multi-wave primary keeps all its slots until its last wave). Opt-in: on the
  H200 it helps the batch-1 decode step and slows the batch-32 one
  (benchmarks/results/quant_moe_h200_202612.md).

Contract of every kernel that takes the `PDL` constexpr: it calls `pdl_enter(PDL)` (`pdl_enter.py`)
unconditionally, before any load, store or early return (only index arithmetic may precede it:
the GEMV and the FP8 linear compute their tile's pointers first). So no program reads a
prior kernel's output early, and no grid completes before the grid ahead of it: a kernel C
launched after B reads what A wrote before B, since C's wait covers B and B finished only after
its own wait covered A (with EARLY too: B triggers C only after its wait returned). A trigger
placed after the wait keeps at most one kernel's programs waiting ahead of the running one. This
module defines no Triton function: the engine and its tests import it before TRITON_INTERPRET
may be set, and a Triton function defined then would be compiled, not interpreted.

`pdl_args(device)` gives the two launch keywords, on where the device runs it: an NVIDIA GPU of
compute capability >= 9.0, and the `DSV4_PDL` environment variable ("0" off, "1" WAIT, "2" EARLY;
default WAIT: the A/B switch of the benchmarks and tests; read at each launch, so it holds for
kernels launched or graphs captured after it is set). `pdl_scope(mode)` sets WAIT or EARLY for
the launches made inside it (a context variable: this thread or task only, restored on exit), so
an engine can capture some decode graphs in one mode and the rest in the other
(`EngineConfig.pdl_early_max_batch`); "0" in DSV4_PDL still turns PDL off inside a scope. Off
CUDA (the interpreter) PDL is off: `gdc_wait` is inline PTX. Kernels of other libraries (cuBLAS,
torch) stay ordinary launches; a PDL kernel after one simply waits for it as usual.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Iterator

import torch

ENV = "DSV4_PDL"
OFF, WAIT, EARLY = 0, 1, 2     # the PDL constexpr's modes (module docstring)
_MODES = {"0": OFF, "1": WAIT, "2": EARLY}
# the mode `pdl_scope` sets for the launches inside it (None: DSV4_PDL's)
_SCOPE: contextvars.ContextVar[int | None] = contextvars.ContextVar("dsv4_pdl_scope",
                                                                    default=None)


@functools.cache
def _hopper(index: int) -> bool:
    """An NVIDIA GPU of compute capability >= 9.0 (ROCm devices report their own numbers here
    and have no griddepcontrol)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_mode(device: torch.device) -> int:
    """The PDL mode of kernels on `device` (OFF, WAIT or EARLY; module docstring). Raises
    ValueError on a DSV4_PDL value other than "0", "1", "2"."""
    value = os.environ.get(ENV, "1")
    if value not in _MODES:
        raise ValueError(f"{ENV} must be one of {sorted(_MODES)}; got {value!r}")
    if device.type != "cuda" or _MODES[value] == OFF:
        return OFF
    mode = _SCOPE.get()
    mode = _MODES[value] if mode is None else mode
    return mode if _hopper(device.index if device.index is not None
                           else torch.cuda.current_device()) else OFF


@contextlib.contextmanager
def pdl_scope(mode: int | None) -> Iterator[None]:
    """Launches inside use `mode` (WAIT or EARLY) instead of DSV4_PDL's WAIT / EARLY; None: no
    change. DSV4_PDL="0" and devices without PDL stay off. Raises ValueError on another mode."""
    if mode is not None and mode not in (WAIT, EARLY):
        raise ValueError(f"pdl_scope mode must be WAIT ({WAIT}), EARLY ({EARLY}) or None; "
                         f"got {mode!r}")
    mode_token = None if mode is None else _SCOPE.set(mode)
    try:
        yield
    finally:
        if mode_token is not None:
            _SCOPE.reset(mode_token)


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL (see the module docstring)."""
    return pdl_mode(device) != OFF


def pdl_args(device: torch.device) -> dict[str, int | bool]:
    """The launch keywords of a PDL-aware kernel: its `PDL` constexpr (the mode) and Triton's
    `launch_pdl`."""
    mode = pdl_mode(device)
    return {"PDL": mode, "launch_pdl": mode != OFF}
