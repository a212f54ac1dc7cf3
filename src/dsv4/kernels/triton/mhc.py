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
      sq [S, T] (fp32, S * 132 B per token). A second launch, grid (token tiles, d spans)
      (`plan_finish`), sums the partials, runs the epilogue and writes its span of h (span-0
      programs write post / comb). Small T: one token per program and d in spans (the epilogue is
      redone per span: cheap for few tokens); large T: whole rows and token tiles, so each Sinkhorn
      runs once per token on a vectorised tile instead of 16 scattered lanes.
Precision: the reference matmul is fp32. bf16 x is exact in bf16, so fn is split in registers into
bf16 pieces w1 + w2 + w3 (= fn to ~24 bits) and the projection is three bf16 MMAs with exact
products and fp32 accumulation ("bf16x3": ~26 GFLOP at T = 8192 with the padding, ~30 us of H200
tensor-core time under the ~77 us memory floor); fp16 / fp32 x use tl.dot's "tf32x3". Under
TRITON_INTERPRET=1 the pieces are upcast and multiplied in fp32 (the interpreter's bf16 dot is
broken, triton-lang/triton#11584): the same products.
Traffic: x is read twice (projection, then h). Between the two reads the other tiles stream far more
than L2 holds, so on Flash shapes the second read comes from HBM: ~72 KB per token against the
40 KB floor. Keeping a tile's x on chip (32 KB per token) needs BLOCK_T ~4, which tl.dot's M >= 16
and fn's L2 traffic (1.5 MB / BLOCK_T per token) forbid. Fusing post with the next pre would drop
one read of X' (project X' as it is written); that needs the model to hand both steps to one op.
Invariants: x contiguous [T, n, d]; padded streams (NP > n) carry weight 0 and padded tokens are
masked, so every sum equals the unpadded one. No host syncs: CUDA-graph safe.

Test: tests/kernels/test_mhc_triton.py. Benchmark: benchmarks/kernels/bench_mhc.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels.triton.launch import X_DTYPES, expect, one_device, pow2, sms

_MIN_DOT = 16
_H_TILE = 8192          # elements of an h-loop tile [BLOCK_T, NP, BLOCK_D]
_WS_TILE = 1024         # elements of a finish-launch workspace tile [BLOCK_T, BLOCK_S, NP*NP]
_PROGRAMS_PER_SM = 2    # split-K target: partial-launch programs per SM
_FINISH_PROGRAMS_PER_SM = 4
_MIN_D_SPAN = 256       # finish launch: smallest d range per program (1 KB of bf16 per stream)
INVARIANT_SPLITS = 32   # split-K factor of the T-invariant plan (clipped to the K blocks)


@triton.jit
def _dot(xt, w, acc, DOT: tl.constexpr, INTERPRET: tl.constexpr):  # type: ignore[no-untyped-def]
    if DOT == "bf16x3":     # xt is bf16 (exact); w = w1 + w2 + w3 in bf16 (module docstring)
        w1 = w.to(tl.bfloat16)
        rest = w - w1.to(tl.float32)
        w2 = rest.to(tl.bfloat16)
        w3 = (rest - w2.to(tl.float32)).to(tl.bfloat16)
        if INTERPRET:   # the interpreter's bf16 dot is broken: the same (exact) products in fp32
            xt, w1 = xt.to(tl.float32), w1.to(tl.float32)
            w2, w3 = w2.to(tl.float32), w3.to(tl.float32)
        acc = tl.dot(xt, w3, acc)
        acc = tl.dot(xt, w2, acc)
        acc = tl.dot(xt, w1, acc)
    else:
        acc = tl.dot(xt.to(tl.float32), w, acc, input_precision=DOT)
    return acc


