"""Split-K path of the mHC pre / head kernels (`mhc.py`): two launches, or one.

Owns the partial, finish and one-launch kernels, the finish launch's tile plan (`plan_finish`,
`finish_warps`), the choice between one and two launches (`plan_one_launch`) and the launch
(`launch_split`). The math lives in `mhc_math.py`; `mhc.py` has the design and picks this path.

    two launches  partial, grid (token tiles, S): program (t, s) reduces split s's K range into
                  ws [S, T, 2, NP*NP] + sq [S, T] (fp32). finish, grid (finish tiles, d spans):
                  sums the partials (`sum_partials`), runs the epilogue, writes its span of h
                  (span-0 programs write post / comb). At decode (`plan_apart`: spans of one
                  tile) post / comb get a column of programs of their own, so the Sinkhorn's
                  serial chain (~20 dependent row / column normalisations) runs beside the h
                  programs instead of before span 0's h, and the h programs issue their stream
                  and parameter loads before the partials'.
    one launch    grid (token tiles, S): each program stores its partials as above, then takes a
                  ticket on its token tile's arrival counter; the tile's last arrival runs the
                  finish for the whole tile over ALL of d (one d span), finish tile by finish
                  tile, and resets the counter to 0. No second launch and no launch gap: at decode
                  (T of a few tokens) the finish is one program's work.

Memory ordering (one launch): every thread's partial stores precede a CTA barrier; then one
atomic_add (acq_rel, gpu scope) on the counter: the pattern of `gemv_tile.py::store_tile` and
`topk_compact.py` (the barrier orders the CTA's writes before the release, the counter's RMWs form
a release sequence, so the program that reads S - 1 acquires every split's partials; it still
reads them with L1-bypassing .cg loads). Nobody waits, so no deadlock at any occupancy; under
TRITON_INTERPRET=1 (programs run in turn) the last program in order finishes.

Bit-identity: the tail sums the partials with the finish launch's code (`sum_partials`, same
BLOCK_S chunks in split order) on the finish tiles `plan_finish(..., spans=1)` gives, and runs
`finish` over d in the same BLOCK_D chunks, so its outputs are the bits of the two-launch form with
one d span (`d_spans=1`) whenever the kernels run with the same warps (Triton's reductions follow
the layout): on V4-Flash shapes (d = 4096: 4 warps both; checked on the H200), not on small test
shapes whose finish gets 1 warp (there: equal under the interpreter only). It is slower at decode
(`plan_one_launch`), so it runs only on request.

Counters: one int32 per token tile, from a buffer held per device (`_COUNTERS`, mHC's own
`GemvCounters`), zero when allocated and left zero by every call, so no memset node per call, in
or out of CUDA graphs (a first use inside a capture takes a fresh zeroed buffer that lives in the
graph). Calls sharing it must never overlap. They do not: the engine issues every mHC step on its
main stream (`EngineConfig.multi_stream` moves only attention's compressor / indexer branch and
the shared expert to the side stream, `model/streams.py`), kernels of one stream run one after
another, and every decode graph replays on that stream. A per-module buffer (`QuantLinear`'s
choice) would add an argument to the `mhc_pre` / `mhc_head` op protocols that the ref ops do not
need, for no case the engine has; a caller that runs mHC on two streams at once passes its own
zeroed buffer per stream (`counters=`).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from dsv4.kernels.triton.gemv import GemvCounters
from dsv4.kernels.triton.launch import sms
from dsv4.kernels.triton.mhc_math import (
    comb_params,
    finish,
    inv_rms,
    load_streams,
    pre_params,
    pre_weights,
    project,
    store_h,
    store_weights,
    sum_partials,
)
from dsv4.kernels.triton.pdl import pdl_args
from dsv4.kernels.triton.pdl_enter import pdl_enter

_MIN_DOT = 16
_H_TILE = 8192          # elements of an h-loop tile [BLOCK_T, NP, BLOCK_D]
_WS_TILE = 1024         # elements of a finish workspace tile [BLOCK_T, BLOCK_S, NP*NP]
_FINISH_PROGRAMS_PER_SM = 4
_MIN_D_SPAN = 256       # finish launch: smallest d range per program (1 KB of bf16 per stream)
_COUNTERS = GemvCounters()


@triton.jit
def _store_partials(x_ptr, fn_ptr, ws_ptr, sq_ptr, offs_t, t_mask,  # type: ignore[no-untyped-def]
                    split, T, K, k_per_split, stride_xt, stride_fn, N: tl.constexpr,
                    NP: tl.constexpr, HEAD: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT: tl.constexpr,
                    INTERPRET: tl.constexpr):
    """Split `split`'s projection of tokens offs_t into ws [S, T, 2, NP*NP] and sq [S, T]."""
    k_lo = split * k_per_split
    pp, cm, sq = project(x_ptr, fn_ptr, offs_t, t_mask, k_lo, tl.minimum(k_lo + k_per_split, K),
                         stride_xt, stride_fn, N, NP, HEAD, BLOCK_T, BLOCK_K, EVEN_K, DOT,
                         INTERPRET)
    c = tl.arange(0, NP * NP)
    row = (split * T + offs_t) * (2 * NP * NP)                              # ws [S, T, 2, NP*NP]
    tl.store(ws_ptr + row[:, None] + c[None, :], pp, mask=t_mask[:, None])
    if not HEAD:
        tl.store(ws_ptr + row[:, None] + NP * NP + c[None, :], cm, mask=t_mask[:, None])
    tl.store(sq_ptr + split * T + offs_t, sq, mask=t_mask)


