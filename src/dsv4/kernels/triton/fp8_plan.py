"""The launch plan of `fp8_linear.py::triton_fp8_linear`: `plan_fp8_linear(M, N, K, num_sms)`,
host arithmetic only (no host sync; CUDA-graph safe).

From (M, N, K, whether the operands suit the frag path, SM count):
- decode, M <= FMA_MAX_M: FMA, BLOCK_M next_pow2(M), (KB, BLOCK_N, stages) FMA_TILES[BLOCK_M],
  4 warps; at M <= NOSPLIT_MAX_M with K <= NOSPLIT_MAX_K no K split at all: BLOCK_N halves (down
  to NOSPLIT_ROWS x BLOCK_M) while the halved tiles stay within NOSPLIT_PROGRAMS_PER_SM per SM
  (the split's last-arrival reduction costs ~2 us on the H200, more than a short K saves; the
  SwiGLU mode, which recomputes h in every tile, gains too; at M = 4 the small tiles lose: the
  sweeps are in benchmarks/results/quant_moe_h200_202612.md);
- decode, M <= 8 with bf16 x, K % 128 == 0 and 16-byte aligned rows: the tensor-core decode path
  (`fp8_frag.py`: codes decoded into mma.sync fragments, BLOCK_N FRAG_BLOCK_N, split-K to
  FRAG_PROGRAMS_PER_SM programs per SM, at least FRAG_MIN_STEPS 128-k steps a split; 0.70-1.06x the
  swap-AB tl.dot's time at M = 8 on flash-4l's shapes, slower than FMA at M = 1);
- decode, M <= DECODE_MAX_M: DOT, BLOCK_M max(16, next_pow2(M)), BLOCK_N 64, 4 warps, 4 stages;
- then split-K (one M tile) up to PROGRAMS_PER_SM programs per SM, capped by the K blocks and the
  last arrival's registers, evened out so no split is empty; BLOCK_N halves (down to 16) while the
  splits alone cannot fill half the target;
- prefill, M > DECODE_MAX_M: DOT tiles BLOCK_M 64 (M <= 128) or 128, BLOCK_N 128, 8 warps, 3
  stages, no split.
Every knob is a keyword of `triton_fp8_linear` (tests, sweeps).
"""

from __future__ import annotations

from dataclasses import dataclass

import triton

from dsv4.kernels.triton.fp8_frag import MAX_M as FRAG_MAX_M
from dsv4.kernels.triton.gemv import (
    FMA_LIMIT_M,
    FMA_MAX_M,
    PROGRAMS_PER_SM,
    REDUCE_REGS,
    even_split,
)
from dsv4.kernels.triton.launch import pow2

BLOCK = 128                 # the scale block (and the K step)
DECODE_MAX_M = 64           # above: prefill tiles, no split-K
_MIN_DOT = 16               # tl.dot needs every dimension >= 16
# FMA path per BLOCK_M (next_pow2(M) <= FMA_MAX_M): (scale blocks of 128 k per K step, weight
# rows per program, pipeline stages), the fastest of an H200 sweep over flash-4l's FP8 linears
# (benchmarks/results/quant_moe_h200_202612.md)
FMA_TILES = {1: (4, 32, 1), 2: (4, 32, 1), 4: (2, 32, 2)}
NOSPLIT_MAX_K = 2048        # FMA path: K up to this runs without a K split (module docstring)
NOSPLIT_MAX_M = 2           # ... at M up to this
NOSPLIT_ROWS = 8            # ... in tiles of at least this many weight rows per x row
NOSPLIT_PROGRAMS_PER_SM = 8  # ... and at most about this many programs per SM
FRAG_BLOCK_N = 16           # frag path: weight rows per program (1 warp; H200 sweep at M = 8)
FRAG_PROGRAMS_PER_SM = 16   # frag path: split-K target
FRAG_MIN_STEPS = 2          # frag path: 128-k steps per split at least
# FMA_MAX_M, FMA_LIMIT_M, PROGRAMS_PER_SM, REDUCE_REGS: the skinny GEMM's (`gemv.py`), same plan


@dataclass(frozen=True)
class Fp8LinearPlan:
    """Tile shape, K split and launch options of one `triton_fp8_linear` call."""

    block_m: int
    block_n: int
    split_k: int
    num_warps: int
    num_stages: int
    dot: bool
    kb: int = 1             # scale blocks (128 k) per K step: FMA_TILES' on the FMA path
    frag: bool = False      # the tensor-core decode path (`fp8_frag.py`): block_n = 16 x warps


def _tile_defaults(M: int, dot: bool) -> tuple[int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages) of the module docstring's plan."""
    if not dot:
        bm = triton.next_power_of_2(max(M, 1))
        _, bn, stages = FMA_TILES.get(bm, FMA_TILES[FMA_MAX_M])
        return bm, bn, 4, stages
    if M <= DECODE_MAX_M:
        return max(_MIN_DOT, triton.next_power_of_2(M)), 64, 4, 4
    return (64 if M <= 128 else 128), 128, 8, 3


