"""Fused per-token small ops of the attention block: RMSNorm + RoPE (+ cache write) in one pass.

The fast forms of `kernels/ref/rope_norm.py` (same signatures):
    triton_q_norm_rope         q [T, H, D] -> RoPE(q / rms(q)) per head
    triton_kv_norm_rope_store  pool[slots[t]] = RoPE(w * kv[t] / rms(kv[t]))
    triton_qkv_norm_rope       the two above in one launch (their rows' code: the same bits)
    triton_rope                x [T, H, D] -> RoPE(x) per head, no norm (the indexer's queries)
    triton_rms_norm            x [..., D] -> w * x / rms(x)  (the blocks' and the model's RMSNorms)

Each replaces 8-15 eager ops (casts, square, mean, rsqrt, multiplies, the pair split / stack / cat
of the interleaved RoPE, the index_put of the cache write) by one launch: per decode step and layer
that is ~30 launches fewer (the step is host-bound: benchmarks/results/kernels_ii_h200_202611.md).
One program per row (a token's head for q, a token for kv): the row is loaded once, normalised
and rotated in fp32 registers, stored once in the output dtype. RoPE rotates interleaved pairs
(x[2i], x[2i+1]) of the trailing rd = 2 * cos.shape[-1] channels; cos / sin rows are the token's
(row // rows_per_token). Rounded as the reference rounds (fp32 throughout, one final cast); the
normalisation divides by sqrt where the reference multiplies by rsqrt (fp32-level differences).
`triton_rope` has no norm and is compiled without fp contraction (`enable_fp_fusion=False`: no
a * cos - b * sin fused into an FMA), so each product and difference is rounded as torch rounds
them: bit-equal to the reference. No host syncs: graph-capture safe. Tests:
tests/kernels/test_rope_norm.py, tests/kernels/test_rope.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels.triton.pdl import pdl_args
from dsv4.kernels.triton.pdl_enter import pdl_enter

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def rotate(x, cos_row, sin_row, D, rope_first,  # type: ignore[no-untyped-def]
           BLOCK_D: tl.constexpr):
    """fp32 row x [BLOCK_D] with its interleaved pairs from pair `rope_first` on rotated by the
    token's cos / sin rows (pointers to their first element); the other channels as they are."""
    a, b = tl.split(tl.reshape(x, (BLOCK_D // 2, 2)))
    pair = tl.arange(0, BLOCK_D // 2)
    is_rope = (pair >= rope_first) & (2 * pair < D)
    cos = tl.load(cos_row + (pair - rope_first), mask=is_rope, other=1.0)
    sin = tl.load(sin_row + (pair - rope_first), mask=is_rope, other=0.0)
    return tl.reshape(tl.join(tl.where(is_rope, a * cos - b * sin, a),
                              tl.where(is_rope, a * sin + b * cos, b)), (BLOCK_D,))


@triton.jit
def _norm_rope_row(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr,  # type: ignore[no-untyped-def]
                   slot_ptr, row, D, rows_per_token, rope_first, eps, stride_xt, stride_xh,
                   stride_cs, stride_out, NORM: tl.constexpr, ROPE: tl.constexpr,
                   SCATTER: tl.constexpr, BLOCK_D: tl.constexpr):
    """One row (int64 `row`) of x: normalised (NORM 1: x / rms(x); 2: w * x / rms(x)), rotated,
    stored at out[row] or out[slots[row]] (SCATTER)."""
    t = row // rows_per_token
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x_row = x_ptr + t * stride_xt + (row - t * rows_per_token) * stride_xh
    x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    # w before the row's sum: its load then shares x's memory round trip
    w = tl.load(w_ptr + offs, mask=mask & (NORM == 2), other=0.0).to(tl.float32)
    if NORM > 0:
        x = x / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        if NORM == 2:
            x = x * w
    y = x
    if ROPE:
        y = rotate(x, cos_ptr + t * stride_cs, sin_ptr + t * stride_cs, D, rope_first, BLOCK_D)
    dest = row
    if SCATTER:
        dest = tl.load(slot_ptr + row)
    tl.store(out_ptr + dest * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr,  # type: ignore[no-untyped-def]
                      slot_ptr, D, rows_per_token, rope_first, eps, stride_xt, stride_xh, stride_cs,
                      stride_out, NORM: tl.constexpr, ROPE: tl.constexpr, SCATTER: tl.constexpr,
                      BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    _norm_rope_row(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, slot_ptr,
                   tl.program_id(0).to(tl.int64), D, rows_per_token, rope_first, eps, stride_xt,
                   stride_xh, stride_cs, stride_out, NORM, ROPE, SCATTER, BLOCK_D)


@triton.jit
def _qkv_norm_rope_kernel(q_ptr, q_out_ptr, kv_ptr, w_ptr,  # type: ignore[no-untyped-def]
                          cos_ptr, sin_ptr, pool_ptr, slot_ptr, q_rows, D, H, rope_first, eps,
                          kv_eps, stride_qt, stride_qh, stride_kvt, stride_cs, stride_q_out,
                          stride_pool, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """Programs [0, q_rows): `triton_q_norm_rope`'s rows; the next T: `triton_kv_norm_rope_store`'s
    (the same row code and warps as their own launches: the same bits)."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    if row < q_rows:
        _norm_rope_row(q_ptr, q_ptr, cos_ptr, sin_ptr, q_out_ptr, q_ptr, row, D, H, rope_first,
                       eps, stride_qt, stride_qh, stride_cs, stride_q_out, 1, True, False, BLOCK_D)
    else:
        _norm_rope_row(kv_ptr, w_ptr, cos_ptr, sin_ptr, pool_ptr, slot_ptr, row - q_rows, D, 1,
                       rope_first, kv_eps, stride_kvt, stride_kvt, stride_cs, stride_pool, 2, True,
                       True, BLOCK_D)


def _warps(block_d: int) -> int:
    """Warps of a row program: up to 8, one per 256 channels (the row's sum follows them)."""
    return max(1, min(8, block_d // 256))


def check_rope(name: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, T: int) -> None:
    """The RoPE ops' input contract (also `sparse_attention`'s `inverse_rope`): x [T, ..., D] of
    `_DTYPES` with unit last stride, cos / sin [T, rd/2] float32 contiguous, rd <= D, D even;
    ValueError names the field."""
    if x.dtype not in _DTYPES or x.stride(-1) != 1:
        raise ValueError(f"{name} must be one of {[str(d) for d in _DTYPES]} with unit last "
                         f"stride; got {x.dtype} strides {x.stride()}")
    rd = 2 * cos.shape[-1]
    if (cos.shape != sin.shape or cos.dim() != 2 or cos.shape[0] != T
            or cos.dtype != torch.float32 or sin.dtype != torch.float32):
        raise ValueError(f"cos / sin must be [{T}, rd/2] float32; got {list(cos.shape)} "
                         f"{cos.dtype}, {list(sin.shape)} {sin.dtype}")
    if rd > x.shape[-1] or x.shape[-1] % 2 or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"rope dim {rd} must fit the even head dim {x.shape[-1]}; "
                         f"cos / sin contiguous")


def _check_kv(kv: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              pool: torch.Tensor, slots: torch.Tensor) -> None:
    if kv.dim() != 2 or pool.dim() != 2 or pool.shape[1] != kv.shape[1] or pool.stride(1) != 1:
        raise ValueError(f"kv [T, D] and pool [N, D] (unit last stride) must share D; got "
                         f"{list(kv.shape)}, {list(pool.shape)}")
    if (tuple(slots.shape) != (kv.shape[0],) or slots.dtype != torch.int64
            or tuple(weight.shape) != (kv.shape[1],)):
        raise ValueError(f"slots must be [{kv.shape[0]}] int64 and weight [{kv.shape[1]}]; got "
                         f"{list(slots.shape)} {slots.dtype}, {list(weight.shape)}")
    check_rope("kv", kv, cos, sin, kv.shape[0])


def _launch(x: torch.Tensor, rows_per_token: int, cos: torch.Tensor | None,
            sin: torch.Tensor | None, out: torch.Tensor, norm: int, eps: float = 0.0,
            weight: torch.Tensor | None = None, slots: torch.Tensor | None = None,
            fp_fusion: bool = True) -> None:
    """One program per row of x (`rows_per_token` rows of D per token); `fp_fusion=False` compiles
    without FMA contraction. x is read through its token and row strides (unit last stride), so
    column slices of a wider tensor (a fused projection's output) are read in place."""
    rows, D = x.numel() // x.shape[-1], x.shape[-1]
    if rows == 0:
        return
    x3 = x.reshape(-1, rows_per_token, D)         # a view wherever x's strides allow one
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    block_d = max(16, triton.next_power_of_2(D))
    half, stride_cs = (cos.shape[-1], cos.stride(0)) if cos is not None else (0, 0)
    _norm_rope_kernel[(rows,)](
        x3, weight if weight is not None else x3, cos if cos is not None else x3,
        sin if sin is not None else x3, out, slots if slots is not None else x3, D,
        rows_per_token, D // 2 - half, float(eps),
        x3.stride(0), x3.stride(1), stride_cs, out.stride(0),
        NORM=norm, ROPE=cos is not None, SCATTER=slots is not None,
        BLOCK_D=block_d, num_warps=_warps(block_d),
        **({} if fp_fusion else {"enable_fp_fusion": False}), **pdl_args(x3.device))


def triton_q_norm_rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       eps: float) -> torch.Tensor:
    """Same contract as `ref.rope_norm.q_norm_rope`: q [T, H, D] -> [T, H, D] in q's dtype."""
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, D]; got {list(q.shape)}")
    check_rope("q", q, cos, sin, q.shape[0])
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _launch(q, q.shape[1], cos, sin, out.view(-1, q.shape[-1]), norm=1, eps=eps)
    return out


def triton_kv_norm_rope_store(kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                              sin: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor) -> None:
    """Same contract as `ref.rope_norm.kv_norm_rope_store`:
    pool[slots[t]] = RoPE(w * kv[t] / rms(kv[t])).

    `kv`: [T, D]; `weight`: [D] fp32; `pool`: [N, D] with unit last stride; `slots`: [T] int64 in
    [0, N) (not checked: a host sync). Slots must be distinct (the engine's SWA write slots are).
    """
    _check_kv(kv, weight, cos, sin, pool, slots)
    _launch(kv, 1, cos, sin, pool, norm=2, eps=eps, weight=weight,
            slots=slots.contiguous())


def triton_qkv_norm_rope(q: torch.Tensor, eps: float, kv: torch.Tensor, weight: torch.Tensor,
                         kv_eps: float, cos: torch.Tensor, sin: torch.Tensor, pool: torch.Tensor,
                         slots: torch.Tensor) -> torch.Tensor:
    """Same contract as `ref.rope_norm.qkv_norm_rope`: `triton_q_norm_rope(q, cos, sin, eps)`
    (returned) and `triton_kv_norm_rope_store(kv, weight, kv_eps, cos, sin, pool, slots)` in one
    launch, bit for bit (the same row code at the same warps). q's head dim must equal kv's (the
    attention's single KV head has the query heads' dim)."""
    if q.dim() != 3 or kv.dim() != 2 or q.shape[-1] != kv.shape[-1] or q.shape[0] != kv.shape[0]:
        raise ValueError(f"q [T, H, D] and kv [T, D] must share T and D; got {list(q.shape)}, "
                         f"{list(kv.shape)}")
    check_rope("q", q, cos, sin, q.shape[0])
    _check_kv(kv, weight, cos, sin, pool, slots)
    T, H, D = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    q3 = q if q.stride(-1) == 1 else q.contiguous()
    block_d = max(16, triton.next_power_of_2(D))
    _qkv_norm_rope_kernel[(T * H + T,)](
        q3, out, kv, weight, cos, sin, pool, slots.contiguous(), T * H, D, H,
        D // 2 - cos.shape[-1], float(eps), float(kv_eps), q3.stride(0), q3.stride(1),
        kv.stride(0), cos.stride(0), D, pool.stride(0), BLOCK_D=block_d,
        num_warps=_warps(block_d), **pdl_args(q.device))
    return out


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as `kernels.ref.rope_norm.rms_norm`: w * x / rms(x) over the last dim, in x's
    dtype."""
    if x.dtype not in _DTYPES or tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"x must be one of {[str(d) for d in _DTYPES]} and weight "
                         f"[{x.shape[-1]}]; got {x.dtype}, {list(weight.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, 1, None, None, out.view(-1, x.shape[-1]), norm=2, eps=eps,
            weight=weight)
    return out


def triton_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Same contract as `ref.rope_norm.rope`: x [T, H, D] -> [T, H, D] in x's dtype, RoPE on the
    trailing 2 * cos.shape[-1] channels of each head (cos / sin [T, rd/2] fp32 contiguous);
    bit-equal to the reference (no FMA contraction)."""
    if x.dim() != 3:
        raise ValueError(f"x must be [T, H, D]; got {list(x.shape)}")
    check_rope("x", x, cos, sin, x.shape[0])
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, x.shape[1], cos, sin, out.view(-1, x.shape[-1]), norm=0, fp_fusion=False)
    return out
