"""Triton hybrid sparse attention (spec §6.7): one softmax over the SWA window and compressed keys.

Owns `triton_sparse_attention`, the fast form of `kernels/ref/attention.py::sparse_attention_multi`
(same signature, same semantics; it can be registered as `KernelOps.sparse_attention`). For query t,
head h and the union J(t) of the valid keys of one or two sources (kv pool [N_i, D], indices
[T, K_i], -1 = no key):

    l[t,h,j] = scale * q[t,h] . kv[j]           (K = V: one D-row is key and value, for all heads)
    o[t,h]   = Σ_j exp(l[t,h,j]) kv[j] / (Σ_j exp(l[t,h,j]) + exp(sink[h]))   (0 when J(t) is empty)

The engine passes (SWA pool, window slots [T, W]) then (compressed pool, C4 top-k slots [T, 512] or
every visible C128 entry [T, V]); decode (T = batch) and prefill (T = tokens) run the same kernel.

Kernel design. Grid = (T * G, NS): program (t * G + g, s) owns query token t, head group g (BLOCK_H
heads, G = ceil(H / BLOCK_H)) and split s, a contiguous range of key blocks of the concatenated key
list [source 1 | source 2] (each source cut into BLOCK_N-key blocks; source 1's blocks first):

    Q   = q[t, group]                              [BLOCK_H, D] tile, loaded once
    m, l, acc = -inf, 0, 0                         fp32 [BLOCK_H], [BLOCK_H], [BLOCK_H, D]
    for each block of the split's range (a loop over source 1's blocks, then one over source 2's):
        slots = idx[t, block]                      int64; -1 and columns >= K_i are masked
        K     = kv[slots]                          [BLOCK_N, D] gathered rows, 0 where masked
                                                   (no bytes move)
        S     = tl.dot(Q, K^T) * scale * log2(e)   fp32; -inf where masked
        m' = max(m, rowmax S);  P = 2^(S - m');  l = l 2^(m-m') + rowsum P;
        acc = acc 2^(m-m') + P.K                  P split into PV_TERMS 16-bit terms, one dot
                                                   each (16-bit path; `_pv_dot`)
    no split:  peak = max(m, sink);  o = acc 2^(m-peak) / (l 2^(m-peak) + 2^(sink-peak))
               (sink folded)
    split:     part[t, h, s] = acc / l, lse[t, h, s] = m + log2 l; then `split_combine.py`
               (grid T * H x D / 128 columns, each program loading its NS partial rows at once)
               merges them with the sink in the denominator the same way.

Compiled variants: the split plan (blocks per split, number of splits) changes with the context
and is not specialised on (`do_not_specialize`); the index widths K1, K2 stay specialised (on
1, multiples of 16, the rest: their 16-divisibility lets the index loads vectorise; the cost of
not specialising them is in benchmarks/results/serving_h200_202612.md), as do strides, H and D.

K = V is what makes one gather serve both dots: the [BLOCK_N, D] tile (BLOCK_N x 1 KB of bf16 for
D = 512, row-granular, coalesced) lands in shared memory once and is read as K^T by the QK dot and
as V by the PV dot. All BLOCK_H heads of the program share it (MQA), and the G head-group programs
of one token are adjacent in the grid (pid = t * G + g), so they run in the same wave: HBM sees each
key row about once per token, L2 G times. Consecutive prefill tokens share most window keys and
C128 entries, which then also hit in L2.

Register budget (D = 512, bf16). The accumulator is BLOCK_H x D fp32 and the loop-invariant Q
operand stays in registers, so heads per program trade L2 traffic (each of the G programs of a
token gathers its keys) for registers. Compiled offline for sm_90a (Triton 3.6, ptxas; the split
variant with P_TERMS = 3 and the de-rotating store; registers per thread, spill bytes, shared
memory; `benchmarks/aot_compile_sm90.py`):

    block_h/n, warps, stages   MMA                  regs  spill   smem    CTAs/SM by regs
    16/32,  4, 2 (default)     mma.sync              254      0   50 KB   2
    16/32,  8, 2               mma.sync              149      0   50 KB   1
    16/64,  8, 2               mma.sync              182      0   84 KB   1
    32/64,  8, 2               mma.sync              250      0  103 KB   1
    64/32,  8, 2               wgmma                 255  14504  135 KB   1
    16/64,  4, 2               mma.sync              255    344   84 KB   2

BLOCK_H = 64 (the natural wgmma M, keys gathered once per token) spills heavily; the default keeps
16 heads without spills and 2 resident programs per SM. The defaults are the sweeps' best on the
H200 and H100 (benchmarks/results/serving_h200_202612.md); `block_h`, `block_n`, `num_warps`,
`num_stages` are knobs (bench --sweep, --configs). Splitting D into chunks for the QK dot would
not save registers: a register tile cannot be sliced, so a chunked QK would gather every key
twice.

Split-KV. With few programs (decode at small batch: T * G < #SMs) one program per (token, group)
leaves most SMs idle while C128 lists reach 128 + 1024 keys at 128K context and 128 + 7200 at 900K.
The wrapper then cuts the key blocks into NS = min(ceil(2 #SMs / (T G)), #blocks / 2, 64) splits,
or into one block each when all T G #blocks programs fit one per SM (host-side from Python ints:
no sync, graph-safe; 1 on the interpreter unless asked), with a fp32 workspace of
T * H * NS * (D + 1) * 4 bytes (L2-resident at those T). A split's key blocks run in sequence
(each waits on its gather), so the split count, not the bytes, sets a long list's time; one block
per split leaves each program one gather (batch-1 decode of the C4 picks, 20 blocks, or a C128
list up to ~100K context; faster than two blocks per split there: the bench's results in
benchmarks/results/serving_h200_202612.md).

Invariants: scores, softmax and accumulation are fp32 (the 16-bit path writes P as PV_TERMS = 3
terms of the keys' dtype, which carry its whole fp32 significand, where flash attention rounds P
to bf16 once: the RL trainer's reference keeps P in fp32, and one rounding moved 34% of a bf16
attention output's elements); q and every pool must share that 16-bit dtype, otherwise, and
always on the interpreter, both dots run in fp32 "ieee" on upcast operands (exact, since 16-bit
products are exact in fp32); m starts at -inf and a block with no valid key so far
uses 0 as its shift, so no -inf - -inf; the sink is finite, so the final denominator is
>= 2^(sink - peak) > 0 and a query with no valid key returns exactly 0. Every valid slot must be
< its pool's N (not checked: that would need a host sync). Padded heads (H not a multiple of
BLOCK_H) and channels (D not a power of two) are masked on load and store.

Test: tests/kernels/test_sparse_attention_triton.py (interpreter parity on CPU, `-m gpu` at Flash
shapes) and tests/kernels/test_engine_sparse_attention.py (engine greedy tokens). Benchmark:
benchmarks/kernels/bench_sparse_attention.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from dsv4.kernels.triton import launch
from dsv4.kernels.triton.pdl import pdl_args
from dsv4.kernels.triton.pdl_enter import pdl_enter
from dsv4.kernels.triton.rope_norm import check_rope
from dsv4.kernels.triton.split_combine import LOG2E, combine_splits, store_rows
from dsv4.kernels.triton.tile_masks import rows_mask

_DOT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MIN_DOT = 16                   # tl.dot needs every dimension >= 16
_PROGRAMS_PER_SM = 2            # split-KV target: programs in flight per SM
_MIN_BLOCKS_PER_SPLIT = 2
_MAX_SPLITS = 64
PV_TERMS = 3
"""16-bit P.V: P as a sum of this many 16-bit terms (`_pv_dot`). 3 keeps P's fp32 value, so the
kernel rounds like the reference (`sparse_attention_multi`, fp32 P) up to summation order."""
MAX_WARPS_SPLIT_P = 8
"""The most warps with P split into 2-3 terms: 16 warps (block_h 64, block_n 32) hit an illegal
memory access on the H200 with Triton 3.6 (the same tile with one term runs)."""


@triton.jit
def _attend_blocks(  # type: ignore[no-untyped-def]
    q, m, l_sum, acc, kv_ptr, idx_row_ptr, K, stride_kv, first, last, offs_d, d_mask, qk_scale,
    BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr, EVEN_D: tl.constexpr, P_TERMS: tl.constexpr,
):
    """Online softmax over key blocks [first, last) of one source (idx_row_ptr: this token's index
    row)."""
    for b in range(first, last):
        offs_n = b * BLOCK_N + tl.arange(0, BLOCK_N)
        slots = tl.load(idx_row_ptr + offs_n, mask=offs_n < K, other=-1)     # [BLOCK_N] int64
        valid = slots >= 0
        k = tl.load(kv_ptr + slots[:, None] * stride_kv + offs_d[None, :],
                    mask=rows_mask(valid, d_mask, EVEN_D), other=0.0)       # [BLOCK_N, BLOCK_D]
        if FP32_DOT:
            k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")              # [BLOCK_H, BLOCK_N]
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)               # no valid key yet
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        if FP32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, k, input_precision="ieee")
        else:
            acc = _pv_dot(p, k, acc * alpha[:, None], P_TERMS)
        m = m_new
    return m, l_sum, acc


@triton.jit
def _pv_dot(p, k, acc, P_TERMS: tl.constexpr):  # type: ignore[no-untyped-def]
    """acc + P.K with fp32 P written as the sum of P_TERMS values of k's 16-bit dtype, each a
    tensor-core dot (16-bit products are exact in fp32, so only P's rounding and the fp32
    accumulation order remain): 1 term rounds P to bf16 (flash attention), 3 terms carry all
    24 bits of P's fp32 significand."""
    hi = p.to(k.dtype)
    acc = tl.dot(hi, k, acc)
    if P_TERMS >= 2:
        rest = p - hi.to(tl.float32)
        mid = rest.to(k.dtype)
        acc = tl.dot(mid, k, acc)
        if P_TERMS >= 3:
            acc = tl.dot((rest - mid.to(tl.float32)).to(k.dtype), k, acc)
    return acc