@triton.jit
def _mhc_partial_kernel(x_ptr, fn_ptr, ws_ptr, sq_ptr, T, K,  # type: ignore[no-untyped-def]
                        k_per_split, stride_xt, stride_fn, N: tl.constexpr, NP: tl.constexpr,
                        HEAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                        EVEN_K: tl.constexpr, DOT: tl.constexpr, INTERPRET: tl.constexpr,
                        PDL: tl.constexpr):
    pdl_enter(PDL)
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    _store_partials(x_ptr, fn_ptr, ws_ptr, sq_ptr, offs_t, offs_t < T, tl.program_id(1), T, K,
                    k_per_split, stride_xt, stride_fn, N, NP, HEAD, BLOCK_T, BLOCK_K, EVEN_K, DOT,
                    INTERPRET)


@triton.jit
def _mhc_finish_kernel(x_ptr, ws_ptr, sq_ptr, scale_ptr, base_ptr,  # type: ignore[no-untyped-def]
                       h_ptr, post_ptr, comb_ptr, T, D, S, d_span, iters, hc_eps, norm_eps,
                       stride_xt, stride_ht, N: tl.constexpr, NP: tl.constexpr, HEAD: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                       EVEN_D: tl.constexpr, APART: tl.constexpr, PDL: tl.constexpr):
    """Grid (finish tiles, d spans [+ 1 with APART]). APART: the last column's programs write
    post / comb only (the Sinkhorn), the span programs h only, each span one BLOCK_D tile whose
    stream loads are issued before the partials' (`plan_apart`); else span 0 writes both."""
    pdl_enter(PDL)
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    pid_d = tl.program_id(1)
    if APART:      # every load that does not need the partials is issued before them
        if pid_d == tl.num_programs(1) - 1:
            params = comb_params(scale_ptr, base_ptr, N, NP)
            pp, cm, sq = sum_partials(ws_ptr, sq_ptr, offs_t, t_mask, T, S, NP, False, BLOCK_T,
                                      BLOCK_S, "")
            store_weights(pp, cm, inv_rms(sq, norm_eps, D, N), params, post_ptr, comb_ptr,
                          offs_t, t_mask, iters, hc_eps, N, NP, BLOCK_T)
        else:
            d_lo = pid_d * BLOCK_D
            xs = load_streams(x_ptr, offs_t, t_mask, d_lo, D, D, stride_xt, N, BLOCK_D, EVEN_D)
            scale, base = pre_params(scale_ptr, base_ptr, N, NP)
            pp, cm, sq = sum_partials(ws_ptr, sq_ptr, offs_t, t_mask, T, S, NP, True, BLOCK_T,
                                      BLOCK_S, "")
            pre = pre_weights(tl.reshape(pp, (BLOCK_T, NP, NP)), inv_rms(sq, norm_eps, D, N),
                              scale, base, hc_eps, N, NP)
            store_h(h_ptr, pre, xs, offs_t, t_mask, d_lo, D, stride_ht, N, NP, BLOCK_D, EVEN_D)
    else:
        pp, cm, sq = sum_partials(ws_ptr, sq_ptr, offs_t, t_mask, T, S, NP, HEAD, BLOCK_T,
                                  BLOCK_S, "")
        d_lo = pid_d * d_span
        finish(x_ptr, scale_ptr, base_ptr, h_ptr, post_ptr, comb_ptr, pp, cm, sq, offs_t, t_mask,
               d_lo, tl.minimum(d_lo + d_span, D), D, iters, hc_eps, norm_eps, stride_xt,
               stride_ht, pid_d == 0, N, NP, HEAD, BLOCK_T, BLOCK_D, EVEN_D)


