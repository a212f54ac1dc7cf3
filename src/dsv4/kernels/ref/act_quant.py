"""FP8 activation quantisation of the reference model (spec §11.1-2: `act_quant(x, 128, ue8m0)`).

Every FP8 linear and every FP4 routed expert of the released model reads its input quantised per
token and per 128 channels: one block of a row gets the power-of-two scale

    s = 2^ceil(log2(max(amax, 1e-4) * (1 / 448)))     (amax = max |x| over the block)

and its values become e4m3 codes q = e4m3(x / s) (round to nearest even; |x / s| <= 448 by the
choice of s, so nothing saturates). The dequantised value is q * s. The ceil of log2 is taken on
the float32 bits (exponent, plus one if any mantissa bit is set), as the reference's
`fast_round_scale` does, so a product that is exactly a power of two keeps its exponent.

Consumers (`kernels/ref/moe.py::routed_experts_a8`, the W8A8 expert kernels of
`kernels/triton/moe_w8a8.py`) multiply e4m3 x e4m3 products by the activation scale and the
weight's block scale, both powers of two: exact, so the activation's only rounding is the e4m3
code itself.
"""

from __future__ import annotations

import torch

ACT_BLOCK = 128
AMAX_FLOOR = 1e-4
E4M3_MAX = 448.0


def pow2_ceil_scale(amax: torch.Tensor) -> torch.Tensor:
    """fp32 2^ceil(log2(max(amax, 1e-4) * fp32(1/448))) for fp32 `amax` (>= 0), from the bits."""
    t = amax.float().clamp(min=AMAX_FLOOR) * torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32)
    bits = t.view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def act_quant(x: torch.Tensor, block: int = ACT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] (any float dtype) -> (codes [..., d] float8_e4m3fn, scales [..., ceil(d/block)]
    fp32 powers of two); a partial last block takes the amax of its own columns."""
    if block < 1:
        raise ValueError(f"block={block} is invalid; allowed: >= 1")
    d = x.shape[-1]
    blocks = -(-d // block)
    wide = torch.nn.functional.pad(x.float(), (0, blocks * block - d))
    grouped = wide.view(*x.shape[:-1], blocks, block)
    scale = pow2_ceil_scale(grouped.abs().amax(dim=-1))
    q = (grouped * (1.0 / scale)[..., None]).clamp(-E4M3_MAX, E4M3_MAX)
    codes = q.to(torch.float8_e4m3fn).view(*x.shape[:-1], blocks * block)[..., :d]
    return codes.contiguous(), scale


def act_dequant(codes: torch.Tensor, scale: torch.Tensor, block: int = ACT_BLOCK) -> torch.Tensor:
    """The fp32 values codes * scale of `act_quant`'s output."""
    d = codes.shape[-1]
    per_col = scale.repeat_interleave(block, dim=-1)[..., :d]
    return codes.float() * per_col


def fake_act_quant(x: torch.Tensor, block: int = ACT_BLOCK) -> torch.Tensor:
    """x quantised and dequantised (fp32): what an FP8 consumer of x computes with."""
    return act_dequant(*act_quant(x, block), block)