@triton.jit(do_not_specialize=["blocks_per_split", "num_splits"])
def _sparse_attention_kernel(  # type: ignore[no-untyped-def]
    q_ptr, kv1_ptr, idx1_ptr, kv2_ptr, idx2_ptr, sink_ptr, out_ptr, part_ptr, lse_ptr,
    cos_ptr, sin_ptr, H, D, K1, K2, num_groups, blocks_per_split, num_splits, qk_scale, log2e,
    rope_first, stride_cs,
    stride_qt, stride_qh, stride_kv1, stride_i1, stride_kv2, stride_i2, stride_ot, stride_oh,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FP32_DOT: tl.constexpr,
    SPLIT: tl.constexpr, EVEN_D: tl.constexpr, P_TERMS: tl.constexpr, DEROTATE: tl.constexpr,
    PDL: tl.constexpr):
    pdl_enter(PDL)
    # NOTE: int64 token offsets: T * H * D reaches 2^31 at T = 65,536 on Flash.
    pid = tl.program_id(0)
    t = (pid // num_groups).to(tl.int64)
    offs_h = (pid % num_groups) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(1)
    h_mask = offs_h < H
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    hd_mask = rows_mask(h_mask, d_mask, EVEN_D)
    q = tl.load(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :], mask=hd_mask,
                other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)

    nb1 = tl.cdiv(K1, BLOCK_N)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, nb1 + tl.cdiv(K2, BLOCK_N))
    m, l_sum, acc = _attend_blocks(q, m, l_sum, acc, kv1_ptr, idx1_ptr + t * stride_i1, K1,
                                   stride_kv1, first, tl.minimum(last, nb1), offs_d, d_mask,
                                   qk_scale, BLOCK_N, FP32_DOT, EVEN_D, P_TERMS)
    m, l_sum, acc = _attend_blocks(q, m, l_sum, acc, kv2_ptr, idx2_ptr + t * stride_i2, K2,
                                   stride_kv2, tl.maximum(first, nb1) - nb1, last - nb1, offs_d,
                                   d_mask, qk_scale, BLOCK_N, FP32_DOT, EVEN_D, P_TERMS)
    if SPLIT:
        row = (t * H + offs_h) * num_splits + split                         # [BLOCK_H]
        has = l_sum > 0.0
        tl.store(lse_ptr + row,
                 tl.where(has, m + tl.log2(tl.where(has, l_sum, 1.0)), float("-inf")), mask=h_mask)
        part = acc / tl.where(has, l_sum, 1.0)[:, None]                     # 0 where l == 0
        tl.store(part_ptr + row[:, None] * D + offs_d[None, :], part, mask=hd_mask)
    else:
        sink = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0) * log2e
        peak = tl.maximum(m, sink)                                          # finite
        alpha = tl.exp2(m - peak)                                           # 0 when no valid key
        out = acc * (alpha / (l_sum * alpha + tl.exp2(sink - peak)))[:, None]
        store_rows(out_ptr, out, t, offs_h, offs_d, hd_mask, cos_ptr, sin_ptr, stride_ot,
                   stride_oh, D, rope_first, stride_cs, 0, BLOCK_H, BLOCK_D, DEROTATE)