@triton.jit
def _mhc_one_launch_kernel(x_ptr, fn_ptr, ws_ptr, sq_ptr, cnt_ptr,  # type: ignore[no-untyped-def]
                           scale_ptr, base_ptr, h_ptr, post_ptr, comb_ptr, T, K, D, S,
                           k_per_split, iters, hc_eps, norm_eps, stride_xt, stride_fn, stride_ht,
                           N: tl.constexpr, NP: tl.constexpr, HEAD: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                           DOT: tl.constexpr, INTERPRET: tl.constexpr, FINISH_T: tl.constexpr,
                           BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
                           PDL: tl.constexpr):
    """The partial program (tile, split), then the tile's last arrival finishes the tile.

    FINISH_T divides BLOCK_T, so the finish tiles t0 + [0, FINISH_T) are the finish launch's."""
    pdl_enter(PDL)
    tile = tl.program_id(0)
    offs_t = tile.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    _store_partials(x_ptr, fn_ptr, ws_ptr, sq_ptr, offs_t, offs_t < T, tl.program_id(1), T, K,
                    k_per_split, stride_xt, stride_fn, N, NP, HEAD, BLOCK_T, BLOCK_K, EVEN_K, DOT,
                    INTERPRET)
    tl.debug_barrier()          # every thread's partial stores precede the release below
    done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if done == S - 1:           # the tile's last arrival: every split's partials are visible
        t_lo = tile * BLOCK_T
        for t0 in range(t_lo, tl.minimum(t_lo + BLOCK_T, T), FINISH_T):
            offs_f = tl.arange(0, FINISH_T).to(tl.int64) + t0
            f_mask = offs_f < T
            pp, cm, sq = sum_partials(ws_ptr, sq_ptr, offs_f, f_mask, T, S, NP, HEAD, FINISH_T,
                                      BLOCK_S, ".cg")
            finish(x_ptr, scale_ptr, base_ptr, h_ptr, post_ptr, comb_ptr, pp, cm, sq, offs_f,
                   f_mask, 0, D, D, iters, hc_eps, norm_eps, stride_xt, stride_ht, True, N, NP,
                   HEAD, FINISH_T, BLOCK_D, EVEN_D)
        tl.store(cnt_ptr + tile, 0)                                  # zero for the next call


# ---- host side -----------------------------------------------------------------------------------


