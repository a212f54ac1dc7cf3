"""Reference SwiGLU with DeepSeek-V4's clamp (spec §8): the `swiglu` op's spec
(`kernels/triton/swiglu.py::triton_swiglu`), used by the experts (`ref/moe.py`) and by the FP8
linear's SwiGLU mode (`ref/fp8_linear.py`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit)."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
