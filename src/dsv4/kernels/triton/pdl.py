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
  triggered, so a multi-wave primary keeps all its slots until its last wave). Before their own
  wait, weight-streaming kernels issue L2 prefetches of their first weight bytes (`prefetch_rows`,
  `prefetch_lines`): at batch 1 the weights of the next projection stream in while a
  latency-bound kernel (a norm, a top-k) runs.

Contract of every kernel that takes the `PDL` constexpr: it calls `pdl_enter(PDL)` before any load
or store of memory that a kernel of the step writes, and before any early return; only reads of
the weights (written only between steps: at load and at a weight update) may come before it, as
L2 prefetches. So no program reads a prior kernel's output early, and no grid completes before
the grid ahead of it: a kernel C launched after B reads what A wrote before B, since C's wait
covers B and B finished only after its own wait covered A (with EARLY too: B triggers C only
after its wait returned). A trigger placed after the wait keeps at most one kernel's programs
waiting ahead of the running one.

`pdl_args(device)` gives the two launch keywords, on where the device runs it: an NVIDIA GPU of
compute capability >= 9.0, and the `DSV4_PDL` environment variable ("0" off, "1" WAIT, "2" EARLY;
default WAIT: the A/B switch of the benchmarks and tests; read at each launch, so it holds for
kernels launched or graphs captured after it is set). Off CUDA (the interpreter) PDL is off:
`gdc_wait` is inline PTX. Kernels of other libraries (cuBLAS, torch) stay ordinary launches; a PDL
kernel after one simply waits for it as usual.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENV = "DSV4_PDL"
OFF, WAIT, EARLY = 0, 1, 2     # the PDL constexpr's modes (module docstring)
_MODES = {"0": OFF, "1": WAIT, "2": EARLY}
PREFETCH_ENV = "DSV4_PDL_PREFETCH"   # EARLY: bytes of each weight row prefetched (default below)
PREFETCH_ROW_BYTES = 1024      # EARLY: a weight row's first bytes prefetched before the wait
LINE = 128                     # bytes per L2 prefetch


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
    return _MODES[value] if _hopper(device.index if device.index is not None
                                    else torch.cuda.current_device()) else OFF


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL (see the module docstring)."""
    return pdl_mode(device) != OFF


def pdl_args(device: torch.device) -> dict[str, int | bool]:
    """The launch keywords of a PDL-aware kernel: its `PDL` constexpr (the mode) and Triton's
    `launch_pdl`."""
    mode = pdl_mode(device)
    return {"PDL": mode, "launch_pdl": mode != OFF}


def prefetch_lines(device: torch.device, row_bytes: int) -> int:
    """The L2 lines (LINE bytes) of each weight row a kernel prefetches before its wait: under
    EARLY, the row's first min(row_bytes, DSV4_PDL_PREFETCH or PREFETCH_ROW_BYTES) bytes; else
    0. Raises ValueError on a DSV4_PDL_PREFETCH that is not a whole number >= 0."""
    if pdl_mode(device) != EARLY:
        return 0
    value = os.environ.get(PREFETCH_ENV, str(PREFETCH_ROW_BYTES))
    if not value.isdigit():
        raise ValueError(f"{PREFETCH_ENV} must be a whole number of bytes >= 0; got {value!r}")
    return triton.cdiv(min(row_bytes, int(value)), LINE)


@triton.jit
def pdl_enter(PDL: tl.constexpr):  # type: ignore[no-untyped-def]
    """A PDL kernel's entry (module docstring): wait for the kernels ahead (WAIT, EARLY), then
    let the next kernel's programs be scheduled (EARLY)."""
    if PDL:
        gdc_wait()
    if PDL == 2:
        gdc_launch_dependents()


@triton.jit
def prefetch_rows(row_ptrs, row_bytes, LINES: tl.constexpr):  # type: ignore[no-untyped-def]
    """L2 prefetches of the first LINES lines (LINE bytes) of each row at row_ptrs [R] (byte
    pointers), lines past row_bytes skipped: weights only, before `pdl_enter` (EARLY)."""
    offs = tl.arange(0, LINES) * 128
    ptrs = row_ptrs[:, None] + offs[None, :]
    ok = tl.broadcast_to((offs < row_bytes)[None, :], ptrs.shape).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, ok], dtype=tl.int32, is_pure=False, pack=1)
