"""Flash Compressor, short windows with several tokens per program (`tokens=G`).

Owns `launch_group`, which serves `triton_compress_cached(..., tokens=G)`: the same step as
`compressor.py::_compress_kernel` (read its module docstring for the semantics, the load schedule
and the invariants), but program p serves tokens [p * G, p * G + G) with one [G, S, Dc] tile per
gathered tensor instead of one token's [S, Dc]. Only for windows pooled in one chunk (S <= 16, C4's
8 slots).

Why. A C4 indexer compressor program (Dc = 128) moves ~12 KB per token, so one program per token
makes a decode launch thousands of small programs whose fixed latency (two dependent memory round
trips, the launch's ramp) dominates: at large batch they reach a much smaller fraction of the copy
rate than the attention compressor's 46 KB programs, and a pure-read experiment with the same
[8, 128] tiles (`bench_row_reads.py`) tops out well below what 16-32 KB tiles reach. G tokens per
program give the indexer's programs more bytes in flight; 2 tokens at 2 warps is the default
(`compressor_config.default_tokens`). Measurements: benchmarks/results/compressor_h200_202611.md.

Differences from the one-token kernel, all masks: tokens past T; tokens that complete no window
(their slots are masked invalid, so their gathers move no bytes, and their entry store is masked),
instead of a branch around the pooling (a branch cannot be per token). The pooling of a one-chunk
window is the online softmax's single step written directly (den = sum_s e^(z - max),
acc = sum_s e^(z - max) k), the norm and RoPE per token row.

Test: tests/kernels/test_compressor_triton.py (`tokens` knobs).
Benchmark: benchmarks/kernels/bench_compressor.py --sweep.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels.triton.compressor_ape import slot_ape
from dsv4.kernels.triton.pdl import pdl_args
from dsv4.kernels.triton.pdl_enter import pdl_enter


@triton.jit
def _compress_group_kernel(  # type: ignore[no-untyped-def]
    kv_ptr, score_ptr, ring_kv_ptr, ring_score_ptr,
    src_new_ptr, src_ring_ptr, from_new_ptr, valid_ptr, write_slot_ptr, ring_write_ptr,
    w_ptr, cos_ptr, sin_ptr, out_ptr, ape_ptr,
    T, out_trash, ring_trash, eps,
    stride_kv, stride_ring, stride_cs, stride_out, stride_ape,
    S: tl.constexpr, RATIO: tl.constexpr, DC: tl.constexpr, WIDTH: tl.constexpr,
    ROPE_FIRST: tl.constexpr, G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_W: tl.constexpr, OVERLAP: tl.constexpr, WRITE_RING: tl.constexpr,
    HAS_APE: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    tok = tl.program_id(0).to(tl.int64) * G + tl.arange(0, G)                  # [G]
    t_ok = tok < T
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < DC
    # ---- round trip 1: metadata, the index rows [G, BLOCK_S], the own rows, the norm weight
    slot = tl.load(write_slot_ptr + tok, mask=t_ok, other=out_trash)
    if WRITE_RING:
        dst = tl.load(ring_write_ptr + tok, mask=t_ok, other=ring_trash)
    idx = tok[:, None] * S + offs_s[None, :]
    in_row = t_ok[:, None] & (offs_s < S)[None, :]
    new_row = tl.load(src_new_ptr + idx, mask=in_row, other=0)
    ring_row = tl.load(src_ring_ptr + idx, mask=in_row, other=0)
    is_new = tl.load(from_new_ptr + idx, mask=in_row, other=0) != 0
    ok = (tl.load(valid_ptr + idx, mask=in_row, other=0) != 0) & in_row
    if WRITE_RING:
        offs_w = tl.arange(0, BLOCK_W)
        w_mask = t_ok[:, None] & (offs_w < WIDTH)[None, :]
        row_kv = tl.load(kv_ptr + tok[:, None] * stride_kv + offs_w[None, :], mask=w_mask)
        row_score = tl.load(score_ptr + tok[:, None] * stride_kv + offs_w[None, :], mask=w_mask)
    w = tl.load(w_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    if WRITE_RING:   # never the trash row (tokens past T carry dst = trash)
        keep = w_mask & (dst != ring_trash)[:, None]
        tl.store(ring_kv_ptr + dst[:, None] * stride_ring + offs_w[None, :], row_kv, mask=keep)
        tl.store(ring_score_ptr + dst[:, None] * stride_ring + offs_w[None, :], row_score,
                 mask=keep)
    # ---- round trip 2: the gathers, [G, BLOCK_S, BLOCK_D]; a token completing no window gathers
    # nothing
    emits = slot != out_trash
    take = (ok & emits[:, None])[:, :, None] & d_mask[None, None, :]
    # slots [0, ratio) read the Ca half, [ratio, 2 ratio) the Cb half (a product: x16 divisibility)
    if OVERLAP:
        cols = ((offs_s // RATIO) * DC)[:, None] + offs_d[None, :]
    else:
        cols = tl.zeros([BLOCK_S], tl.int32)[:, None] + offs_d[None, :]
    kv_rows = tl.where(is_new, kv_ptr + new_row * stride_kv, ring_kv_ptr + ring_row * stride_ring)
    score_rows = tl.where(is_new, score_ptr + new_row * stride_kv,
                          ring_score_ptr + ring_row * stride_ring)
    k = tl.load(kv_rows[:, :, None] + cols[None, :, :], mask=take, other=0.0)
    z = tl.load(score_rows[:, :, None] + cols[None, :, :], mask=take, other=float("-inf"))
    if HAS_APE:   # the slots' ape, one [BLOCK_S, BLOCK_D] tile for every token (compressor.py)
        z += slot_ape(ape_ptr, stride_ape, offs_s, cols,
                      (offs_s < S)[:, None] & d_mask[None, :], RATIO)[None, :, :]
    pair = tl.arange(0, BLOCK_D // 2)
    is_rope = (pair >= ROPE_FIRST) & (2 * pair < DC)
    cs_off = tok[:, None] * stride_cs + (pair - ROPE_FIRST)[None, :]
    cs_mask = t_ok[:, None] & is_rope[None, :]
    cos = tl.load(cos_ptr + cs_off, mask=cs_mask, other=0.0)                   # [G, BLOCK_D / 2]
    sin = tl.load(sin_ptr + cs_off, mask=cs_mask, other=0.0)
    # ---- pool (softmax over the slots, per channel), norm, RoPE, store: per token row
    m = tl.max(z, axis=1)                                                      # [G, BLOCK_D]
    m = tl.where(m == float("-inf"), 0.0, m)
    p = tl.exp(z - m[:, None, :])
    den = tl.sum(p, axis=1)
    acc = tl.sum(p * k, axis=1)
    pooled = tl.where(d_mask[None, :] & (den > 0), acc / tl.where(den > 0, den, 1.0), 0.0)
    inv_rms = 1.0 / tl.sqrt(tl.sum(pooled * pooled, axis=1) / DC + eps)       # [G]
    y = w[None, :] * (pooled * inv_rms[:, None])
    a, b = tl.split(tl.reshape(y, (G, BLOCK_D // 2, 2)))
    ra = tl.where(is_rope[None, :], a * cos - b * sin, a)
    rb = tl.where(is_rope[None, :], a * sin + b * cos, b)
    entry = tl.reshape(tl.join(ra, rb), (G, BLOCK_D))
    tl.store(out_ptr + slot[:, None] * stride_out + offs_d[None, :],
             entry.to(out_ptr.dtype.element_ty), mask=(emits & t_ok)[:, None] & d_mask[None, :])


def launch_group(kv: torch.Tensor, score: torch.Tensor, ring_kv: torch.Tensor,
                 ring_score: torch.Tensor, index: tuple[torch.Tensor, ...],
                 norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                 out: torch.Tensor, *, ape: torch.Tensor | None, ratio: int, overlap: bool,
                 tokens: int, write_ring: bool, num_warps: int, num_stages: int) -> None:
    """One launch of ceil(T / tokens) programs (inputs checked by `triton_compress_cached`;
    S <= 16); `ape`: added per slot (None: the scores include it)."""
    T, width = kv.shape
    Dc, S = out.shape[1], index[0].shape[1]
    _compress_group_kernel[(triton.cdiv(T, tokens),)](
        kv, score, ring_kv, ring_score, *index[:6], norm_weight, cos, sin, out,
        score if ape is None else ape, T, out.shape[0] - 1, ring_kv.shape[0] - 1, eps,
        kv.stride(0), ring_kv.stride(0), cos.stride(0), out.stride(0),
        0 if ape is None else ape.stride(0),
        S=S, RATIO=ratio, DC=Dc, WIDTH=width, ROPE_FIRST=Dc // 2 - cos.shape[1], G=tokens,
        BLOCK_S=triton.next_power_of_2(S), BLOCK_D=triton.next_power_of_2(Dc),
        BLOCK_W=triton.next_power_of_2(width),
        OVERLAP=overlap, WRITE_RING=write_ring, HAS_APE=ape is not None, num_warps=num_warps,
        num_stages=num_stages,
        **pdl_args(kv.device),
    )
