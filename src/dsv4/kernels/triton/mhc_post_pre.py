"""A sub-block's mHC post step fused with the next site's pre projection: `triton_mhc_post_pre`,
the fast form of `kernels/ref/mhc.py::mhc_post_pre` (same signature, same semantics).

At decode the pre step (`mhc.py`) is two launches: a split-K partial projection of X' (fn, 1.5 MB
fp32 on V4-Flash, read by ~256 programs) and the finish (the epilogue and h). The partial
projection is latency-bound at a few tokens (one K block per program), and it only re-reads the X'
that the post step has just written. Here the post kernel projects X' as it writes it:

    post + project  grid (T, S = cdiv(d, BLOCK_D)): program (t, s) mixes its [n, BLOCK_D]
                    slice of X' (`mhc_post.py::post_mix`), rounds it to x's dtype and stores it,
                    then reduces that rounded slice against the 24 fn rows' columns
                    {i d + s BLOCK_D + [0, BLOCK_D)} of every stream i into the split-K workspace
                    ws [S, T, 2, NP*NP] + sq [S, T] (the layout `mhc_split.py`'s partial kernel
                    writes);
    finish          `mhc_split.py`'s finish kernel on (X', ws, sq) with S splits, unchanged.

One launch fewer per site boundary, and the finish sums S = d / BLOCK_D partials instead of 256.
The projection's products are fp32 FMAs of the rounded bf16 / fp16 X' (exact in fp32) and fp32
fn, summed in a different order from the partial kernel's bf16x3 MMAs: the same values to fp32
rounding, not the same bits (tests compare both to the reference at the mHC tolerances).

Used up to `POST_PRE_MAX_T` tokens (each token's programs read all of fn from L2); above it, and
under the T-invariant plans, the op is `triton_mhc_post` then `triton_mhc_pre` (the unfused bits).
Invariants: x contiguous [T, n, d]; padded streams (NP > n) and padded rows carry weight 0. No
host syncs: CUDA-graph safe.

Test: tests/kernels/test_mhc_post_pre.py. Benchmark: benchmarks/kernels/bench_mhc.py (op
`post_pre`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels.triton.mhc import check_streams, triton_mhc_pre
from dsv4.kernels.triton.mhc_math import operand_rows
from dsv4.kernels.triton.mhc_post import check_post, post_mix, triton_mhc_post
from dsv4.kernels.triton.mhc_split import launch_finish, plan_finish
from dsv4.kernels.triton.pdl import pdl_args
from dsv4.kernels.triton.pdl_enter import pdl_enter

POST_PRE_MAX_T = 8      # fused up to this many tokens (fn is read from L2 once per token)
_BLOCK_D_ONE_TOKEN = 32   # BLOCK_D of the fused launch at T = 1 (`plan_post_pre`)
_BLOCK_D_TOKENS = 128     # and from T = 2


@triton.jit
def _post_project_kernel(f_ptr, x_ptr, post_ptr, comb_ptr,  # type: ignore[no-untyped-def]
                         out_ptr, fn_ptr, ws_ptr, sq_ptr, T, D, stride_ft, stride_fn,
                         N: tl.constexpr, NP: tl.constexpr, BLOCK_D: tl.constexpr,
                         EVEN_D: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    offs_d = split * BLOCK_D + tl.arange(0, BLOCK_D)
    k = tl.arange(0, NP)
    d_ok = offs_d < D
    live = (k < N)[:, None] & d_ok[None, :]
    # the pre projection's fn columns of this slice: column c of the [NP, NP] operands
    # (`operand_rows`). Loaded first: they do not depend on the kernels ahead, so their round
    # trip overlaps post_mix's loads instead of following its store
    c = tl.arange(0, NP * NP)
    pp_row, pp_ok, cm_row, cm_ok = operand_rows(N, NP, False)
    col = (k[:, None] * D + offs_d[None, :])[None, :, :]                   # [1, NP, BLOCK_D]
    w_ok = live[None, :, :]
    pp_w = tl.load(fn_ptr + pp_row[:, None, None] * stride_fn + col,
                   mask=pp_ok[:, None, None] & w_ok, other=0.0)            # [NP*NP, NP, BLOCK_D]
    cm_w = tl.load(fn_ptr + cm_row[:, None, None] * stride_fn + col,
                   mask=cm_ok[:, None, None] & w_ok, other=0.0)
    out = post_mix(f_ptr, x_ptr, post_ptr, comb_ptr, t, offs_d, d_ok, D, stride_ft, N, NP,
                   BLOCK_D, EVEN_D).to(out_ptr.dtype.element_ty)             # [NP, BLOCK_D]
    tl.store(out_ptr + (t * N + k[:, None]) * D + offs_d[None, :], out, mask=live)
    xr = tl.where(live, out.to(tl.float32), 0.0)                            # X' as stored
    pp = tl.sum(tl.sum(pp_w * xr[None, :, :], axis=2), axis=1)
    cm = tl.sum(tl.sum(cm_w * xr[None, :, :], axis=2), axis=1)
    row = (split * T + t) * (2 * NP * NP)                                   # ws [S, T, 2, NP*NP]
    tl.store(ws_ptr + row + c, pp)
    tl.store(ws_ptr + row + NP * NP + c, cm)
    tl.store(sq_ptr + split * T + t, tl.sum(tl.sum(xr * xr, axis=1), axis=0))


def plan_post_pre(T: int, d: int) -> int:
    """BLOCK_D of the post + project launch. Measured on the H200 (V4-Flash, bf16, CUDA-graph
    replays; `bench_mhc.py --ops post_pre --sweep`): at T = 1, 32 (128 programs reading 12 KB of
    fn each: 8.9-9.6 us for both launches against 10.2 at 128); from T = 2, 128 (10.2 us at T = 2,
    10.5 at T = 8, against 12.1 / 12.3 at 32). Capped at d's next power of two."""
    return min(_BLOCK_D_ONE_TOKEN if T == 1 else _BLOCK_D_TOKENS, triton.next_power_of_2(d))