@triton.jit
def _project(x_ptr, fn_ptr, offs_t, t_mask, k_lo, k_hi,  # type: ignore[no-untyped-def]
             stride_xt, stride_fn, N: tl.constexpr, NP: tl.constexpr, HEAD: tl.constexpr,
             BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
             DOT: tl.constexpr, INTERPRET: tl.constexpr):
    """Σ over k in [k_lo, k_hi) of x̂[t, k] fn[row, k] for both operands, and Σ x̂[t, k]²."""
    c = tl.arange(0, NP * NP)
    a, b = c // NP, c % NP
    if HEAD:
        pp_ok = (a == 0) & (b < N)
    else:
        pp_ok = (a < 2) & (b < N)
    cm_ok = (a < N) & (b < N)
    pp_ptr = fn_ptr + (a * N + b)[None, :] * stride_fn
    cm_ptr = fn_ptr + (2 * N + a * N + b)[None, :] * stride_fn
    x_row = x_ptr + offs_t[:, None] * stride_xt
    acc_pp = tl.zeros([BLOCK_T, NP * NP], tl.float32)
    acc_cm = tl.zeros([BLOCK_T, NP * NP], tl.float32)
    sq = tl.zeros([BLOCK_T], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        # every split is a whole number of BLOCK_K blocks: no k mask (vectorised loads)
        if EVEN_K:
            x_m, pp_m, cm_m = t_mask[:, None], pp_ok[None, :], cm_ok[None, :]
        else:
            k_ok = offs_k < k_hi
            x_m, pp_m, cm_m = t_mask[:, None] & k_ok[None, :], pp_ok[None, :] & k_ok[:, None], \
                cm_ok[None, :] & k_ok[:, None]
        xt = tl.load(x_row + offs_k[None, :], mask=x_m, other=0.0)          # [BLOCK_T, BLOCK_K]
        xf = xt.to(tl.float32)
        sq += tl.sum(xf * xf, axis=1)
        w = tl.load(pp_ptr + offs_k[:, None], mask=pp_m, other=0.0)          # [BLOCK_K, NP*NP]
        acc_pp = _dot(xt, w, acc_pp, DOT, INTERPRET)
        if not HEAD:
            w = tl.load(cm_ptr + offs_k[:, None], mask=cm_m, other=0.0)
            acc_cm = _dot(xt, w, acc_cm, DOT, INTERPRET)
    return acc_pp, acc_cm, sq


@triton.jit
def _pre_weights(pp, r, scale_ptr, base_ptr, hc_eps,  # type: ignore[no-untyped-def]
                 N: tl.constexpr, NP: tl.constexpr):
    """pp: [BT, NP, NP] raw projection (row 0 = pre), r: [BT] -> pre [BT, NP], 0 in padded
    streams."""
    a = tl.arange(0, NP)[None, :, None]
    i = tl.arange(0, NP)
    mix = tl.sum(tl.where(a == 0, pp, 0.0), axis=1) * r[:, None]
    z = mix * tl.load(scale_ptr) + tl.load(base_ptr + i, mask=i < N, other=0.0)[None, :]
    return tl.where((i < N)[None, :], tl.sigmoid(z) + hc_eps, 0.0)


@triton.jit
def _post_comb(pp, cm, r, scale_ptr, base_ptr, iters, hc_eps,  # type: ignore[no-untyped-def]
               N: tl.constexpr, NP: tl.constexpr):
    """pp (row 1 = post), cm (comb logits [j, k]): [BT, NP, NP] raw -> post [BT, NP],
    comb [BT, NP, NP]."""
    a = tl.arange(0, NP)[None, :, None]
    b = tl.arange(0, NP)[None, None, :]
    i = tl.arange(0, NP)
    mix = tl.sum(tl.where(a == 1, pp, 0.0), axis=1) * r[:, None]
    post = 2 * tl.sigmoid(mix * tl.load(scale_ptr + 1)
                          + tl.load(base_ptr + N + i, mask=i < N, other=0.0)[None, :])
    ok = (a < N) & (b < N)                                                  # [1, NP, NP]
    bias = tl.load(base_ptr + 2 * N + a * N + b, mask=ok, other=0.0)
    logits = tl.where(ok, cm * r[:, None, None] * tl.load(scale_ptr + 2) + bias, float("-inf"))
    mx = tl.max(logits, axis=2)
    e = tl.exp(logits - tl.where(mx == float("-inf"), 0.0, mx)[:, :, None])  # padded rows: all 0
    den = tl.sum(e, axis=2)
    comb = tl.where(ok, e / tl.where(den == 0.0, 1.0, den)[:, :, None] + hc_eps, 0.0)
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)               # columns
    for _ in range(iters - 1):
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)           # rows
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)           # columns (ends here)
    return post, comb


