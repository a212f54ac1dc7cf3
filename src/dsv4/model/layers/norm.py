"""RMSNorm, weighted and unweighted (spec §4, §6.2).

Statistics are always computed in fp32. The weighted norm keeps its weight in fp32 (as the
reference does; the checkpoint stores it in bf16) and casts once at the end to the input dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:   # (a runtime import would cycle: forward_context -> kernels -> ref ops -> this module)
    from dsv4.model.forward_context import ForwardContext


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim, statistics in fp32, result in x's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / sqrt(mean(x^2) + eps)` over the last dim in fp32 (weight fp32), cast to x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (weight * xf).to(x.dtype)


class RMSNorm(nn.Module):
    """`w * x / sqrt(mean(x^2) + eps)`, multiplied in fp32 and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        """x: [..., dim]; with a ForwardContext (serving) the kernel backend's `rms_norm` op."""
        if ctx is not None:
            return ctx.ops.rms_norm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
