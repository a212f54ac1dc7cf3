"""The RMSNorm module (spec §4, §6.2); its ops are `kernels/ref/rope_norm.py::rms_norm` /
`rms_normalize`.

Statistics are always computed in fp32. The weighted norm keeps its weight in fp32 (as the
reference does; the checkpoint stores it in bf16) and casts once at the end to the input dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.kernels.ref.rope_norm import rms_norm
from dsv4.kernels.registry import KernelOps
from dsv4.model.forward_context import ForwardContext
from dsv4.model.kernel_values import kernel_values


class RMSNorm(nn.Module):
    """`w * x / sqrt(mean(x^2) + eps)`, multiplied in fp32 and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None,
                values: KernelOps | None = None) -> torch.Tensor:
        """x: [..., dim]; with a ForwardContext (serving) the kernel backend's `rms_norm` op; with
        `values` (a full-sequence `ForwardMode.values`) that op's values and the reference's
        gradient."""
        if ctx is not None:
            return ctx.ops.rms_norm(x, self.weight, self.eps)
        if values is not None:
            ops, eps = values, self.eps
            return kernel_values(lambda x_, w: ops.rms_norm(x_, w, eps),
                                 lambda x_, w: rms_norm(x_, w, eps), x, self.weight)
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
