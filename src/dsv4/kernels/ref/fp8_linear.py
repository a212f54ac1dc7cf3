"""Reference weight-only FP8 linear: `y = x @ dequant(w, scale).T`, the spec of
`kernels/triton/fp8_linear.py::triton_fp8_linear` (op `quant_linear`, `kernels/ops.py`).

w [N, K] holds e4m3 codes (torch.float8_e4m3fn, or their raw uint8 bytes), scale
[ceil(N/128), ceil(K/128)] UE8M0 exponent codes (uint8 or float8_e8m0fnu, 2^(c-127)), one per
128x128 block, as DeepSeek-V4 checkpoints store their dense linears (`ref/quant.py`). The weight is
dequantised to x's dtype, which is exact for bf16 / fp32 (a code times a power of two), then
`F.linear`: the same values as the model whose linears were dequantised at load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv4.kernels.ref.act_quant import fake_act_quant
from dsv4.kernels.ref.quant import dequant_fp8_block
from dsv4.kernels.ref.swiglu import swiglu


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, *, groups: int = 1,
               counters: torch.Tensor | None = None, up: torch.Tensor | None = None,
               limit: float = 0.0) -> torch.Tensor:
    """x [..., K] bf16 / fp16 / fp32 -> [..., N] in x's dtype (`F.linear` on the decoded w).
    `groups` g > 1: the block-diagonal product of the grouped output projection (attention
    `wo_a`): x [..., g, K] -> [..., g, N / g], group i through weight rows [i N / g, (i + 1) N /
    g). `up` (SwiGLU mode, groups 1): x is the gate and the input is `swiglu(x, up, limit)`
    (`ref/swiglu.py`). `counters` (the kernel's split-K scratch) is unused here."""
    if up is not None:
        if groups != 1 or up.shape != x.shape:
            raise ValueError(f"the SwiGLU mode (up=) takes groups 1 and up of x's shape "
                             f"{list(x.shape)}; got groups {groups}, up {list(up.shape)}")
        x = swiglu(x, up, limit)
    codes = w.view(torch.float8_e4m3fn) if w.dtype == torch.uint8 else w
    weight = dequant_fp8_block(codes, scale, x.dtype)
    if groups == 1:
        return F.linear(x, weight)
    if x.dim() < 2 or x.shape[-2] != groups or weight.shape[0] % groups:
        raise ValueError(f"groups {groups} needs x [..., {groups}, K] and N a multiple of it; got "
                         f"x {list(x.shape)}, N {weight.shape[0]}")
    rows = weight.shape[0] // groups
    return torch.stack([F.linear(x[..., i, :], weight[i * rows:(i + 1) * rows])
                        for i in range(groups)], -2)


def fp8_linear_a8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The reference model's FP8 linear (spec §11.1): x [..., K] through `act_quant` (per token,
    per 128 channels, e4m3) times the decoded w, fp32 products and sums, one rounding to x's
    dtype. The spec of `kernels/triton/fp8_linear_a8.py::triton_fp8_linear_a8`."""
    codes = w.view(torch.float8_e4m3fn) if w.dtype == torch.uint8 else w
    return F.linear(fake_act_quant(x), dequant_fp8_block(codes, scale, torch.float32)).to(x.dtype)


def dense_linear(x: torch.Tensor, w: torch.Tensor, *,
                 counters: torch.Tensor | None = None) -> torch.Tensor:
    """The `linear` op's reference: `F.linear(x, w)` (x [..., K], w [N, K] float); `counters`
    (the kernel's split-K scratch) is unused here."""
    return F.linear(x, w)
