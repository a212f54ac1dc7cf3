"""Triton lightning-indexer scores over the paged indexer-key pool (spec §6.6).

Owns `triton_index_scores`, the fast form of `kernels/ref/indexer.py::paged_index_scores`
(serving-reference §1.7; same signature, same semantics; the `triton` kernel backend maps
`KernelOps.index_scores` to it):

    scores[t, v] = Σ_h w[t, h] * ReLU(q[t, h] · keys[candidates[t, v]])           fp32
    scores[t, v] = -inf                                 where candidates[t, v] < 0
    w[t, h]      = fp32(weights[t, h]) * weight_scale                               fp32

Kernel design. Grid = (T, num_splits); program (t, s) owns the contiguous candidate range
[s * blocks_per_program * BLOCK_V, (s + 1) * blocks_per_program * BLOCK_V) of query row t:

    load q[t]^T once ([BLOCK_D, BLOCK_H] tile) and w[t] ([BLOCK_H]: the raw weights row in its
    dtype and row stride, cast to fp32 and scaled in registers), reused by every block
    for each BLOCK_V block of the range:
        slots = candidates[t, block]          # -1 (and columns >= V) -> masked
        K     = keys[slots]                   # [BLOCK_V, BLOCK_D] gathered rows, 0 where masked
        S     = tl.dot(K, q^T)                # [BLOCK_V, BLOCK_H], fp32 accumulate
        out   = Σ_h ReLU(S) * w[h]   (-inf where slot < 0)
        FP8 keys: K = codes widened to q's dtype, or with FP8 queries (q codes and q_scales, as
        `rope_fp8` writes them) an FP8 dot, each head's scale joining its weight;
        out *= key_scales[slots] (a power of two)

Why this shape: one key row is Id * 2 = 256 contiguous bytes (bf16), so the gather is row-granular
and coalesced; putting candidates on the MMA M dimension makes the head reduction an in-thread /
intra-quad reduction along N instead of a cross-warp one; looping over several blocks per program
amortises the 16 KB q tile (as large as a 64-row key tile) and lets the compiler pipeline the
candidate -> key loads. Invariants: Ih, Id are padded to powers of two >= 16 (tl.dot minimum) with
zero q rows and zero weights, which contribute exactly 0; ReLU(0) = 0 keeps exact zeros exact, so
the tie structure the top-k relies on (kernels/ref/indexer.py) is the reference's; every candidate
slot must be < keys.shape[0] (not checked: checking would need a host sync).

Sharing keys across queries (prefill). In prefill many query rows of one request carry the same
candidate row (the request's C4 entries in entry order), differing only in how long the visible
prefix is. Two levels of reuse:
  * implemented: query t is grid axis 0, the fastest-varying one, so the programs in flight at once
    are consecutive queries over the SAME candidate block; their key gathers hit in L2 and HBM sees
    each key block about once per wave even when the request's keys (V * 256 B) exceed L2.
  * not implemented: a grouped variant where one program handles G query rows of one request
    (N = G * Ih in the MMA) and gathers each key block once into shared memory. It needs the
    request structure (one candidate row per request + per-query visible counts), which the
    `paged_index_scores` signature does not carry, so it would come with a registry signature
    change. It would cut L2 -> SM traffic by G; prefill is already bounded by the tl.dot FLOPs
    (Ih*Id*2 = 16 K FLOP per (query, key) against 256 B of key), so the gain is bounded there.

Test: tests/kernels/test_index_scores.py (interpreter parity on CPU, `-m gpu` at real shapes).
Benchmark: benchmarks/kernels/bench_index_scores.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels.ref.indexer import check_fp8_q
from dsv4.kernels.triton import launch
from dsv4.kernels.triton.pdl import pdl_args
from dsv4.kernels.triton.pdl_enter import pdl_enter
from dsv4.kernels.triton.tile_masks import rows_mask

_DOT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MIN_DOT = 16                   # tl.dot needs every dimension >= 16
_MIN_DOT_K_FP8 = 32             # and an FP8 dot a reduction (here: Id) of >= 32
_BLOCK_V = 64                   # candidates per block (the docstring's defaults)
_FP8_Q_STAGES = 3               # with FP8 queries (the docstring's defaults)
_PROGRAMS_PER_SM = 4            # splits target: enough resident programs to keep gathers in flight
_MAX_BLOCKS_PER_PROGRAM = 16
_MAX_GRID_Y = 65535             # CUDA limit on grid dim 1 (the splits)


@triton.jit
def _index_scores_kernel(  # type: ignore[no-untyped-def]
    q_ptr, qs_ptr, w_ptr, k_ptr, ks_ptr, cand_ptr, out_ptr,
    V, Ih, Id, blocks_per_program, weight_scale,
    stride_qt, stride_qh, stride_wt, stride_kn, stride_ct, stride_ot,
    BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP32_DOT: tl.constexpr,
    EVEN_D: tl.constexpr, FP8_KEYS: tl.constexpr, FP8_Q: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    # NOTE: int64 row offsets: T * V reaches 2^31 at T = 8192, V = 262,144.
    t = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < Ih
    d_mask = offs_d < Id
    # NOTE: EVEN_D (Id == BLOCK_D, the V4 indexer's 128) leaves the column mask out of the loads
    # (`tile_masks`): 16-byte loads, and the key gather becomes cp.async into shared memory,
    # pipelined over the blocks
    if EVEN_D:
        q_mask = tl.broadcast_to(h_mask[None, :], (BLOCK_D, BLOCK_H))
    else:
        q_mask = d_mask[:, None] & h_mask[None, :]
    qt = tl.load(q_ptr + t * stride_qt + offs_h[None, :] * stride_qh + offs_d[:, None],
                 mask=q_mask, other=0.0)                                # [BLOCK_D, BLOCK_H]
    # NOTE: the caller's `weights.float() * weight_scale`, bit for bit: an fp32 multiply of the
    # fp32 cast (exact from bf16 / fp16); a scale of 1.0 leaves the weights' bits as they are
    w = tl.load(w_ptr + t * stride_wt + offs_h, mask=h_mask, other=0.0)
    w = w.to(tl.float32) * weight_scale                                 # [BLOCK_H] fp32
    if FP8_Q:
        # q holds e4m3 codes; each head's power-of-two scale commutes with its ReLU, so it joins
        # the head's weight: exact, as the key scales below
        w = w * tl.load(qs_ptr + t * Ih + offs_h, mask=h_mask, other=0.0)
    if FP32_DOT:
        qt = qt.to(tl.float32)

    num_blocks = tl.cdiv(V, BLOCK_V)
    first = split * blocks_per_program
    last = tl.minimum(first + blocks_per_program, num_blocks)
    for b in range(first, last):
        offs_v = b * BLOCK_V + tl.arange(0, BLOCK_V)
        v_mask = offs_v < V
        slots = tl.load(cand_ptr + t * stride_ct + offs_v, mask=v_mask,
                        other=-1)                                       # [BLOCK_V] int64
        valid = slots >= 0
        k = tl.load(k_ptr + slots[:, None] * stride_kn + offs_d[None, :],
                    mask=rows_mask(valid, d_mask, EVEN_D), other=0.0)   # [BLOCK_V, BLOCK_D]
        if FP8_KEYS:
            # NOTE: e4m3 codes widen exactly to bf16; the key's power-of-two scale multiplies
            # the head sum below, exactly (ReLU and the weights commute with a positive 2^k)
            key_scale = tl.load(ks_ptr + slots, mask=valid, other=1.0)   # [BLOCK_V] fp32
            k = k.to(qt.dtype)
        if FP32_DOT:
            # NOTE: "ieee", not tf32: fp32 callers expect reference-exact scores (top-k ties).
            s = tl.dot(k.to(tl.float32), qt, input_precision="ieee")    # [BLOCK_V, BLOCK_H]
        else:
            s = tl.dot(k, qt)
        score = tl.sum(tl.maximum(s, 0.0) * w[None, :], axis=1)         # [BLOCK_V]
        if FP8_KEYS:
            score = score * key_scale
        score = tl.where(valid, score, float("-inf"))
        tl.store(out_ptr + t * stride_ot + offs_v, score, mask=v_mask)


def _blocks_per_program(T: int, num_blocks: int, device: torch.device) -> int:
    """Smallest power of two (<= _MAX_BLOCKS_PER_PROGRAM) whose grid fits _PROGRAMS_PER_SM programs
    per SM: one wave (1 on CPU). At decode T = 1, V = 65,536 (1024 blocks of 64) that is 2, the
    H200's fastest of 1 / 2 / 4 (benchmarks/results/kernels_i_h200_202611.md)."""
    sms = launch.sms(device)
    want = min(_MAX_BLOCKS_PER_PROGRAM, triton.cdiv(T * num_blocks, _PROGRAMS_PER_SM * sms))
    return triton.next_power_of_2(max(1, want))


