"""The device side of programmatic dependent launch: `pdl_enter(PDL)`, which every PDL-aware
kernel calls before any load, store or early return (the modes, the contract and the launch
keywords: `pdl.py`).

Kept apart from `pdl.py` so that the host side can be imported before TRITON_INTERPRET is set
(the engine's tests do) without defining a Triton function: one defined then would be compiled,
not interpreted, and the interpreted kernels could not call it.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_enter(PDL: tl.constexpr):  # type: ignore[no-untyped-def]
    """A PDL kernel's entry (`pdl.py`): wait for the kernels ahead (WAIT, EARLY), then
    let the next kernel's programs be scheduled (EARLY)."""
    if PDL:
        gdc_wait()
    if PDL == 2:   # pdl.EARLY
        gdc_launch_dependents()
