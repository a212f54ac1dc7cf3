"""Flash Compressor for a CSA layer's two compressors in one launch (spec §6.5, §6.6).

Owns `triton_compress_pair`, the fast form of `kernels/ref/compressor.py::compress_cached_pair`
(serving-reference §1.6; the `compress_pair` op). A CSA layer has two overlap (C4) compressors over
the same tokens: the attention one (Dc = 512) and its indexer's (Id = 128). One step plan
(`CompressPlan.index`, the entry positions' cos / sin) addresses both: same source slots, same ring
rows, same entry rows. So one program per token can serve both:

    round trip 1   write_slot, ring_write, the index rows ONCE, the token's own rows of both
                   projections, both norm weights; then both ring rows are written (decode:
                   `ring_reads_disjoint`)
    round trip 2   both gathers ([S, Dc_a] and [S, Dc_b] tiles, fp32), cos / sin behind them
    then           each pool -> RMSNorm -> RoPE -> its entry pool, as `compressor.py` computes one
                   (the same device functions in the same order; the entries agree with two single
                   launches to rounding: other warp counts sum in other orders)

Why, and when. Fused, the index rows are read once and a CSA layer's step has one launch fewer. On
the H200 that is faster than two single launches up to B = 256 and slower from B = 1024 and in
prefill, where the wider program's registers cost occupancy; the indexer compressor's
2-tokens-per-program default makes the singles faster still there
(benchmarks/results/compressor_h200_202611.md). So steps of more than _FUSE_MAX_TOKENS tokens run
the two single launches (a shape rule: no host sync).

FP8 indexer keys: a second target with `out_scale` (`CompressTarget`) gets its entries rounded to
its `key_dtype`, then to e4m3 codes and a power-of-two scale (`act_quant.py`'s `quant_row`, as the
reference's `quantize_index_keys`), in this launch at any T (the single launches do not write
FP8).

Scope: windows of one chunk (C4: S = 8), both compressors with overlap; anything else raises (call
the single op). Prefill / extend (`ring_reads_disjoint` False) writes both rings in a second and
third launch after the first has read them, as `triton_compress_cached` does.

Test: tests/kernels/test_compressor_pair.py. Benchmark: benchmarks/kernels/bench_compressor.py
(case c4-pair).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels.ref.compressor import CompressIndex, CompressTarget, compress_geometry
from dsv4.kernels.triton.act_quant import quant_row
from dsv4.kernels.triton.compressor import (
    entry_value,
    fold_chunk,
    gather_chunk,
    launch_compress,
    load_index,
    load_rope,
    store_entry,
    write_ring_rows,
)
from dsv4.kernels.triton.compressor_checks import check_inputs
from dsv4.kernels.triton.pdl import pdl_args
from dsv4.kernels.triton.pdl_enter import pdl_enter

_MAX_WINDOW = 16            # S: the window is pooled in one [next_pow2(S), Dc] tile per compressor
# the H200 sweep's best at B 64, 256, 4096 (2 warps at 1024, where singles win anyway)
_DEFAULT_WARPS = 4
# fused up to here (faster at T 64 / 256), two single launches above (faster at 1024+)
_FUSE_MAX_TOKENS = 512
_KEY_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _own_row(kv_ptr, score_ptr, t, stride_kv,  # type: ignore[no-untyped-def]
             WIDTH: tl.constexpr, BLOCK_W: tl.constexpr):
    """Token t's kv / score rows (unmasked by the ring slot: they must not wait for it)."""
    offs = tl.arange(0, BLOCK_W)
    mask = offs < WIDTH
    return (tl.load(kv_ptr + t * stride_kv + offs, mask=mask),
            tl.load(score_ptr + t * stride_kv + offs, mask=mask))


