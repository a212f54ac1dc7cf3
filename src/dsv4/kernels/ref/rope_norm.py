"""Reference RMSNorm and RoPE ops (spec §4, §6.1-6.2): the pure functions the model's layers use,
and the per-token ops of the attention block that `kernels/triton/rope_norm.py` implements with
the same signatures.

    rms_normalize       x / rms(x)                   unweighted, statistics in fp32
    rms_norm            w * x / rms(x)               weighted (w fp32), cast once to x's dtype
    apply_rope          interleaved partial RoPE     on the trailing 2 * cos.shape[-1] channels
    q_norm_rope         q = RoPE(q / rms(q))         per head, unweighted norm (q path after wq_b)
    kv_norm_rope_store  pool[slots] = RoPE(w * kv / rms(kv))
                                                     the window kv: weighted norm, RoPE, cache write
    qkv_norm_rope       q_norm_rope + kv_norm_rope_store, one op (one launch in Triton)
    rope_inverse        o = RoPE^-1(o)               de-rotation of the attention output
    rope                x = RoPE(x)                  per head, no norm (the indexer's queries)

The serving ops are compositions of the first three, the same torch ops in the same order as the
full-sequence path of `model/attention.py`, so the `ref` backend computes what that path computes.
"""

from __future__ import annotations

import torch

from dsv4.kernels.ref.index_keys import quantize_index_keys


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim, statistics in fp32, result in x's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / sqrt(mean(x^2) + eps)` over the last dim in fp32 (weight fp32).

    Cast once to x's dtype.
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (weight * xf).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing 2*cos.shape[-1] channels of x; `inverse` rotates by -φ (de-rotation).

    x: [..., D]; cos/sin broadcastable to [..., rope_dim // 2]. Pairs are (x[2i], x[2i+1]) inside
    the rope slice (GPT-J / complex layout). Computed in fp32, returned in x's dtype.
    """
    rd = 2 * cos.shape[-1]
    pairs = x[..., -rd:].float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    if inverse:
        sin = -sin
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rd], rotated.to(x.dtype)), dim=-1)


def q_norm_rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """q: [T, H, D] -> [T, H, D] (q's dtype); cos/sin: [T, rd/2] fp32 (RoPE on the last rd dims).

    Normalised and rotated in fp32, rounded once to q's dtype (as the fused kernel does)."""
    return apply_rope(rms_normalize(q.float(), eps), cos.unsqueeze(-2),
                      sin.unsqueeze(-2)).to(q.dtype)


def kv_norm_rope_store(kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                       sin: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor) -> None:
    """Writes the normed, rotated window kv into `pool[slots]` in place (fp32 math, one
    rounding to the pool's dtype, as the fused kernel does).

    kv: [T, D]; weight: [D] fp32; cos/sin: [T, rd/2]; pool: [N, D]; slots: [T] int64 rows of pool.
    """
    pool[slots] = apply_rope(rms_norm(kv.float(), weight, eps), cos, sin).to(pool.dtype)


def qkv_norm_rope(q: torch.Tensor, eps: float, kv: torch.Tensor, weight: torch.Tensor,
                  kv_eps: float, cos: torch.Tensor, sin: torch.Tensor, pool: torch.Tensor,
                  slots: torch.Tensor) -> torch.Tensor:
    """`q_norm_rope(q, cos, sin, eps)` (returned), then `kv_norm_rope_store(kv, weight, kv_eps,
    cos, sin, pool, slots)`: the attention's two per-token norms after its projections, one op."""
    out = q_norm_rope(q, cos, sin, eps)
    kv_norm_rope_store(kv, weight, kv_eps, cos, sin, pool, slots)
    return out


def rope_inverse(o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """o: [T, H, D] -> [T, H, D] rotated by -φ on the trailing rd channels."""
    return apply_rope(o, cos.unsqueeze(-2), sin.unsqueeze(-2), inverse=True)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] -> [T, H, D] in x's dtype; cos/sin: [T, rd/2] fp32 (one row per token, shared
    by its heads). RoPE on the trailing rd channels of each head, the leading D - rd copied
    unchanged: `apply_rope` with the token's row broadcast over the heads."""
    return apply_rope(x, cos.unsqueeze(-2), sin.unsqueeze(-2))


def rope_fp8(x: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope` (in x's dtype), then each head -> (e4m3 codes [T, H, D], power-of-two fp32 scales
    [T, H]) as `quantize_index_keys` quantises a key: the indexer's queries over FP8 keys."""
    return quantize_index_keys(rope(x, cos, sin))
