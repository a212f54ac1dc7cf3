"""Device functions of the mHC pre / head kernels (`mhc.py`, `mhc_split.py`): the projection,
the epilogue (r, sigmoids, softmax + Sinkhorn) and the weighted stream sum h.

Shared by the fused kernel, the split-K partial / finish kernels and the one-launch kernel, so
every path runs the same code on the same tile shapes (the module docstring of `mhc.py` has the
math, the operand layout and the precision argument). `sum_partials` is the split-K reduction
over the workspace: the finish launch and the one-launch tail call it with the same tiles, so both
sum the partials in the same order.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mix_dot(xt, w, acc, DOT: tl.constexpr,  # type: ignore[no-untyped-def]
            INTERPRET: tl.constexpr):
    """acc + xt @ w in fp32: bf16x3 pieces for bf16 xt, else tl.dot at `DOT` precision."""
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
def operand_rows(N: tl.constexpr, NP: tl.constexpr,  # type: ignore[no-untyped-def]
                 HEAD: tl.constexpr):
    """The fn row of each column c = a*NP + b of the two [NP, NP] operands and whether it is one
    (`mhc.py`'s operand layout): pre / post operand rows b (a = 0) and n + b (a = 1; not for
    HEAD), comb operand rows 2n + a*n + b; columns past n are zero. The projection and the post +
    project kernel (`mhc_post_pre.py`) both read fn through it."""
    c = tl.arange(0, NP * NP)
    a, b = c // NP, c % NP
    if HEAD:
        pp_ok = (a == 0) & (b < N)
    else:
        pp_ok = (a < 2) & (b < N)
    return a * N + b, pp_ok, 2 * N + a * N + b, (a < N) & (b < N)


@triton.jit
def project(x_ptr, fn_ptr, offs_t, t_mask, k_lo, k_hi,  # type: ignore[no-untyped-def]
            stride_xt, stride_fn, N: tl.constexpr, NP: tl.constexpr, HEAD: tl.constexpr,
            BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
            DOT: tl.constexpr, INTERPRET: tl.constexpr):
    """Σ over k in [k_lo, k_hi) of x̂[t, k] fn[row, k] for both operands, and Σ x̂[t, k]²."""
    pp_row, pp_ok, cm_row, cm_ok = operand_rows(N, NP, HEAD)
    pp_ptr = fn_ptr + pp_row[None, :] * stride_fn
    cm_ptr = fn_ptr + cm_row[None, :] * stride_fn
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
        acc_pp = mix_dot(xt, w, acc_pp, DOT, INTERPRET)
        if not HEAD:
            w = tl.load(cm_ptr + offs_k[:, None], mask=cm_m, other=0.0)
            acc_cm = mix_dot(xt, w, acc_cm, DOT, INTERPRET)
    return acc_pp, acc_cm, sq


@triton.jit
def pre_params(scale_ptr, base_ptr, N: tl.constexpr,  # type: ignore[no-untyped-def]
               NP: tl.constexpr):
    """The pre weights' scale and base [NP] (0 past N). Loaded apart from their use, so a
    kernel can issue them before its projection sums."""
    i = tl.arange(0, NP)
    return tl.load(scale_ptr), tl.load(base_ptr + i, mask=i < N, other=0.0)


@triton.jit
def comb_params(scale_ptr, base_ptr, N: tl.constexpr,  # type: ignore[no-untyped-def]
                NP: tl.constexpr):
    """post's and comb's scales, post's base [NP] and comb's bias [1, NP, NP] (0 outside N)."""
    a = tl.arange(0, NP)[None, :, None]
    b = tl.arange(0, NP)[None, None, :]
    i = tl.arange(0, NP)
    bias = tl.load(base_ptr + 2 * N + a * N + b, mask=(a < N) & (b < N), other=0.0)
    return (tl.load(scale_ptr + 1), tl.load(scale_ptr + 2),
            tl.load(base_ptr + N + i, mask=i < N, other=0.0), bias)


@triton.jit
def pre_weights(pp, r, scale, base, hc_eps,  # type: ignore[no-untyped-def]
                N: tl.constexpr, NP: tl.constexpr):
    """pp: [BT, NP, NP] raw projection (row 0 = pre), r: [BT], (scale, base) `pre_params` ->
    pre [BT, NP], 0 in padded streams."""
    a = tl.arange(0, NP)[None, :, None]
    i = tl.arange(0, NP)
    mix = tl.sum(tl.where(a == 0, pp, 0.0), axis=1) * r[:, None]
    z = mix * scale + base[None, :]
    return tl.where((i < N)[None, :], tl.sigmoid(z) + hc_eps, 0.0)


@triton.jit
def post_comb(pp, cm, r, params, iters, hc_eps,  # type: ignore[no-untyped-def]
              N: tl.constexpr, NP: tl.constexpr):
    """pp (row 1 = post), cm (comb logits [j, k]): [BT, NP, NP] raw, params `comb_params` ->
    post [BT, NP], comb [BT, NP, NP]."""
    scale_post, scale_comb, base_post, bias = params
    a = tl.arange(0, NP)[None, :, None]
    b = tl.arange(0, NP)[None, None, :]
    mix = tl.sum(tl.where(a == 1, pp, 0.0), axis=1) * r[:, None]
    post = 2 * tl.sigmoid(mix * scale_post + base_post[None, :])
    ok = (a < N) & (b < N)                                                  # [1, NP, NP]
    logits = tl.where(ok, cm * r[:, None, None] * scale_comb + bias, float("-inf"))
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
def inv_rms(sq, norm_eps, D, N: tl.constexpr):  # type: ignore[no-untyped-def]
    """r = 1 / rms(x̂) per token from Σ x̂² over the N * D values: [BLOCK_T]."""
    return 1.0 / tl.sqrt_rn(sq / (N * D) + norm_eps)


@triton.jit
def store_weights(pp, cm, r, params, post_ptr, comb_ptr,  # type: ignore[no-untyped-def]
                  offs_t, t_mask, iters, hc_eps, N: tl.constexpr, NP: tl.constexpr,
                  BLOCK_T: tl.constexpr):
    """post [T, N] and comb [T, N, N] of tokens offs_t from the summed projection (pp, cm:
    [BLOCK_T, NP*NP]), r and `comb_params`."""
    i = tl.arange(0, NP)
    post, comb = post_comb(tl.reshape(pp, (BLOCK_T, NP, NP)), tl.reshape(cm, (BLOCK_T, NP, NP)),
                           r, params, iters, hc_eps, N, NP)
    tl.store(post_ptr + offs_t[:, None] * N + i[None, :], post,
             mask=t_mask[:, None] & (i < N)[None, :])
    jk = (i[:, None] * N + i[None, :])[None, :, :]
    ok = ((i[:, None] < N) & (i[None, :] < N))[None, :, :]
    tl.store(comb_ptr + offs_t[:, None, None] * (N * N) + jk, comb,
             mask=t_mask[:, None, None] & ok)


@triton.jit
def load_streams(x_ptr, offs_t, t_mask, d0, d_hi, D,  # type: ignore[no-untyped-def]
                 stride_xt, N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr):
    """The N streams' x[t, s, d] for d in [d0, d0 + BLOCK_D), each [BLOCK_T, BLOCK_D] in x's
    dtype (0 in padded tokens and past d_hi): a tuple, one 2-D tile per stream, so that holding
    them (the finish issues them before its partials) keeps the loads' own layout."""
    offs_d = d0 + tl.arange(0, BLOCK_D)
    m = t_mask[:, None]
    if not EVEN_D:
        m = m & (offs_d < d_hi)[None, :]
    row = x_ptr + offs_t[:, None] * stride_xt + offs_d[None, :]
    xs = ()
    for s in tl.static_range(N):
        xs = xs + (tl.load(row + s * D, mask=m, other=0.0),)  # type: ignore[assignment]
    return xs


