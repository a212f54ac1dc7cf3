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

Contract of every kernel that takes the `PDL` constexpr: its first statement is `pdl_enter(PDL)`
(`pdl_enter.py`), unconditionally, before any load, store or early return. So no program reads a
prior kernel's output early, and no grid completes before the grid ahead of it: a kernel C
launched after B reads what A wrote before B, since C's wait covers B and B finished only after
its own wait covered A (with EARLY too: B triggers C only after its wait returned). A trigger
placed after the wait keeps at most one kernel's programs waiting ahead of the running one. One
exception (`pdl_preload`): inside `pdl_scope(..., preload=True)`, whose caller guarantees that no
kernel ahead in the stream writes weights (a forward: the engine's decode graphs, their warm-up
and capture), a kernel may load its weights before its wait. Elsewhere nothing is preloaded: a
weight update may be the kernel ahead. (The same kernels run in the warm-up as in the capture,
so none is compiled while a stream captures, which the driver forbids.) This module defines no
Triton function: the engine and its tests import it before TRITON_INTERPRET may be set, and a
Triton function defined then would be compiled, not interpreted.

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
PRELOAD_ENV = "DSV4_PDL_PRELOAD"
OFF, WAIT, EARLY = 0, 1, 2     # the PDL constexpr's modes (module docstring)
_MODES = {"0": OFF, "1": WAIT, "2": EARLY}
# the mode `pdl_scope` sets for the launches inside it (None: DSV4_PDL's)
_SCOPE: contextvars.ContextVar[int | None] = contextvars.ContextVar("dsv4_pdl_scope",
                                                                    default=None)
# whether `pdl_scope(..., preload=True)` allows the launches inside to preload weights
_PRELOAD: contextvars.ContextVar[bool] = contextvars.ContextVar("dsv4_pdl_preload",
                                                                default=False)


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
def pdl_scope(mode: int | None, *, preload: bool = False) -> Iterator[None]:
    """Launches inside use `mode` (WAIT or EARLY) instead of DSV4_PDL's WAIT / EARLY; None: no
    change. DSV4_PDL="0" and devices without PDL stay off. `preload`: kernels launched inside
    may load weights before their wait (`pdl_preload`); the caller guarantees that no kernel
    ahead of them in the stream writes weights (true of a forward: the engine's decode graphs,
    their warm-up and capture). Raises ValueError on another mode."""
    if mode is not None and mode not in (WAIT, EARLY):
        raise ValueError(f"pdl_scope mode must be WAIT ({WAIT}), EARLY ({EARLY}) or None; "
                         f"got {mode!r}")
    mode_token = None if mode is None else _SCOPE.set(mode)
    preload_token = _PRELOAD.set(True) if preload else None
    try:
        yield
    finally:
        if preload_token is not None:
            _PRELOAD.reset(preload_token)
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


def pdl_preload(device: torch.device) -> bool:
    """Whether weight-streaming kernels that can (the FMA loops of `gemv.py` and
    `fp8_linear.py`: `launch_preload`) load their first
    weights before their PDL wait: PDL on for `device`, inside `pdl_scope(..., preload=True)`
    (the contract's exception, module docstring) and DSV4_PDL_PRELOAD "1" (default "0": the A/B
    switch while it is timed). Raises ValueError on another value."""
    value = os.environ.get(PRELOAD_ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{PRELOAD_ENV} must be '0' or '1'; got {value!r}")
    return value == "1" and _PRELOAD.get() and pdl_enabled(device)


def launch_preload(preload: bool | None, device: torch.device, eligible: bool,
                   plan: object) -> bool:
    """A launch's PRELOAD constexpr: `preload` (a wrapper's keyword) where given, else
    `pdl_preload`'s choice; only where `eligible` (the plan's loop is the one-stage FMA loop: a
    pipelined loop issues its own prologue loads). Raises ValueError on preload=True for an
    ineligible `plan` (named in the message)."""
    if not eligible:
        if preload:
            raise ValueError(f"preload=True needs the FMA path at num_stages 1; the plan is {plan}")
        return False
    return pdl_preload(device) if preload is None else preload
