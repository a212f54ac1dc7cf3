"""Fused mHC (manifold-constrained hyper-connections, spec §5) in Triton: pre, post, head steps.

Owns `triton_mhc_pre` and `triton_mhc_head`, the fast forms of `kernels/ref/mhc.py::mhc_pre` and
`mhc_head` (same signatures, same semantics). The post step is `mhc_post.py`; the input checks and
SM count both wrappers share are in `launch.py`. Per token, X is n streams of d (x: [T, n, d]):

    pre:   r = 1/sqrt(mean(x̂²) + eps);  mix = r (fn @ x̂)   (fn [(2+n)n, n d] fp32,
           x̂ = flatten(X) in fp32)
           pre, post, comb = sigmoid / 2 sigmoid / softmax + Sinkhorn of mix;   h = Σ_i pre[i] X[i]
    post:  X'[k] = post[k] f + Σ_j comb[j, k] X[j]
    head:  pre = sigmoid(scale r (fn_head @ x̂) + base) + eps;  y = Σ_i pre[i] X[i]

Kernel design (pre and head; head is pre with HEAD=True: n projection rows, no post / comb /
Sinkhorn). The projection is a [T, n d] x [n d, 24] matmul: 96 B of fn per column against 2 B of x
per token; fn (1.5 MB on Flash) comes from HBM once, then from L2 for every token tile (BLOCK_T
amortises it). The 24 fn rows are loaded as two [BLOCK_K, NP*NP] operands
(NP = max(4, next_pow2(n)): NP*NP >= 16, the tl.dot minimum) laid out as [NP, NP] matrices, so each
accumulator reshapes to [BLOCK_T, NP, NP] weights with no gather:

    pre/post operand: column a*NP + b = fn row b (a = 0: pre) or n + b (a = 1: post); else zero
    comb operand:     column j*NP + k = fn row 2n + j*n + k (comb logit [j, k]); zero if j, k >= n

Two paths, picked on the host from T and the SM count (`plan_pre`; no host sync):
  fused (token tiles >= 2 per SM): grid (cdiv(T, BLOCK_T),). K loop over n d: x tile
      [BLOCK_T, BLOCK_K] and the two fn operands -> two tl.dot accumulators + Σ x² per token; the
      epilogue in registers on [BLOCK_T, NP, NP] tensors (r, sigmoids, masked softmax, Sinkhorn
      ending on columns); then a loop over d reads the tile's x again for h = Σ_i pre[i] X[i].
  split-K (otherwise, i.e. T < ~17K on H200; at T = 1 it is bound by reading fn): grid
      (token tiles, S); program (t, s) reduces split s's K range into ws [S, T, 2, NP*NP] +
      sq [S, T] (fp32, S * 132 B per token). Then either a second launch, grid (token tiles,
      d spans) (`plan_finish`), sums the partials, runs the epilogue and writes its span of h
      (span-0 programs, or at decode a column of programs of their own, write post / comb);
      small T: one token per program and d in spans (the pre weights are redone per span: cheap
      for few tokens); large T: whole rows and token tiles, so
      each Sinkhorn runs once per token on a vectorised tile instead of 16 scattered lanes. Or, on
      request only (`one_launch=True`: slower on the H200, `mhc_split.py::plan_one_launch`), ONE
      launch: each token tile's last partial program to arrive (an arrival counter per tile) runs
      that finish over all of d. `mhc_split.py` has both forms, their bits and the counters;
      `mhc_math.py` the shared code.
Precision: the reference matmul is fp32. bf16 x is exact in bf16, so fn is split in registers into
bf16 pieces w1 + w2 + w3 (= fn to ~24 bits) and the projection is three bf16 MMAs with exact
products and fp32 accumulation ("bf16x3": ~26 GFLOP at T = 8192 with the padding, ~30 us of H200
tensor-core time under the ~77 us memory floor); fp16 / fp32 x use tl.dot's "tf32x3". Under
TRITON_INTERPRET=1 the pieces are upcast and multiplied in fp32 (the interpreter's bf16 dot is
broken, triton-lang/triton#11584): the same products.
Traffic: x is read twice (projection, then h). Between the two reads the other tiles stream far more
than L2 holds, so on Flash shapes the second read comes from HBM: ~72 KB per token against the
40 KB floor. Keeping a tile's x on chip (32 KB per token) needs BLOCK_T ~4, which tl.dot's M >= 16
and fn's L2 traffic (1.5 MB / BLOCK_T per token) forbid. At a few tokens the serving forward
projects X' as the post step writes it instead (`mhc_post_pre.py`: the partial launch is dropped,
the finish launch here runs on its partials).
Invariants: x contiguous [T, n, d]; padded streams (NP > n) carry weight 0 and padded tokens are
masked, so every sum equals the unpadded one. No host syncs: CUDA-graph safe.

Tests: tests/kernels/test_mhc_triton.py, test_mhc_one_launch.py. Benchmark:
benchmarks/kernels/bench_mhc.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv4.kernels.triton.launch import X_DTYPES, expect, one_device, pow2, sms
from dsv4.kernels.triton.mhc_math import finish, project
from dsv4.kernels.triton.mhc_split import (
    finish_warps,
    launch_split,
    plan_finish,
    plan_one_launch,
)
from dsv4.kernels.triton.pdl import pdl_args
from dsv4.kernels.triton.pdl_enter import pdl_enter

__all__ = ["INVARIANT_SPLITS", "check_streams", "finish_warps", "plan_finish",
           "plan_one_launch", "plan_pre", "triton_mhc_head", "triton_mhc_pre"]

_MIN_DOT = 16
_H_TILE = 8192          # elements of an h-loop tile [BLOCK_T, NP, BLOCK_D]
_PROGRAMS_PER_SM = 2    # split-K target: partial-launch programs per SM
INVARIANT_SPLITS = 32   # split-K factor of the T-invariant plan (clipped to the K blocks)


@triton.jit
def _mhc_fused_kernel(x_ptr, fn_ptr, scale_ptr, base_ptr, h_ptr,  # type: ignore[no-untyped-def]
                      post_ptr, comb_ptr, T, D, iters, hc_eps, norm_eps, stride_xt, stride_fn,
                      stride_ht, N: tl.constexpr, NP: tl.constexpr, HEAD: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                      EVEN_K: tl.constexpr, EVEN_D: tl.constexpr, DOT: tl.constexpr,
                      INTERPRET: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    pp, cm, sq = project(x_ptr, fn_ptr, offs_t, t_mask, 0, N * D, stride_xt, stride_fn,
                         N, NP, HEAD, BLOCK_T, BLOCK_K, EVEN_K, DOT, INTERPRET)
    finish(x_ptr, scale_ptr, base_ptr, h_ptr, post_ptr, comb_ptr, pp, cm, sq, offs_t, t_mask, 0,
           D, D, iters, hc_eps, norm_eps, stride_xt, stride_ht, True, N, NP, HEAD, BLOCK_T,
           BLOCK_D, EVEN_D)


# ---- host side -----------------------------------------------------------------------------------


def plan_pre(T: int, K: int, device: torch.device, block_t: int | None = None, block_k: int = 64,
             splits: int | None = None, invariant: bool = False) -> tuple[int, int, int]:
    """(block_t, splits, k_per_split) of the pre / head kernels; splits == 1 is the fused path.

    Default: token tiles of min(64, next_pow2(T)) (>= 16), split over K until there are ~2 programs
    per SM (the interpreter counts 1 SM). `invariant`: a plan from K alone (16-token tiles,
    `INVARIANT_SPLITS` splits), so a token's result does not depend on T.
    """
    if invariant:
        block_t = block_t or _MIN_DOT
        splits = splits or INVARIANT_SPLITS
    bt = pow2("block_t", block_t or min(64, max(_MIN_DOT, triton.next_power_of_2(T))), _MIN_DOT)
    k_blocks = triton.cdiv(K, pow2("block_k", block_k, _MIN_DOT))
    want = splits if splits is not None else _PROGRAMS_PER_SM * sms(device) // triton.cdiv(T, bt)
    k_per_split = triton.cdiv(k_blocks, max(1, min(want, k_blocks))) * block_k
    return bt, triton.cdiv(K, k_per_split), k_per_split


def check_streams(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                  rows: int, n_scale: int, n: int | None = None) -> None:
    """The pre / head input contract: x [T, n, d] contiguous in `X_DTYPES` (n streams when given),
    fn [rows, n*d], scale [n_scale], base [rows] fp32, one device; ValueError names the field."""
    if x.dim() != 3:
        raise ValueError(f"x must be [T, n, d]; got {list(x.shape)}")
    T, n, d = x.shape
    fp32 = (torch.float32,)
    expect("x", x, (T, n, d), X_DTYPES)
    expect("fn", fn, (rows, n * d), fp32)
    expect("scale", scale, (n_scale,), fp32)
    expect("base", base, (rows,), fp32)
    one_device(x, fn, scale, base)
    if n is not None and x.shape[1] != n:
        raise ValueError(f"x has {x.shape[1]} streams but n = {n}")


@dataclass(frozen=True)
class _Knobs:
    """The keyword knobs of `triton_mhc_pre` / `triton_mhc_head` (see there)."""

    block_t: int | None
    block_k: int
    splits: int | None
    num_warps: int
    num_stages: int
    invariant: bool
    one_launch: bool | None
    d_spans: int | None
    counters: torch.Tensor | None
    weights_apart: bool | None = None


def _launch_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                outs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                eps: tuple[int, float, float], head: bool, k: _Knobs) -> None:
    T, n, d = x.shape
    bt, S, k_per_split = plan_pre(T, n * d, x.device, k.block_t, k.block_k, k.splits, k.invariant)
    np_ = max(4, triton.next_power_of_2(n))           # NP*NP >= 16: the tl.dot minimum
    consts = {"N": n, "NP": np_, "HEAD": head, "BLOCK_K": k.block_k,
              "DOT": "bf16x3" if x.dtype == torch.bfloat16 else "tf32x3" if x.is_cuda else "ieee",
              "INTERPRET": not x.is_cuda, "EVEN_K": (n * d) % k.block_k == 0}
    if S > 1:
        launch_split(x, fn, scale, base, outs, eps, (bt, S, k_per_split), consts, k.num_warps,
                     k.num_stages, k.invariant, k.one_launch, k.d_spans, k.counters,
                     k.weights_apart)
        return
    h, post, comb = outs
    iters, hc_eps, norm_eps = eps
    bd = max(_MIN_DOT, min(triton.next_power_of_2(d), _H_TILE // (bt * np_)))
    _mhc_fused_kernel[(triton.cdiv(T, bt),)](
        x, fn, scale, base, h, post, comb, T, d, iters, hc_eps, norm_eps, x.stride(0),
        fn.stride(0), h.stride(0), BLOCK_T=bt, BLOCK_D=bd, EVEN_D=d % bd == 0, **consts,
        num_warps=k.num_warps, num_stages=k.num_stages, **pdl_args(x.device))


def triton_mhc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                   n: int, iters: int, hc_eps: float, norm_eps: float, *,
                   block_t: int | None = None, block_k: int = 64, splits: int | None = None,
                   num_warps: int = 4, num_stages: int = 3, invariant: bool = False,
                   one_launch: bool | None = None, d_spans: int | None = None,
                   counters: torch.Tensor | None = None, weights_apart: bool | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `mhc_pre`: x [T, n, d] -> (h [T, d] in x's dtype, post [T, n],
    comb [T, n, n] fp32).

    x: bf16 / fp16 / fp32; fn [(2+n)*n, n*d], scale [3], base [(2+n)*n]: fp32. All contiguous, one
    device. Keyword arguments are tuning knobs (benchmark sweeps, tests); `splits=1` forces the
    fused path, > 1 the split-K path (clipped to the number of BLOCK_K blocks). `invariant`: the
    plan comes from the shapes of one token only (`plan_pre`), so each token's outputs are the same
    bits whatever T is (what lets an RL trainer reproduce the engine's values). Split-K only:
    `one_launch` (None: the plan's choice, `plan_one_launch`; True / False: one launch / two),
    `d_spans` (the two-launch finish's d spans; 1 gives the one-launch form's bits), `counters`
    (the one-launch arrival counters: a zeroed contiguous int32 buffer of >= token tiles words,
    left zero; default: mHC's buffer held per device, `mhc_split.py` says when to pass one),
    `weights_apart` (the two-launch finish's post / comb programs, `mhc_split.plan_apart`: None
    the plan's choice; the same bits either way). No host syncs: safe inside CUDA-graph capture.
    """
    check_streams(x, fn, scale, base, (2 + n) * n, 3, n)
    T, _, d = x.shape
    h = torch.empty(T, d, dtype=x.dtype, device=x.device)
    post = torch.empty(T, n, dtype=torch.float32, device=x.device)
    comb = torch.empty(T, n, n, dtype=torch.float32, device=x.device)
    if T > 0:
        _launch_pre(x, fn, scale, base, (h, post, comb), (iters, hc_eps, norm_eps), False,
                    _Knobs(block_t, block_k, splits, num_warps, num_stages, invariant, one_launch,
                           d_spans, counters, weights_apart))
    return h, post, comb


def triton_mhc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                    hc_eps: float, norm_eps: float, *, block_t: int | None = None,
                    block_k: int = 64, splits: int | None = None, num_warps: int = 4,
                    num_stages: int = 3, invariant: bool = False, one_launch: bool | None = None,
                    d_spans: int | None = None, counters: torch.Tensor | None = None,
                    ) -> torch.Tensor:
    """Same contract as `mhc_head`: x [T, n, d] -> y [T, d] in x's dtype; fn [n, n*d], scale [1],
    base [n] fp32.

    The pre kernels with HEAD=True (n projection rows, no post / comb); knobs (`invariant`,
    `one_launch`, ...) as in `triton_mhc_pre`.
    """
    check_streams(x, fn, scale, base, x.shape[1] if x.dim() == 3 else -1, 1)
    T, _, d = x.shape
    y = torch.empty(T, d, dtype=x.dtype, device=x.device)
    # NOTE: post / comb pointers are never dereferenced with HEAD=True; y stands in for them
    if T > 0:
        _launch_pre(x, fn, scale, base, (y, y, y), (1, hc_eps, norm_eps), True,
                    _Knobs(block_t, block_k, splits, num_warps, num_stages, invariant, one_launch,
                           d_spans, counters))
    return y