def _needs_fp32_dot(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """16-bit tl.dot only when q and keys share a 16-bit dtype (FP8 keys widen to q's), and only
    compiled (CUDA).

    NOTE: CPU tensors run under TRITON_INTERPRET=1, whose tl.dot multiplies the raw uint16 bit
    patterns of bfloat16 operands (triton-lang/triton#11584, "not supported yet"); upcasting first
    is exact, since bf16 x bf16 products are exact in fp32, so the interpreter still checks the
    kernel's logic.
    """
    key_dtype = q.dtype if keys.dtype == torch.float8_e4m3fn else keys.dtype
    return q.device.type != "cuda" or q.dtype != key_dtype or q.dtype == torch.float32


def _check_fp8(q: torch.Tensor, keys: torch.Tensor, key_scales: torch.Tensor | None,
               q_scales: torch.Tensor | None) -> None:
    """FP8 keys come with their [N] scales; FP8 queries (with their [T, Ih] scales) only with FP8
    keys (one FP8 dot)."""
    fp8 = keys.dtype == torch.float8_e4m3fn
    if fp8 != (key_scales is not None):
        raise ValueError(f"key_scales go with float8_e4m3fn keys, and only with them; got keys "
                         f"{keys.dtype}, key_scales {'given' if key_scales is not None else None}")
    if key_scales is not None and (key_scales.shape != keys.shape[:1] or
                                   key_scales.dtype != torch.float32 or
                                   key_scales.device != keys.device or
                                   not key_scales.is_contiguous()):
        raise ValueError(f"key_scales must be [{keys.shape[0]}] fp32, contiguous, on the keys' "
                         f"device; got {tuple(key_scales.shape)} {key_scales.dtype} on "
                         f"{key_scales.device}")
    check_fp8_q(q, keys, key_scales, q_scales)


def _check(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, candidates: torch.Tensor,
           key_scales: torch.Tensor | None, q_scales: torch.Tensor | None) -> None:
    if q.dim() != 3 or weights.dim() != 2 or keys.dim() != 2 or candidates.dim() != 2:
        raise ValueError(f"expected q [T, Ih, Id], weights [T, Ih], keys [N, Id], "
                         f"candidates [T, V]; got {tuple(q.shape)}, {tuple(weights.shape)}, "
                         f"{tuple(keys.shape)}, {tuple(candidates.shape)}")
    T, Ih, Id = q.shape
    if tuple(weights.shape) != (T, Ih) or keys.shape[1] != Id or candidates.shape[0] != T:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, weights {tuple(weights.shape)}, "
                         f"keys {tuple(keys.shape)}, candidates {tuple(candidates.shape)}")
    fp8 = (*_DOT_DTYPES, torch.float8_e4m3fn)
    if q.dtype not in fp8 or keys.dtype not in fp8:
        raise ValueError(f"q and keys dtypes must be one of {fp8}; got {q.dtype}, {keys.dtype}")
    _check_fp8(q, keys, key_scales, q_scales)
    if weights.dtype not in _DOT_DTYPES or candidates.dtype != torch.int64:
        raise ValueError(f"weights must be one of {_DOT_DTYPES} and candidates int64; got "
                         f"{weights.dtype}, {candidates.dtype}")
    devices = {q.device, weights.device, keys.device, candidates.device}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device; got {sorted(map(str, devices))}")
    for name, x in (("q", q), ("keys", keys), ("candidates", candidates)):
        if not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous; got strides {x.stride()} for shape "
                             f"{tuple(x.shape)}")
    if Ih > 1 and weights.stride(1) != 1:
        raise ValueError(f"weights must have unit column stride; got strides {weights.stride()}")


