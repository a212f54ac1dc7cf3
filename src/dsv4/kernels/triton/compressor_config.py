"""Launch configuration of the Flash Compressor (`compressor.py`, `compressor_group.py`).

Owns `default_config` (block_s, num_warps, num_stages of the one-token kernel) and `default_tokens`
(tokens per program), pure functions of the compressor geometry (S source slots, Dc channels): no
device queries, so a configuration is fixed per shape and safe inside CUDA-graph capture. The Flash
geometries' choices are the H200 sweep's (benchmarks/results/compressor_h200_202611.md,
`bench_compressor.py --sweep` / `--configs`); other geometries (micro models, tests) follow the same
rules, untuned. `compressor.py` re-exports both functions.
"""

from __future__ import annotations

import triton

SHORT_WINDOW = 16           # S above this (C128): the chunked slot walk dominates (default_config)
_LONG_TILE = 8192           # BLOCK_S * BLOCK_D per chunk for long windows
_ELEMENTS_PER_WARP = 1024   # default num_warps: about 32 tile elements per thread and per gather


def default_config(S: int, Dc: int) -> tuple[int, int, int]:
    """(block_s, num_warps, num_stages): the H200 sweep's best for the Flash shapes at every batch.

    Swept with the one-token kernel's load schedule (benchmarks/results/compressor_h200_202611.md;
    `bench_compressor.py --sweep`, decode with every token completing a window at T = 1 .. 4096
    programs, and prefill of 8192 tokens): c4-attn (S 8, Dc 512) 8/4/2, within 1.2% of the best at
    every T; c4-indexer (S 8, Dc 128) 8/2/2 and c128-attn (S 128, Dc 512) 16/4/2, the best at every
    T. Short windows (S <= 16) pool in one chunk at ~1024 tile elements per warp (at least 2 warps);
    long windows walk 8192-element chunks at 2048 elements per warp.
    """
    block_d = triton.next_power_of_2(Dc)
    s_max = triton.next_power_of_2(S)
    if S > SHORT_WINDOW:
        block_s = min(s_max, max(1, _LONG_TILE // block_d))
        return block_s, max(2, min(16, block_s * block_d // (2 * _ELEMENTS_PER_WARP))), 2
    return s_max, max(2, min(8, s_max * block_d // _ELEMENTS_PER_WARP)), 2


def default_tokens(S: int, Dc: int) -> int:
    """Tokens per program (`compressor_group.py`): 2 for short windows of small rows, else 1.

    The H200 sweep (compressor_h200_202611.md; `bench_compressor.py --configs`) chose 2 tokens per
    program at 8/2/2 for the c4-indexer (S 8, Dc 128): faster from B 1024 and in prefill, within 2%
    at B 64 / 256; 4 tokens at 4 warps is within 1% of it from B 1024 and slower in prefill. c4-attn
    (Dc 512) is slower with any tokens > 1, so only windows of <= 16 slots whose one-token tile is
    small (S * Dc <= 1024, Dc >= 64) take it.
    """
    return 2 if S <= SHORT_WINDOW and triton.next_power_of_2(S) * Dc <= 1024 and Dc >= 64 else 1