@triton.jit
def store_h(h_ptr, pre, xs, offs_t, t_mask, d0, d_hi,  # type: ignore[no-untyped-def]
            stride_ht, N: tl.constexpr, NP: tl.constexpr, BLOCK_D: tl.constexpr,
            EVEN_D: tl.constexpr):
    """h[t, d] = Σ_s pre[t, s] x[t, s, d] in fp32, streams in order, for the tiles xs
    (`load_streams` at d0); stored in h's dtype.

    With one token per tile the stream weights are scalars: a [BLOCK_T] weight sliced from
    pre's layout (a slice of the partial-sum tiles') would be converted to the x tiles' layout
    at every multiply, and LLVM / ptxas take minutes on that code for large BLOCK_D x BLOCK_S
    tiles. The value is the same either way (one non-zero term per sum)."""
    i = tl.arange(0, NP)[None, :]
    h = tl.zeros([xs[0].shape[0], BLOCK_D], tl.float32)
    for s in tl.static_range(N):
        if xs[0].shape[0] == 1:
            w1 = tl.sum(tl.sum(tl.where(i == s, pre, 0.0), axis=1), axis=0)   # scalar
            h += w1 * xs[s].to(tl.float32)
        else:
            w = tl.sum(tl.where(i == s, pre, 0.0), axis=1)                  # [BLOCK_T]
            h += w[:, None] * xs[s].to(tl.float32)
    offs_d = d0 + tl.arange(0, BLOCK_D)
    m = t_mask[:, None]
    if not EVEN_D:
        m = m & (offs_d < d_hi)[None, :]
    tl.store(h_ptr + offs_t[:, None] * stride_ht + offs_d[None, :],
             h.to(h_ptr.dtype.element_ty), mask=m)