def default_config(H: int, D: int, fp32_dot: bool) -> tuple[int, int, int, int]:
    """(block_h, block_n, num_warps, num_stages): the module docstring's register budget, untuned on
    hardware (bench_sparse_attention.py --sweep compares alternatives). fp32 dots (tests) take
    16-key tiles."""
    block_h = max(_MIN_DOT, min(16, triton.next_power_of_2(H)))
    wide = fp32_dot or triton.next_power_of_2(D) > 512
    return block_h, 16 if wide else 32, 4, 2


def choose_splits(programs: int, num_blocks: int, device: torch.device) -> int:
    """Split-KV factor from Python ints (module docstring); 1 on the interpreter and when the GPU is
    full; one key block per split when every (program, block) pair fits one wave at one per SM
    (batch-1 decode over the C4 picks or a C128 list up to ~100K context)."""
    if device.type != "cuda":
        return 1
    sms = launch.sms(device)
    if programs >= sms:
        return 1
    if programs * num_blocks <= sms:
        return num_blocks
    want = triton.cdiv(_PROGRAMS_PER_SM * sms, programs)
    return max(1, min(want, num_blocks // _MIN_BLOCKS_PER_SPLIT, _MAX_SPLITS))


def split_plan(programs: int, num_blocks: int, device: torch.device,
               num_splits: int | None = None) -> tuple[int, int]:
    """(splits, key blocks per split) for `programs` (token, head-group) pairs over `num_blocks`
    >= 1 key blocks: `num_splits`, or `choose_splits` when None, clamped to [1, num_blocks] and
    evened out (no empty split)."""
    want = num_splits or choose_splits(programs, num_blocks, device)
    per_split = triton.cdiv(num_blocks, max(1, min(want, num_blocks)))
    return triton.cdiv(num_blocks, per_split), per_split


def _needs_fp32_dot(q: torch.Tensor, pools: Sequence[torch.Tensor]) -> bool:
    """16-bit tl.dot only when q and every pool share a 16-bit dtype, and only compiled (CUDA).

    NOTE: the interpreter's tl.dot multiplies the raw bit patterns of bfloat16 operands
    (triton-lang/triton#11584); upcasting first is exact, so the interpreter still checks the
    kernel's logic (as in index_scores.py).
    """
    return (q.device.type != "cuda" or q.dtype == torch.float32
            or any(kv.dtype != q.dtype for kv in pools))


def _check(q: torch.Tensor, sources: Sequence[tuple[torch.Tensor, torch.Tensor]],
           sink: torch.Tensor) -> None:
    if len(sources) not in (1, 2):
        raise ValueError("triton_sparse_attention supports 1 or 2 sources (SWA window, compressed "
                         f"entries); got {len(sources)}")
    if q.dim() != 3 or q.dtype not in _DOT_DTYPES or q.stride(-1) != 1:
        raise ValueError(f"q must be [T, H, D] of {[str(d) for d in _DOT_DTYPES]} with unit last "
                         f"stride; got {list(q.shape)} {q.dtype} strides {q.stride()}")
    T, H, D = q.shape
    if tuple(sink.shape) != (H,) or sink.dtype != torch.float32 or not sink.is_contiguous():
        raise ValueError(f"sink must be a contiguous [{H}] float32; "
                         f"got {list(sink.shape)} {sink.dtype}")
    devices = {q.device, sink.device}
    for i, (kv, idx) in enumerate(sources):
        if kv.dim() != 2 or kv.shape[1] != D or kv.dtype not in _DOT_DTYPES or kv.stride(-1) != 1:
            raise ValueError(f"sources[{i}] kv must be [N, {D}] of {[str(d) for d in _DOT_DTYPES]} "
                             f"with unit last stride; got {list(kv.shape)} {kv.dtype} "
                             f"strides {kv.stride()}")
        if (idx.dim() != 2 or idx.shape[0] != T or idx.dtype != torch.int64
                or (idx.shape[1] and idx.stride(-1) != 1)):
            raise ValueError(f"sources[{i}] indices must be [{T}, K] int64 with unit last stride; "
                             f"got {list(idx.shape)} {idx.dtype} strides {idx.stride()}")
        devices |= {kv.device, idx.device}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(map(str, devices))}")


def triton_sparse_attention(q: torch.Tensor, sources: Sequence[tuple[torch.Tensor, torch.Tensor]],
                            sink: torch.Tensor, scale: float, *, block_h: int | None = None,
                            block_n: int | None = None, num_splits: int | None = None,
                            num_warps: int | None = None, num_stages: int | None = None,
                            p_terms: int = PV_TERMS,
                            inverse_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                            ) -> torch.Tensor:
    """Same contract as `sparse_attention_multi`: returns [T, H, D] in q's dtype.

    q: [T, H, D] bf16/fp16/fp32 (unit last stride); sources: 1 or 2 pairs (kv [N_i, D] with unit
    last stride, indices [T, K_i] int64, -1 = no key, every other slot < N_i); sink: [H] fp32. One
    device. q and every pool of one 16-bit dtype run 16-bit dots; anything else runs fp32 (ieee)
    dots. Keyword arguments are tuning knobs (benchmark sweeps, tests); num_splits = None picks
    split-KV from the key count (`choose_splits`); p_terms (1-3) is the 16-bit P.V precision
    (`PV_TERMS`). `inverse_rope` = (cos, sin) [T, rd/2] fp32: the output is de-rotated as
    `rope_inverse(o, cos, sin)` would de-rotate it, in the same launch (the store, or the split
    combine's store). No host syncs: safe inside CUDA-graph capture.
    """
    _check(q, sources, sink)
    T, H, D = q.shape
    cos, sin = inverse_rope if inverse_rope is not None else (sink, sink)
    if inverse_rope is not None:
        check_rope("q", q, cos, sin, T)
    out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    live = [(kv, idx) for kv, idx in sources if idx.shape[1] > 0]  # NOTE: a [T, 0] source: no key
    if T == 0 or not live:
        return out.zero_()
    fp32_dot = _needs_fp32_dot(q, [kv for kv, _ in sources])
    auto = default_config(H, D, fp32_dot)
    bh, bn = block_h or auto[0], block_n or auto[1]
    if p_terms not in (1, 2, 3):
        raise ValueError(f"p_terms must be 1, 2 or 3; got {p_terms}")
    if (num_warps or auto[2]) > MAX_WARPS_SPLIT_P and p_terms > 1:
        raise ValueError(f"num_warps={num_warps} with p_terms={p_terms} is unsupported (Triton "
                         "3.6 builds a kernel that faults on the H200); allowed: num_warps <= "
                         f"{MAX_WARPS_SPLIT_P}, or p_terms=1")
    for name, v in (("block_h", bh), ("block_n", bn)):
        if v < _MIN_DOT or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= {_MIN_DOT}; got {v}")
    (kv1, idx1), (kv2, idx2) = live[0], live[-1]
    K1, K2 = idx1.shape[1], idx2.shape[1] if len(live) == 2 else 0
    num_blocks, groups = triton.cdiv(K1, bn) + triton.cdiv(K2, bn), triton.cdiv(H, bh)
    splits, per_split = split_plan(T * groups, num_blocks, q.device, num_splits)
    part = lse = out                                                  # placeholders when not split
    if splits > 1:
        part = torch.empty(T, H, splits, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(T, H, splits, dtype=torch.float32, device=q.device)
    block_d = max(_MIN_DOT, triton.next_power_of_2(D))
    derotate = inverse_rope is not None
    rope_first, stride_cs = (D // 2 - cos.shape[-1], cos.stride(0)) if derotate else (0, 0)
    _sparse_attention_kernel[(T * groups, splits)](
        q, kv1, idx1, kv2, idx2, sink, out, part, lse, cos, sin,
        H, D, K1, K2, groups, per_split, splits, scale * LOG2E, LOG2E, rope_first, stride_cs,
        q.stride(0), q.stride(1), kv1.stride(0), idx1.stride(0), kv2.stride(0), idx2.stride(0),
        out.stride(0), out.stride(1),
        BLOCK_H=bh, BLOCK_N=bn, BLOCK_D=block_d, FP32_DOT=fp32_dot, SPLIT=splits > 1,
        EVEN_D=D == block_d, P_TERMS=p_terms, DEROTATE=derotate, num_warps=num_warps or auto[2],
        num_stages=num_stages or auto[3], **pdl_args(q.device),
    )
    if splits > 1:
        combine_splits(part, lse, sink, out, (cos, sin), rope_first, stride_cs, derotate)
    return out