def triton_index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                        candidates: torch.Tensor, *, weight_scale: float = 1.0,
                        key_scales: torch.Tensor | None = None,
                        q_scales: torch.Tensor | None = None, block_v: int = _BLOCK_V,
                        blocks_per_program: int | None = None, num_warps: int = 4,
                        num_stages: int | None = None) -> torch.Tensor:
    """Same contract as `paged_index_scores`: returns [T, V] fp32, -inf where candidates < 0.

    `q`: [T, Ih, Id] bf16/fp16/fp32, or float8_e4m3fn codes with `q_scales` [T, Ih] fp32 (FP8
    keys only; `rope_fp8`'s output: each head's values its codes times its scale, the scale
    joining the head's weight, the dot on FP8 tensor cores when compiled); `weights`: [T, Ih]
    bf16/fp16/fp32, any row stride (unit column stride: e.g. a column slice of a fused
    projection's output); the heads' weights are `weights.float() * weight_scale` (cast and fp32
    multiply in the kernel, bit-equal to the caller doing them); `keys`: [N, Id] bf16/fp16/fp32,
    or float8_e4m3fn codes with `key_scales` [N] fp32 (`ref/index_keys.py`: the codes widen to
    q's dtype, each key's scale multiplies its score); `candidates`: [T, V] int64 pool slots,
    -1 = none, every other slot < N. q, keys and candidates contiguous; one device. q and keys of
    one 16-bit dtype (FP8 keys: q's) run a 16-bit tl.dot, FP8 q and keys an FP8 dot, anything
    else an fp32 (ieee) dot. The other keyword arguments are tuning knobs (benchmark sweeps,
    tests); the defaults (block_v 64, 4 warps, 2 stages) are the H200 sweep's best of 11
    configurations for Ih = 64, Id = 128 at decode T = 1 and V 65,536 / 262,144
    (`bench_index_scores.py --sweep`; benchmarks/results/kernels_i_h200_202611.md); with FP8
    queries 3 stages, the H100's best there (benchmarks/results/serving_h200_202612.md); blocks
    per program by `_blocks_per_program`. No host syncs: safe inside CUDA-graph capture.
    """
    _check(q, weights, keys, candidates, key_scales, q_scales)
    num_stages = num_stages or (_FP8_Q_STAGES if q_scales is not None else 2)
    if block_v < _MIN_DOT or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two >= {_MIN_DOT}; got {block_v}")
    T, Ih, Id = q.shape
    V = candidates.shape[1]
    out = torch.empty(T, V, dtype=torch.float32, device=q.device)
    if T == 0 or V == 0:
        return out
    num_blocks = triton.cdiv(V, block_v)
    bpp = blocks_per_program or _blocks_per_program(T, num_blocks, q.device)
    bpp = max(bpp, triton.cdiv(num_blocks, _MAX_GRID_Y))
    grid = (T, triton.cdiv(num_blocks, bpp))
    # NOTE: an FP8 dot's channel tile is padded to 32 (masked: zeros) for indexers below that
    block_d = max(_MIN_DOT if q_scales is None else _MIN_DOT_K_FP8, triton.next_power_of_2(Id))
    _index_scores_kernel[grid](
        q, out if q_scales is None else q_scales, weights, keys,
        out if key_scales is None else key_scales, candidates, out,
        V, Ih, Id, bpp, float(weight_scale),
        q.stride(0), q.stride(1), weights.stride(0), keys.stride(0), candidates.stride(0),
        out.stride(0),
        BLOCK_V=block_v,
        BLOCK_H=max(_MIN_DOT, triton.next_power_of_2(Ih)),
        BLOCK_D=block_d, FP32_DOT=_needs_fp32_dot(q, keys), EVEN_D=Id == block_d,
        FP8_KEYS=key_scales is not None, FP8_Q=q_scales is not None,
        num_warps=num_warps, num_stages=num_stages, **pdl_args(q.device),
    )
    return out