def plan_fp8_linear(M: int, N: int, K: int, num_sms: int, *, block_m: int | None = None,
                    block_n: int | None = None, split_k: int | None = None,
                    num_warps: int | None = None, num_stages: int | None = None,
                    dot: bool | None = None, kb: int | None = None, frag: bool | None = None,
                    frag_ok: bool = False) -> Fp8LinearPlan:
    """The plan of an [M, K] x FP8 [N, K]^T product on `num_sms` SMs (module docstring); a knob
    given replaces its default. `frag_ok`: the operands suit the frag path (bf16 x, K % 128 ==
    0, aligned rows), which is then the default for FMA_MAX_M < M <= 8 unless another path's
    knob is given (at M <= FMA_MAX_M the FMA path measured faster on the H200).
    Raises ValueError on an invalid knob."""
    if frag is None:
        frag = frag_ok and FMA_MAX_M < M <= FRAG_MAX_M and dot is None and kb is None \
            and block_m is None and num_stages is None
    if frag:
        return _plan_frag(M, N, K, num_sms, block_n, split_k, num_warps, frag_ok)
    dot = M > FMA_MAX_M if dot is None else dot
    if not dot and M > FMA_LIMIT_M:
        raise ValueError(f"dot=False serves M <= {FMA_LIMIT_M}; got M = {M}")
    bm, bn, warps, stages = _tile_defaults(M, dot)
    least = _MIN_DOT if dot else 1
    block_m = bm if block_m is None else pow2("block_m", block_m, least)
    if not dot and block_m < M:
        raise ValueError(f"dot=False needs block_m >= M = {M}; got {block_m}")
    num_warps = warps if num_warps is None else pow2("num_warps", num_warps, 1)
    num_stages = stages if num_stages is None else num_stages
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1; got {num_stages}")
    if split_k is not None and split_k < 1:
        raise ValueError(f"split_k must be >= 1; got {split_k}")
    k_blocks, m_tiles = triton.cdiv(max(K, 1), BLOCK), triton.cdiv(max(M, 1), block_m)
    if kb is None:
        most = FMA_TILES.get(block_m, FMA_TILES[FMA_MAX_M])[0]
        kb = 1 if dot else min(most, triton.next_power_of_2(k_blocks))
    elif pow2("kb", kb, 1) > 1 and dot:
        raise ValueError(f"kb > 1 (scale blocks per K step) is the FMA path's; got {kb}")
    k_steps = triton.cdiv(k_blocks, kb)
    target = PROGRAMS_PER_SM * num_sms

    def most_splits(bn_: int) -> int:
        if m_tiles > 1:
            return 1
        per_thread = triton.cdiv(block_m * bn_, 32 * num_warps)
        return min(k_steps, max(1, REDUCE_REGS // per_thread))

    if not dot and block_m <= NOSPLIT_MAX_M and K <= NOSPLIT_MAX_K and block_n is None \
            and split_k is None:
        rows = NOSPLIT_ROWS * block_m
        return Fp8LinearPlan(block_m, _nosplit_block_n(N, max(bn, rows), rows, num_sms), 1,
                             num_warps, num_stages, dot, kb)
    if block_n is None:
        block_n = min(bn, max(least, triton.next_power_of_2(N)))
        while M <= DECODE_MAX_M and block_n > max(least, 16) and \
                triton.cdiv(N, block_n) * most_splits(block_n) < target // 2:
            block_n //= 2
    elif pow2("block_n", block_n, least) > BLOCK:
        raise ValueError(f"block_n must divide the scale block {BLOCK}; got {block_n}")
    if split_k is None:
        split_k = min(triton.cdiv(target, m_tiles * triton.cdiv(N, block_n)),
                      most_splits(block_n))
    elif m_tiles > 1 and split_k > 1:
        raise ValueError(f"split_k > 1 needs one M tile (M <= block_m = {block_m}); got M = {M}")
    splits, _ = even_split(k_steps, split_k)
    return Fp8LinearPlan(block_m, block_n, splits, num_warps, num_stages, dot, kb)


def _nosplit_block_n(N: int, block_n: int, least: int, num_sms: int) -> int:
    """The FMA path's rows per program without a K split: `block_n` halved (down to `least`)
    while the halved tiles number at most NOSPLIT_PROGRAMS_PER_SM per SM."""
    block_n = min(block_n, max(least, triton.next_power_of_2(N)))
    while block_n > least and \
            triton.cdiv(N, block_n // 2) <= NOSPLIT_PROGRAMS_PER_SM * num_sms:
        block_n //= 2
    return block_n


def _plan_frag(M: int, N: int, K: int, num_sms: int, block_n: int | None, split_k: int | None,
               num_warps: int | None, frag_ok: bool) -> Fp8LinearPlan:
    """The frag path's plan: BLOCK_N 16 x warps rows per program (FRAG_BLOCK_N), K split into
    whole 128-k steps until FRAG_PROGRAMS_PER_SM programs per SM, each split at least
    FRAG_MIN_STEPS steps."""
    if not frag_ok or M > FRAG_MAX_M:
        raise ValueError(f"frag=True needs bf16 x with 16-byte aligned rows, K % {BLOCK} == 0 and "
                         f"M <= {FRAG_MAX_M}; got M = {M}, K = {K}")
    bn = FRAG_BLOCK_N if block_n is None else pow2("block_n", block_n, 16)
    if bn > 64 or (num_warps is not None and num_warps != bn // 16):
        raise ValueError(f"frag=True takes block_n 16, 32 or 64 and num_warps = block_n / 16; "
                         f"got {bn}, {num_warps}")
    steps, tiles = K // BLOCK, triton.cdiv(N, bn)
    if split_k is None:
        split_k = min(triton.cdiv(FRAG_PROGRAMS_PER_SM * num_sms, tiles),
                      max(1, steps // FRAG_MIN_STEPS))
    splits, _ = even_split(steps, split_k)
    return Fp8LinearPlan(min(M, FRAG_MAX_M), bn, splits, bn // 16, 1, False, 1, True)
