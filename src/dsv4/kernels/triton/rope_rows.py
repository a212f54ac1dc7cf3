"""A serving step's RoPE-row gathers in one launch: `triton_rope_rows`, the fast form of
`kernels/ref/rope_rows.py::rope_rows` (same signature, bit-equal: the values are copies).

At the start of a serving forward the model reads (cos, sin) rows from the RoPE caches: the main
and the compress table at the step's positions, and the compress table at each compress ratio's
entry positions (four gathers for V4: one `index_select` launch each, back to back on a decode
step's critical path). Here one launch serves up to `ROPE_ROWS_MAX_PAIRS` (cache, positions) pairs.

Kernel design: grid (max_i cdiv(N_i, BLOCK_T), n) for n pairs of N_i positions each. Program
(b, i) copies rows [b * BLOCK_T, (b + 1) * BLOCK_T) of pair i: it loads their positions, then the
[BLOCK_T, R_i] cos rows and the sin rows P_i * R_i elements further (the cache is [2, P_i, R_i]
contiguous), and stores them into the pair's own [2, N_i, R_i] output (cos rows, then sin rows),
whose halves are returned as that pair's (cos, sin). Programs past a pair's rows store nothing.
The pairs fill four argument slots (pointers, N_i, P_i; the row width R_i constexpr) of which a
constexpr NPAIRS are used; a call with fewer pairs passes pair 0's tensors in the unused slots
(never read).

Invariants: bit-equal to the reference for positions in [0, P_i) (a position outside reads no
memory and gives zero rows: the reference raises there). Offsets into the cache and the outputs
are int64. N_i and P_i are not specialised on (`do_not_specialize`): they change from step to
step (P_i with the engine's context), so a new batch size or prompt length compiles nothing; the
row widths, the pair count and the block sizes are model constants. No host sync, no
host-to-device copy: CUDA-graph capturable (a call with no rows launches nothing).

Test: tests/kernels/test_rope_rows.py. Benchmark: benchmarks/kernels/bench_rope_rows.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from dsv4.kernels.ops import ROPE_ROWS_MAX_PAIRS
from dsv4.kernels.ref.rope_rows import check_pairs
from dsv4.kernels.triton.pdl import pdl_args
from dsv4.kernels.triton.pdl_enter import pdl_enter

BLOCK_ELEMS = 2048      # cos elements per program (BLOCK_T rows x BLOCK_R columns)
NUM_WARPS = 4


@triton.jit
def _copy_rows(cache_ptr, pos_ptr, out_ptr, N, P, block,  # type: ignore[no-untyped-def]
               R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = block * BLOCK_T + tl.arange(0, BLOCK_T)
    live_t = rows < N
    pos = tl.load(pos_ptr + rows, mask=live_t, other=0)
    hit = live_t & (pos >= 0) & (pos < P)
    cols = tl.arange(0, BLOCK_R)
    live_r = (cols < R)[None, :]
    src = cache_ptr + pos[:, None] * R + cols[None, :]
    cos = tl.load(src, mask=hit[:, None] & live_r, other=0.0)
    sin = tl.load(src + P.to(tl.int64) * R, mask=hit[:, None] & live_r, other=0.0)
    dst = out_ptr + rows.to(tl.int64)[:, None] * R + cols[None, :]
    tl.store(dst, cos, mask=live_t[:, None] & live_r)
    tl.store(dst + N.to(tl.int64) * R, sin, mask=live_t[:, None] & live_r)


@triton.jit(do_not_specialize=["N0", "P0", "N1", "P1", "N2", "P2", "N3", "P3"])
def _rope_rows_kernel(  # type: ignore[no-untyped-def]
    cache0_ptr, pos0_ptr, out0_ptr, N0, P0,
    cache1_ptr, pos1_ptr, out1_ptr, N1, P1,
    cache2_ptr, pos2_ptr, out2_ptr, N2, P2,
    cache3_ptr, pos3_ptr, out3_ptr, N3, P3,
    NPAIRS: tl.constexpr, R0: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr,
    R3: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    block = tl.program_id(0)
    pair = tl.program_id(1)
    if pair == 0:
        _copy_rows(cache0_ptr, pos0_ptr, out0_ptr, N0, P0, block, R0, BLOCK_T, BLOCK_R)
    if NPAIRS >= 2:
        if pair == 1:
            _copy_rows(cache1_ptr, pos1_ptr, out1_ptr, N1, P1, block, R1, BLOCK_T, BLOCK_R)
    if NPAIRS >= 3:
        if pair == 2:
            _copy_rows(cache2_ptr, pos2_ptr, out2_ptr, N2, P2, block, R2, BLOCK_T, BLOCK_R)
    if NPAIRS >= 4:
        if pair == 3:
            _copy_rows(cache3_ptr, pos3_ptr, out3_ptr, N3, P3, block, R3, BLOCK_T, BLOCK_R)


def rope_rows_blocks(widths: Sequence[int]) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_R) for pairs of row widths `widths`: BLOCK_R the next power of two of the
    widest row, BLOCK_T the rows that fill `BLOCK_ELEMS` (64 x 32 for V4's rd / 2 = 32)."""
    block_r = triton.next_power_of_2(max(max(widths, default=1), 1))
    return max(1, BLOCK_ELEMS // block_r), block_r


def triton_rope_rows(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]
                     ) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """Same contract as `rope_rows`: per (cache [2, P, R] fp32 contiguous, positions [*S] int64)
    pair, at most `ROPE_ROWS_MAX_PAIRS`, (cos, sin) [*S, R], the halves of one new contiguous
    [2, *S, R] tensor; one launch for all pairs. Non-contiguous positions cost a copy."""
    check_pairs(pairs)
    outs = [torch.empty((2, *pos.shape, cache.shape[2]), dtype=torch.float32, device=cache.device)
            for cache, pos in pairs]
    result = tuple((out[0], out[1]) for out in outs)
    if not any(out.numel() for out in outs):
        return result
    args: list[torch.Tensor | int] = []
    widths = []
    for i in range(ROPE_ROWS_MAX_PAIRS):
        j = i if i < len(pairs) else 0          # unused slots: pair 0's tensors, never read
        cache, pos = pairs[j]
        rows = pos.numel() if i < len(pairs) else 0
        args += [cache, pos.reshape(-1).contiguous(), outs[j], rows, cache.shape[1]]
        widths.append(cache.shape[2])
    block_t, block_r = rope_rows_blocks(widths)
    grid = (max(triton.cdiv(pos.numel(), block_t) for _, pos in pairs), len(pairs))
    _rope_rows_kernel[grid](*args, NPAIRS=len(pairs), R0=widths[0], R1=widths[1], R2=widths[2],
                            R3=widths[3], BLOCK_T=block_t, BLOCK_R=block_r,
                            num_warps=NUM_WARPS, **pdl_args(pairs[0][0].device))
    return result