def triton_mhc_post_pre(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                        fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n: int,
                        iters: int, hc_eps: float, norm_eps: float, *,
                        fuse: bool | None = None, block_d: int | None = None,
                        invariant: bool = False, weights_apart: bool | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `mhc_post_pre`: (X' [T, n, d] in x's dtype, h [T, d] in x's dtype,
    post' [T, n], comb' [T, n, n] fp32).

    f, x, post, comb as `triton_mhc_post`; fn [(2+n)*n, n*d], scale [3], base [(2+n)*n] fp32
    contiguous (the next site's). `fuse`: None: fused up to `POST_PRE_MAX_T` tokens; True /
    False: force (the benchmark, tests). `block_d`: the fused launch's d slice (a power of two
    >= 16; default `plan_post_pre`). `invariant`: never fused, the pre with its T-invariant plan
    (`triton_mhc_pre(invariant=True)`; the registry's `invariant_plans`). `weights_apart`: the
    fused form's finish knob (`mhc_split.plan_apart`; the same bits either way). Graph-capture
    safe.
    """
    T = x.shape[0] if x.dim() == 3 else 0
    if invariant and fuse:
        raise ValueError("fuse=True with invariant=True: the fused projection's plan depends on "
                         "T; allowed: fuse=None or False")
    if invariant or T == 0 or not (fuse if fuse is not None else T <= POST_PRE_MAX_T):
        new = triton_mhc_post(f, x, post, comb)
        return (new, *triton_mhc_pre(new, fn, scale, base, n, iters, hc_eps, norm_eps,
                                     invariant=invariant))
    check_post(f, x, post, comb)
    check_streams(x, fn, scale, base, (2 + n) * n, 3, n)
    bd = block_d or plan_post_pre(T, x.shape[2])
    if bd < 16 or bd & (bd - 1):
        raise ValueError(f"block_d must be a power of two >= 16; got {bd}")
    return _launch(f, x, post, comb, (fn, scale, base), (iters, hc_eps, norm_eps), bd,
                   weights_apart)


def _launch(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
            params: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
            eps: tuple[int, float, float], bd: int, apart: bool | None,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    T, n, d = x.shape
    fn, scale, base = params
    np_ = max(4, triton.next_power_of_2(n))
    S = triton.cdiv(d, bd)
    new = torch.empty_like(x)
    ws = torch.empty(S, T, 2, np_ * np_, dtype=torch.float32, device=x.device)
    sq = torch.empty(S, T, dtype=torch.float32, device=x.device)
    pdl = pdl_args(x.device)
    _post_project_kernel[(T, S)](
        f, x, post, comb, new, fn, ws, sq, T, d, f.stride(0), fn.stride(0), N=n, NP=np_,
        BLOCK_D=bd, EVEN_D=d % bd == 0, num_warps=_warps(bd), **pdl)
    outs = (torch.empty(T, d, dtype=x.dtype, device=x.device),
            torch.empty(T, n, dtype=torch.float32, device=x.device),
            torch.empty(T, n, n, dtype=torch.float32, device=x.device))
    launch_finish(new, ws, sq, scale, base, outs, eps, {"N": n, "NP": np_, "HEAD": False},
                  plan_finish(T, d, np_, S, x.device), apart)
    return (new, *outs)


def _warps(bd: int) -> int:
    """Warps of the post + project launch: its fn tiles are [NP*NP, NP, BLOCK_D] fp32 (twice):
    4 warps up to BLOCK_D 64, 8 at 128 (<= 64 fp32 registers per tile per thread)."""
    return 8 if bd > 64 else 4