def plan_finish(T: int, d: int, np_: int, S: int, device: torch.device,
                invariant: bool = False, spans: int | None = None) -> tuple[int, int, int, int]:
    """(block_t, d_span, block_d, block_s) of the finish, aiming at ~4 programs per SM.

    Small T: one token per program and d split into spans (the 24-value epilogue is redone per span:
    cheap for few tokens). Large T: whole rows, and token tiles that vectorise the epilogue (one
    Sinkhorn per token). `invariant`: one token and all of d per program at every T (the tile
    shapes fix the order of the sums over splits and streams, so they must not depend on T).
    `spans`: the d spans instead of the plan's (rounded down to a power of two; 1: whole rows, the
    one-launch form's tiles).
    """
    target = _FINISH_PROGRAMS_PER_SM * sms(device)
    if spans is None:
        spans = 1 if invariant else max(1, min(target // T, d // _MIN_D_SPAN))
    elif spans < 1:
        raise ValueError(f"d_spans must be >= 1; got {spans}")
    spans = 1 << (spans.bit_length() - 1)
    bt = 1 if T < 2 * target or invariant else min(16, 1 << ((T // target).bit_length() - 1))
    block_d = min(triton.next_power_of_2(triton.cdiv(d, spans)),
                  max(_MIN_DOT, _H_TILE // (bt * np_)))
    d_span = triton.cdiv(triton.cdiv(d, spans), block_d) * block_d
    return bt, d_span, block_d, min(triton.next_power_of_2(S), max(1, _WS_TILE // (bt * np_ * np_)))


def finish_warps(block_t: int, np_: int, block_d: int) -> int:
    """Warps of a finish program: its epilogue (Sinkhorn on [BLOCK_T, NP, NP]) is a chain of
    tiny reductions whose cross-warp steps cost more than the work, so a small tile gets one warp
    (32 elements of its [BLOCK_T, NP, BLOCK_D] h tile per thread at most), larger ones 2 or 4.
    Depends on the tile shapes only (the invariant plan's are T-independent, so are its warps)."""
    per_tile = block_t * np_ * block_d
    return 1 if per_tile <= 1024 else 2 if per_tile <= 2048 else 4


def plan_one_launch(T: int, d: int, np_: int, S: int, num_warps: int, device: torch.device,
                    invariant: bool = False, one_launch: bool | None = None,
                    ) -> tuple[int, int, int, int] | None:
    """The finish tiles (`plan_finish` with one d span) of the one-launch form, or None for two
    launches; from shapes only.

    Default (`one_launch=None`): two launches. Measured on the H200 (flash shapes, bf16): the one
    launch takes 15.95 us at T = 1 and 25.1 us at T = 2 against 11.9 / 12.3 us for the two
    launches (its last arrival finishes the whole of d alone, where the finish launch spreads d
    over 16 programs). `one_launch=True` forces it on a split-K plan (the benchmark; its bits are
    the two-launch form's with `d_spans=1` where the warps match, as on flash shapes); S == 1 is
    the fused path: always None.
    """
    if S == 1 or not one_launch:
        return None
    return plan_finish(T, d, np_, S, device, invariant, spans=1)


def _counter_buffer(counters: torch.Tensor | None, tiles: int,
                    device: torch.device) -> torch.Tensor:
    cnt = _COUNTERS.get(device) if counters is None else counters
    if (cnt.dtype != torch.int32 or cnt.numel() < tiles or not cnt.is_contiguous()
            or cnt.device != device):
        raise ValueError(f"counters must be a contiguous int32 tensor of >= {tiles} words on "
                         f"{device}; got {cnt.dtype} {cnt.numel()} on {cnt.device}, "
                         f"contiguous={cnt.is_contiguous()}")
    return cnt


def launch_split(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                 outs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                 eps: tuple[int, float, float], plan: tuple[int, int, int],
                 consts: dict[str, Any], num_warps: int, num_stages: int, invariant: bool,
                 one_launch: bool | None, d_spans: int | None,
                 counters: torch.Tensor | None, apart: bool | None = None) -> None:
    """The split-K path: outs = (h, post, comb), eps = (iters, hc_eps, norm_eps), plan =
    (block_t, S, k_per_split) from `plan_pre`, consts = the partial kernels' constexprs (N, NP,
    HEAD, DOT, INTERPRET, BLOCK_K, EVEN_K). One launch or two (`plan_one_launch`)."""
    T, n, d = x.shape
    bt, S, k_per_split = plan
    np_ = consts["NP"]
    geo = {"N": consts["N"], "NP": np_, "HEAD": consts["HEAD"]}
    h, post, comb = outs
    iters, hc_eps, norm_eps = eps
    ws = torch.empty(S, T, 2, np_ * np_, dtype=torch.float32, device=x.device)
    sq = torch.empty(S, T, dtype=torch.float32, device=x.device)
    tiles = plan_one_launch(T, d, np_, S, num_warps, x.device, invariant, one_launch)
    grid = (triton.cdiv(T, bt), S)
    if tiles is not None:
        fbt, _, bd, bs = tiles
        cnt = _counter_buffer(counters, grid[0], x.device)
        _mhc_one_launch_kernel[grid](
            x, fn, ws, sq, cnt, scale, base, h, post, comb, T, n * d, d, S, k_per_split, iters,
            hc_eps, norm_eps, x.stride(0), fn.stride(0), h.stride(0), BLOCK_T=bt, FINISH_T=fbt,
            BLOCK_S=bs, BLOCK_D=bd, EVEN_D=d % bd == 0, **consts, num_warps=num_warps,
            num_stages=num_stages, **pdl_args(x.device))
        return
    _mhc_partial_kernel[grid](
        x, fn, ws, sq, T, n * d, k_per_split, x.stride(0), fn.stride(0), BLOCK_T=bt, **consts,
        num_warps=num_warps, num_stages=num_stages, **pdl_args(x.device))
    launch_finish(x, ws, sq, scale, base, outs, eps, geo,
                  plan_finish(T, d, np_, S, x.device, invariant, d_spans), apart)


def plan_apart(head: bool, d: int, tiles: tuple[int, int, int, int],
               apart: bool | None = None) -> bool:
    """Whether the finish writes post / comb from programs of their own (`_mhc_finish_kernel`'s
    APART), from shapes only. Needs a pre (not HEAD) and spans of one BLOCK_D tile. Default
    (`apart=None`): whenever d is in two spans or more (decode), so the Sinkhorn's serial chain
    runs beside the h programs instead of before span 0's h. True forces it where it applies (a
    single span gets its own weights program too); False: span 0 writes both. Same bits either
    way: the same functions on the same tiles."""
    _, d_span, block_d, _ = tiles
    if head or d_span != block_d or apart is False:
        return False
    return apart is True or triton.cdiv(d, d_span) > 1


def launch_finish(x: torch.Tensor, ws: torch.Tensor, sq: torch.Tensor, scale: torch.Tensor,
                  base: torch.Tensor, outs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                  eps: tuple[int, float, float], geo: dict[str, Any],
                  tiles: tuple[int, int, int, int], apart: bool | None = None) -> None:
    """The finish launch on the partials ws [S, T, 2, NP*NP] + sq [S, T] of x [T, n, d]: outs =
    (h, post, comb), geo = the N, NP, HEAD constexprs, tiles = `plan_finish`'s, apart =
    `plan_apart`'s knob. Also the second launch of `mhc_post_pre.py` (whose first launch writes
    the partials)."""
    T, _, d = x.shape
    S = ws.shape[0]
    h, post, comb = outs
    iters, hc_eps, norm_eps = eps
    fbt, d_span, bd, bs = tiles
    split = plan_apart(geo["HEAD"], d, tiles, apart)
    _mhc_finish_kernel[(triton.cdiv(T, fbt), triton.cdiv(d, d_span) + split)](
        x, ws, sq, scale, base, h, post, comb, T, d, S, d_span, iters, hc_eps, norm_eps,
        x.stride(0), h.stride(0), BLOCK_T=fbt, BLOCK_S=bs, BLOCK_D=bd, EVEN_D=d % bd == 0,
        APART=split, **geo, num_warps=finish_warps(fbt, geo["NP"], bd), **pdl_args(x.device))