@triton.jit
def finish(x_ptr, scale_ptr, base_ptr, h_ptr, post_ptr, comb_ptr,  # type: ignore[no-untyped-def]
           pp, cm, sq, offs_t, t_mask, d_lo, d_hi, D, iters, hc_eps, norm_eps, stride_xt,
           stride_ht, write_weights, N: tl.constexpr, NP: tl.constexpr, HEAD: tl.constexpr,
           BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr):
    """Epilogue on the summed projection, post / comb stores (if write_weights and not HEAD), h
    over [d_lo, d_hi)."""
    r = inv_rms(sq, norm_eps, D, N)                                         # [BLOCK_T]
    scale, base = pre_params(scale_ptr, base_ptr, N, NP)
    pre = pre_weights(tl.reshape(pp, (BLOCK_T, NP, NP)), r, scale, base, hc_eps, N, NP)
    if not HEAD:
        if write_weights:
            store_weights(pp, cm, r, comb_params(scale_ptr, base_ptr, N, NP), post_ptr, comb_ptr,
                          offs_t, t_mask, iters, hc_eps, N, NP, BLOCK_T)
    for d0 in range(d_lo, d_hi, BLOCK_D):
        xs = load_streams(x_ptr, offs_t, t_mask, d0, d_hi, D, stride_xt, N, BLOCK_D, EVEN_D)
        store_h(h_ptr, pre, xs, offs_t, t_mask, d0, d_hi, stride_ht, N, NP, BLOCK_D, EVEN_D)


@triton.jit
def _chunk(ws_ptr, sq_ptr, offs_t, t_mask, T, S, s0,  # type: ignore[no-untyped-def]
           NP: tl.constexpr, HEAD: tl.constexpr, BLOCK_S: tl.constexpr, CACHE: tl.constexpr):
    """The partials of splits [s0, s0 + BLOCK_S) (0 past S): pp, cm [BLOCK_T, BLOCK_S, NP*NP]
    (cm 0 for HEAD) and sq [BLOCK_T, BLOCK_S]."""
    c = tl.arange(0, NP * NP)[None, None, :]
    offs_s = s0 + tl.arange(0, BLOCK_S)
    m = t_mask[:, None] & (offs_s < S)[None, :]                             # [BLOCK_T, BLOCK_S]
    rows = offs_s[None, :] * T + offs_t[:, None]
    part = ws_ptr + (rows * (2 * NP * NP))[:, :, None] + c
    pp = tl.load(part, mask=m[:, :, None], other=0.0, cache_modifier=CACHE)
    cm = tl.zeros_like(pp)
    if not HEAD:
        cm = tl.load(part + NP * NP, mask=m[:, :, None], other=0.0, cache_modifier=CACHE)
    return pp, cm, tl.load(sq_ptr + rows, mask=m, other=0.0, cache_modifier=CACHE)


@triton.jit
def sum_partials(ws_ptr, sq_ptr, offs_t, t_mask, T, S,  # type: ignore[no-untyped-def]
                  NP: tl.constexpr, HEAD: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_S: tl.constexpr, CACHE: tl.constexpr):
    """Σ over the S splits of ws [S, T, 2, NP*NP] and sq [S, T] for tokens offs_t, in chunks of
    BLOCK_S splits (chunk sums in split order). Two chunks' loads are issued before either is
    summed (one memory round trip per two chunks; the same adds in the same order). CACHE: the
    loads' cache modifier (".cg" when other programs of the same launch wrote the partials)."""
    pp = tl.zeros([BLOCK_T, NP * NP], tl.float32)
    cm = tl.zeros([BLOCK_T, NP * NP], tl.float32)
    sq = tl.zeros([BLOCK_T], tl.float32)
    for s0 in range(0, S, 2 * BLOCK_S):
        pp0, cm0, sq0 = _chunk(ws_ptr, sq_ptr, offs_t, t_mask, T, S, s0, NP, HEAD, BLOCK_S, CACHE)
        pp1, cm1, sq1 = _chunk(ws_ptr, sq_ptr, offs_t, t_mask, T, S, s0 + BLOCK_S, NP, HEAD,
                               BLOCK_S, CACHE)
        pp += tl.sum(pp0, axis=1)
        if not HEAD:
            cm += tl.sum(cm0, axis=1)
        sq += tl.sum(sq0, axis=1)
        if s0 + BLOCK_S < S:             # (an empty second chunk adds nothing: no +0 either)
            pp += tl.sum(pp1, axis=1)
            if not HEAD:
                cm += tl.sum(cm1, axis=1)
            sq += tl.sum(sq1, axis=1)
    return pp, cm, sq