@triton.jit
def _finish(x_ptr, scale_ptr, base_ptr, h_ptr, post_ptr, comb_ptr,  # type: ignore[no-untyped-def]
            pp, cm, sq, offs_t, t_mask, d_lo, d_hi, D, iters, hc_eps, norm_eps, stride_xt,
            stride_ht, write_weights, N: tl.constexpr, NP: tl.constexpr, HEAD: tl.constexpr,
            BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr):
    """Epilogue on the summed projection, post / comb stores (if write_weights), h over
    [d_lo, d_hi)."""
    r = 1.0 / tl.sqrt_rn(sq / (N * D) + norm_eps)                           # [BLOCK_T]
    pp3 = tl.reshape(pp, (BLOCK_T, NP, NP))
    pre = _pre_weights(pp3, r, scale_ptr, base_ptr, hc_eps, N, NP)
    i = tl.arange(0, NP)
    if not HEAD:
        post, comb = _post_comb(pp3, tl.reshape(cm, (BLOCK_T, NP, NP)), r, scale_ptr, base_ptr,
                                iters, hc_eps, N, NP)
        if write_weights:
            tl.store(post_ptr + offs_t[:, None] * N + i[None, :], post,
                     mask=t_mask[:, None] & (i < N)[None, :])
            jk = (i[:, None] * N + i[None, :])[None, :, :]
            ok = ((i[:, None] < N) & (i[None, :] < N))[None, :, :]
            tl.store(comb_ptr + offs_t[:, None, None] * (N * N) + jk, comb,
                     mask=t_mask[:, None, None] & ok)
    s = i[None, :, None]
    w = pre[:, :, None]                                                     # [BLOCK_T, NP, 1]
    x_row = x_ptr + offs_t[:, None, None] * stride_xt + s * D
    h_row = h_ptr + offs_t[:, None] * stride_ht
    xm = t_mask[:, None, None] & (s < N)
    for d0 in range(d_lo, d_hi, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        if EVEN_D:
            x_m, h_m = xm, t_mask[:, None]
        else:
            x_m = xm & (offs_d < d_hi)[None, None, :]
            h_m = t_mask[:, None] & (offs_d < d_hi)[None, :]
        xv = tl.load(x_row + offs_d[None, None, :], mask=x_m, other=0.0).to(tl.float32)
        h = tl.sum(w * xv, axis=1)                                          # [BLOCK_T, BLOCK_D]
        tl.store(h_row + offs_d[None, :], h.to(h_ptr.dtype.element_ty), mask=h_m)


@triton.jit
def _mhc_fused_kernel(x_ptr, fn_ptr, scale_ptr, base_ptr, h_ptr,  # type: ignore[no-untyped-def]
                      post_ptr, comb_ptr, T, D, iters, hc_eps, norm_eps, stride_xt, stride_fn,
                      stride_ht, N: tl.constexpr, NP: tl.constexpr, HEAD: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                      EVEN_K: tl.constexpr, EVEN_D: tl.constexpr, DOT: tl.constexpr,
                      INTERPRET: tl.constexpr):
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    pp, cm, sq = _project(x_ptr, fn_ptr, offs_t, t_mask, 0, N * D, stride_xt, stride_fn,
                          N, NP, HEAD, BLOCK_T, BLOCK_K, EVEN_K, DOT, INTERPRET)
    _finish(x_ptr, scale_ptr, base_ptr, h_ptr, post_ptr, comb_ptr, pp, cm, sq, offs_t, t_mask, 0,
            D, D, iters, hc_eps, norm_eps, stride_xt, stride_ht, True, N, NP, HEAD, BLOCK_T,
            BLOCK_D, EVEN_D)


@triton.jit
def _mhc_partial_kernel(x_ptr, fn_ptr, ws_ptr, sq_ptr, T, K,  # type: ignore[no-untyped-def]
                        k_per_split, stride_xt, stride_fn, N: tl.constexpr, NP: tl.constexpr,
                        HEAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                        EVEN_K: tl.constexpr, DOT: tl.constexpr, INTERPRET: tl.constexpr):
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    split = tl.program_id(1)
    k_lo = split * k_per_split
    pp, cm, sq = _project(x_ptr, fn_ptr, offs_t, t_mask, k_lo, tl.minimum(k_lo + k_per_split, K),
                          stride_xt, stride_fn, N, NP, HEAD, BLOCK_T, BLOCK_K, EVEN_K, DOT,
                          INTERPRET)
    c = tl.arange(0, NP * NP)
    row = (split * T + offs_t) * (2 * NP * NP)                              # ws [S, T, 2, NP*NP]
    tl.store(ws_ptr + row[:, None] + c[None, :], pp, mask=t_mask[:, None])
    if not HEAD:
        tl.store(ws_ptr + row[:, None] + NP * NP + c[None, :], cm, mask=t_mask[:, None])
    tl.store(sq_ptr + split * T + offs_t, sq, mask=t_mask)


@triton.jit
def _mhc_finish_kernel(x_ptr, ws_ptr, sq_ptr, scale_ptr, base_ptr,  # type: ignore[no-untyped-def]
                       h_ptr, post_ptr, comb_ptr, T, D, S, d_span, iters, hc_eps, norm_eps,
                       stride_xt, stride_ht, N: tl.constexpr, NP: tl.constexpr, HEAD: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                       EVEN_D: tl.constexpr):
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    pid_d = tl.program_id(1)
    c = tl.arange(0, NP * NP)[None, None, :]
    pp = tl.zeros([BLOCK_T, NP * NP], tl.float32)
    cm = tl.zeros([BLOCK_T, NP * NP], tl.float32)
    sq = tl.zeros([BLOCK_T], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        m = t_mask[:, None] & (offs_s < S)[None, :]                         # [BLOCK_T, BLOCK_S]
        rows = offs_s[None, :] * T + offs_t[:, None]
        part = ws_ptr + (rows * (2 * NP * NP))[:, :, None] + c
        pp += tl.sum(tl.load(part, mask=m[:, :, None], other=0.0), axis=1)
        if not HEAD:
            cm += tl.sum(tl.load(part + NP * NP, mask=m[:, :, None], other=0.0), axis=1)
        sq += tl.sum(tl.load(sq_ptr + rows, mask=m, other=0.0), axis=1)
    d_lo = pid_d * d_span
    _finish(x_ptr, scale_ptr, base_ptr, h_ptr, post_ptr, comb_ptr, pp, cm, sq, offs_t, t_mask, d_lo,
            tl.minimum(d_lo + d_span, D), D, iters, hc_eps, norm_eps, stride_xt, stride_ht,
            pid_d == 0, N, NP, HEAD, BLOCK_T, BLOCK_D, EVEN_D)


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


def plan_finish(T: int, d: int, np_: int, S: int, device: torch.device,
                invariant: bool = False) -> tuple[int, int, int, int]:
    """(block_t, d_span, block_d, block_s) of the finish launch, aiming at ~4 programs per SM.

    Small T: one token per program and d split into spans (the 24-value epilogue is redone per span:
    cheap for few tokens). Large T: whole rows, and token tiles that vectorise the epilogue (one
    Sinkhorn per token). `invariant`: one token and all of d per program at every T (the tile
    shapes fix the order of the sums over splits and streams, so they must not depend on T).
    """
    target = _FINISH_PROGRAMS_PER_SM * sms(device)
    spans = 1 if invariant else max(1, min(target // T, d // _MIN_D_SPAN))
    spans = 1 << (spans.bit_length() - 1)
    bt = 1 if T < 2 * target or invariant else min(16, 1 << ((T // target).bit_length() - 1))
    block_d = min(triton.next_power_of_2(triton.cdiv(d, spans)),
                  max(_MIN_DOT, _H_TILE // (bt * np_)))
    d_span = triton.cdiv(triton.cdiv(d, spans), block_d) * block_d
    return bt, d_span, block_d, min(triton.next_power_of_2(S), max(1, _WS_TILE // (bt * np_ * np_)))


def _check_streams(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                   rows: int, n_scale: int) -> None:
    if x.dim() != 3:
        raise ValueError(f"x must be [T, n, d]; got {list(x.shape)}")
    T, n, d = x.shape
    fp32 = (torch.float32,)
    expect("x", x, (T, n, d), X_DTYPES)
    expect("fn", fn, (rows, n * d), fp32)
    expect("scale", scale, (n_scale,), fp32)
    expect("base", base, (rows,), fp32)
    one_device(x, fn, scale, base)


def _launch_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, iters: int, hc_eps: float,
                norm_eps: float, head: bool, block_t: int | None, block_k: int, splits: int | None,
                num_warps: int, num_stages: int, invariant: bool) -> None:
    T, n, d = x.shape
    bt, S, k_per_split = plan_pre(T, n * d, x.device, block_t, block_k, splits, invariant)
    np_ = max(4, triton.next_power_of_2(n))           # NP*NP >= 16: the tl.dot minimum
    geo = {"N": n, "NP": np_, "HEAD": head}
    dot = {"DOT": "bf16x3" if x.dtype == torch.bfloat16 else "tf32x3" if x.is_cuda else "ieee",
           "INTERPRET": not x.is_cuda, "BLOCK_K": block_k, "EVEN_K": (n * d) % block_k == 0}
    if S == 1:
        bd = max(_MIN_DOT, min(triton.next_power_of_2(d), _H_TILE // (bt * np_)))
        _mhc_fused_kernel[(triton.cdiv(T, bt),)](
            x, fn, scale, base, h, post, comb, T, d, iters, hc_eps, norm_eps, x.stride(0),
            fn.stride(0), h.stride(0), BLOCK_T=bt, BLOCK_D=bd, EVEN_D=d % bd == 0, **geo, **dot,
            num_warps=num_warps, num_stages=num_stages)
        return
    ws = torch.empty(S, T, 2, np_ * np_, dtype=torch.float32, device=x.device)
    sq = torch.empty(S, T, dtype=torch.float32, device=x.device)
    _mhc_partial_kernel[(triton.cdiv(T, bt), S)](
        x, fn, ws, sq, T, n * d, k_per_split, x.stride(0), fn.stride(0), BLOCK_T=bt, **geo, **dot,
        num_warps=num_warps, num_stages=num_stages)
    bt, d_span, bd, bs = plan_finish(T, d, np_, S, x.device, invariant)
    _mhc_finish_kernel[(triton.cdiv(T, bt), triton.cdiv(d, d_span))](
        x, ws, sq, scale, base, h, post, comb, T, d, S, d_span, iters, hc_eps, norm_eps,
        x.stride(0), h.stride(0), BLOCK_T=bt, BLOCK_S=bs, BLOCK_D=bd, EVEN_D=d % bd == 0, **geo,
        num_warps=finish_warps(bt, np_, bd))


def finish_warps(block_t: int, np_: int, block_d: int) -> int:
    """Warps of a finish program: its epilogue (Sinkhorn on [BLOCK_T, NP, NP]) is a chain of
    tiny reductions whose cross-warp steps cost more than the work, so a small tile gets one warp
    (32 elements of its [BLOCK_T, NP, BLOCK_D] h tile per thread at most), larger ones 2 or 4.
    Depends on the tile shapes only (the invariant plan's are T-independent, so are its warps)."""
    per_tile = block_t * np_ * block_d
    return 1 if per_tile <= 1024 else 2 if per_tile <= 2048 else 4


def triton_mhc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                   n: int, iters: int, hc_eps: float, norm_eps: float, *,
                   block_t: int | None = None, block_k: int = 64, splits: int | None = None,
                   num_warps: int = 4, num_stages: int = 3, invariant: bool = False,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `mhc_pre`: x [T, n, d] -> (h [T, d] in x's dtype, post [T, n],
    comb [T, n, n] fp32).

    x: bf16 / fp16 / fp32; fn [(2+n)*n, n*d], scale [3], base [(2+n)*n]: fp32. All contiguous, one
    device. Keyword arguments are tuning knobs (benchmark sweeps, tests); `splits=1` forces the
    fused path, > 1 the split-K path (clipped to the number of BLOCK_K blocks). `invariant`: the
    plan comes from the shapes of one token only (`plan_pre`), so each token's outputs are the same
    bits whatever T is (what lets an RL trainer reproduce the engine's values). No host syncs: safe
    inside CUDA-graph capture.
    """
    _check_streams(x, fn, scale, base, (2 + n) * n, 3)
    if x.shape[1] != n:
        raise ValueError(f"x has {x.shape[1]} streams but n = {n}")
    T, _, d = x.shape
    h = torch.empty(T, d, dtype=x.dtype, device=x.device)
    post = torch.empty(T, n, dtype=torch.float32, device=x.device)
    comb = torch.empty(T, n, n, dtype=torch.float32, device=x.device)
    if T > 0:
        _launch_pre(x, fn, scale, base, h, post, comb, iters, hc_eps, norm_eps, False, block_t,
                    block_k, splits, num_warps, num_stages, invariant)
    return h, post, comb


def triton_mhc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                    hc_eps: float, norm_eps: float, *, block_t: int | None = None,
                    block_k: int = 64, splits: int | None = None, num_warps: int = 4,
                    num_stages: int = 3, invariant: bool = False) -> torch.Tensor:
    """Same contract as `mhc_head`: x [T, n, d] -> y [T, d] in x's dtype; fn [n, n*d], scale [1],
    base [n] fp32.

    The pre kernels with HEAD=True (n projection rows, no post / comb); knobs (and `invariant`) as
    in `triton_mhc_pre`.
    """
    _check_streams(x, fn, scale, base, x.shape[1] if x.dim() == 3 else -1, 1)
    T, _, d = x.shape
    y = torch.empty(T, d, dtype=x.dtype, device=x.device)
    # NOTE: post / comb pointers are never dereferenced with HEAD=True; y stands in for them
    if T > 0:
        _launch_pre(x, fn, scale, base, y, y, y, 1, hc_eps, norm_eps, True, block_t, block_k,
                    splits, num_warps, num_stages, invariant)
    return y