@triton.jit
def _store_ring_row(ring_kv_ptr, ring_score_ptr, dst, ring_trash,  # type: ignore[no-untyped-def]
                    stride_ring, row_kv, row_score, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr):
    offs = tl.arange(0, BLOCK_W)
    # NOTE: not &, see compressor._compress_kernel
    keep = tl.where(dst != ring_trash, offs < WIDTH, False)
    tl.store(ring_kv_ptr + dst * stride_ring + offs, row_kv, mask=keep)
    tl.store(ring_score_ptr + dst * stride_ring + offs, row_score, mask=keep)


@triton.jit
def _compress_pair_kernel(  # type: ignore[no-untyped-def]
    kv_a, score_a, ring_kv_a, ring_score_a, w_a, out_a, ape_a,
    kv_b, score_b, ring_kv_b, ring_score_b, w_b, out_b, ape_b, scale_b,
    src_new_ptr, src_ring_ptr, from_new_ptr, valid_ptr, write_slot_ptr, ring_write_ptr, cos_ptr,
    sin_ptr,
    out_trash, ring_trash, eps,
    stride_kv_a, stride_ring_a, stride_out_a, stride_kv_b, stride_ring_b, stride_out_b, stride_cs,
    S: tl.constexpr, RATIO: tl.constexpr, DC_A: tl.constexpr, DC_B: tl.constexpr,
    ROPE_FIRST_A: tl.constexpr, ROPE_FIRST_B: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr, WRITE_RING: tl.constexpr,
    HAS_APE: tl.constexpr, FP8_B: tl.constexpr, KEY_DTYPE: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    # Load schedule as in compressor._compress_kernel (its module docstring, "Latency"), for two
    # compressors.
    t = tl.program_id(0).to(tl.int64)
    offs_a = tl.arange(0, BLOCK_DA)
    offs_b = tl.arange(0, BLOCK_DB)
    mask_a = offs_a < DC_A
    mask_b = offs_b < DC_B
    # ---- round trip 1: metadata, the index rows (shared), both own rows, both norm weights
    slot = tl.load(write_slot_ptr + t)
    if WRITE_RING:
        dst = tl.load(ring_write_ptr + t)
    new_row, ring_row, is_new, ok = load_index(src_new_ptr, src_ring_ptr, from_new_ptr, valid_ptr,
                                               t * S, 0, S, BLOCK_S)
    if WRITE_RING:
        row_kv_a, row_score_a = _own_row(kv_a, score_a, t, stride_kv_a, 2 * DC_A, 2 * BLOCK_DA)
        row_kv_b, row_score_b = _own_row(kv_b, score_b, t, stride_kv_b, 2 * DC_B, 2 * BLOCK_DB)
    wa = tl.load(w_a + offs_a, mask=mask_a, other=0.0).to(tl.float32)
    wb = tl.load(w_b + offs_b, mask=mask_b, other=0.0).to(tl.float32)
    if WRITE_RING:
        _store_ring_row(ring_kv_a, ring_score_a, dst, ring_trash, stride_ring_a, row_kv_a,
                        row_score_a, 2 * DC_A, 2 * BLOCK_DA)
        _store_ring_row(ring_kv_b, ring_score_b, dst, ring_trash, stride_ring_b, row_kv_b,
                        row_score_b, 2 * DC_B, 2 * BLOCK_DB)
    if slot != out_trash:
        pair_a = tl.arange(0, BLOCK_DA // 2)
        pair_b = tl.arange(0, BLOCK_DB // 2)
        rope_a = (pair_a >= ROPE_FIRST_A) & (2 * pair_a < DC_A)
        rope_b = (pair_b >= ROPE_FIRST_B) & (2 * pair_b < DC_B)
        # ---- round trip 2: both gathers, then cos / sin (their layout conversions wait for them)
        # (the ape rows: 2 DC wide, contiguous, so their row stride is the ring rows' width)
        k_a, z_a = gather_chunk(kv_a, score_a, ring_kv_a, ring_score_a, ape_a, stride_kv_a,
                                stride_ring_a, 2 * DC_A, new_row, ring_row, is_new, ok, 0, offs_a,
                                mask_a, RATIO, DC_A, BLOCK_S, True, HAS_APE)
        k_b, z_b = gather_chunk(kv_b, score_b, ring_kv_b, ring_score_b, ape_b, stride_kv_b,
                                stride_ring_b, 2 * DC_B, new_row, ring_row, is_new, ok, 0, offs_b,
                                mask_b, RATIO, DC_B, BLOCK_S, True, HAS_APE)
        cos_a, sin_a = load_rope(cos_ptr, sin_ptr, t, stride_cs, pair_a, rope_a, ROPE_FIRST_A)
        cos_b, sin_b = load_rope(cos_ptr, sin_ptr, t, stride_cs, pair_b, rope_b, ROPE_FIRST_B)
        _, den_a, acc_a = fold_chunk(k_a, z_a, tl.full([BLOCK_DA], float("-inf"), tl.float32),
                                     tl.zeros([BLOCK_DA], tl.float32),
                                     tl.zeros([BLOCK_DA], tl.float32))
        _, den_b, acc_b = fold_chunk(k_b, z_b, tl.full([BLOCK_DB], float("-inf"), tl.float32),
                                     tl.zeros([BLOCK_DB], tl.float32),
                                     tl.zeros([BLOCK_DB], tl.float32))
        store_entry(den_a, acc_a, wa, cos_a, sin_a, rope_a, eps, out_a + slot * stride_out_a,
                    offs_a, mask_a, DC_A, BLOCK_DA)
        if FP8_B:
            entry_b = entry_value(den_b, acc_b, wb, cos_b, sin_b, rope_b, eps, mask_b, DC_B,
                                  BLOCK_DB)
            codes, scale = quant_row(entry_b.to(KEY_DTYPE).to(tl.float32))  # 0 off mask_b
            tl.store(out_b + slot * stride_out_b + offs_b, codes.to(tl.uint8, bitcast=True),
                     mask=mask_b)
            tl.store(scale_b + slot, scale)
        else:
            store_entry(den_b, acc_b, wb, cos_b, sin_b, rope_b, eps, out_b + slot * stride_out_b,
                        offs_b, mask_b, DC_B, BLOCK_DB)


def _check_pair(first: CompressTarget, second: CompressTarget, index: CompressIndex,
                cos: torch.Tensor, sin: torch.Tensor) -> tuple[int, int]:
    """Each compressor's own checks, then what sharing one plan needs. Returns (ratio, S)."""
    for c in (first, second):
        check_inputs(c.kv, c.score, c.ring_kv, c.ring_score, index, c.norm_weight, cos, sin, c.out,
                     c.ape, c.out_scale)
    if first.out_scale is not None:
        raise ValueError("compress_pair: FP8 entries (out_scale) only for the second target (the "
                         "indexer keys); got one for the first")
    if second.out_scale is not None and second.key_dtype not in _KEY_DTYPES:
        raise ValueError(f"compress_pair: key_dtype must be one of {list(_KEY_DTYPES)}; got "
                         f"{second.key_dtype}")
    if (first.ape is None) != (second.ape is None):
        raise ValueError("compress_pair: both targets carry an ape or neither does; got one")
    (ratio, overlap), (ratio_b, overlap_b) = (compress_geometry(c.kv, index, c.out)
                                              for c in (first, second))
    S = index.src_new.shape[1]
    if not (overlap and overlap_b) or S > _MAX_WINDOW:
        raise ValueError(f"compress_pair fuses two overlap compressors with windows "
                         f"S <= {_MAX_WINDOW}; got overlap {overlap} / {overlap_b}, S {S} "
                         f"(use the single compress op)")
    rows = {"ring rows": (first.ring_kv.shape[0], second.ring_kv.shape[0]),
            "entry rows": (first.out.shape[0], second.out.shape[0])}
    for name, (a, b) in rows.items():
        if a != b:
            raise ValueError(f"compress_pair: one plan addresses both compressors, so their "
                             f"{name} must match; got {a} and {b}")
    return ratio, S


def triton_compress_pair(first: CompressTarget, second: CompressTarget, index: CompressIndex,
                         eps: float, cos: torch.Tensor, sin: torch.Tensor, *,
                         fuse: bool | None = None, invariant: bool = False,
                         num_warps: int | None = None, num_stages: int = 2) -> None:
    """Same contract as `compress_cached_pair` (in place). Each target as
    `triton_compress_cached`'s arguments (kv / score [T, 2 Dc] fp32, rings [N_ring, 2 Dc] fp32, norm
    weight [Dc], out [N_out, Dc], ape [ratio, 2 Dc] fp32 or None, in both or neither); both overlap
    compressors of S <= 16 slots with equal ring and entry row counts; the second may be an FP8
    pool (`out_scale`). Fused (default: T <= 512 tokens, or FP8 keys; module docstring): one
    launch when `index.ring_reads_disjoint` (decode), else three (the ring writes after the
    reads); not fused: `triton_compress_cached` per compressor.
    `invariant` (token-count-invariant plans, RL): the path does not depend on T: the two single
    launches, or with FP8 keys the fused one. The other keyword arguments are tuning knobs
    (benchmark sweeps, tests). No host syncs: safe inside CUDA-graph capture.
    """
    ratio, S = _check_pair(first, second, index, cos, sin)
    T = first.kv.shape[0]
    fp8 = second.out_scale is not None
    if fp8 and fuse is False:
        raise ValueError("compress_pair: FP8 indexer keys (out_scale) are written by the fused "
                         "launch only; got fuse=False")
    if T == 0:
        return
    if fuse is None:
        fuse = fp8 or (not invariant and T <= _FUSE_MAX_TOKENS)
    if not fuse:
        for c in (first, second):     # checked above (_check_pair)
            launch_compress(c.kv, c.score, c.ring_kv, c.ring_score, index, c.norm_weight, eps, cos,
                            sin, c.out, ape=c.ape)
        return
    fused = index.ring_reads_disjoint
    a, b = first, second
    Da, Db, half_rd = a.out.shape[1], b.out.shape[1], cos.shape[1]
    _compress_pair_kernel[(T,)](
        a.kv, a.score, a.ring_kv, a.ring_score, a.norm_weight, a.out,
        a.score if a.ape is None else a.ape,
        b.kv, b.score, b.ring_kv, b.ring_score, b.norm_weight,
        b.out.view(torch.uint8) if fp8 else b.out, b.score if b.ape is None else b.ape,
        b.out_scale if fp8 else b.score,
        *index[:6], cos, sin, a.out.shape[0] - 1, a.ring_kv.shape[0] - 1, eps,
        a.kv.stride(0), a.ring_kv.stride(0), a.out.stride(0), b.kv.stride(0), b.ring_kv.stride(0),
        b.out.stride(0), cos.stride(0),
        S=S, RATIO=ratio, DC_A=Da, DC_B=Db, ROPE_FIRST_A=Da // 2 - half_rd,
        ROPE_FIRST_B=Db // 2 - half_rd, BLOCK_S=triton.next_power_of_2(S),
        BLOCK_DA=triton.next_power_of_2(Da), BLOCK_DB=triton.next_power_of_2(Db),
        WRITE_RING=fused, HAS_APE=a.ape is not None, FP8_B=fp8,
        KEY_DTYPE=_KEY_DTYPES[b.key_dtype] if fp8 else tl.float32,
        num_warps=num_warps or _DEFAULT_WARPS, num_stages=num_stages,
        **pdl_args(a.kv.device),
    )
    if not fused:  # NOTE: after every ring read of the launch above (compressor.py's docstring)
        for c in (a, b):
            write_ring_rows(c.kv, c.score, c.ring_kv, c.ring_score, index.ring_write)
