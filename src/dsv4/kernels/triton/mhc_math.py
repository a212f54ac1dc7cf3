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
def pre_weights(pp, r, scale_ptr, base_ptr, hc_eps,  # type: ignore[no-untyped-def]
                N: tl.constexpr, NP: tl.constexpr):
    """pp: [BT, NP, NP] raw projection (row 0 = pre), r: [BT] -> pre [BT, NP], 0 in padded
    streams."""
    a = tl.arange(0, NP)[None, :, None]
    i = tl.arange(0, NP)
    mix = tl.sum(tl.where(a == 0, pp, 0.0), axis=1) * r[:, None]
    z = mix * tl.load(scale_ptr) + tl.load(base_ptr + i, mask=i < N, other=0.0)[None, :]
    return tl.where((i < N)[None, :], tl.sigmoid(z) + hc_eps, 0.0)


@triton.jit
def post_comb(pp, cm, r, scale_ptr, base_ptr, iters, hc_eps,  # type: ignore[no-untyped-def]
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
def finish(x_ptr, scale_ptr, base_ptr, h_ptr, post_ptr, comb_ptr,  # type: ignore[no-untyped-def]
           pp, cm, sq, offs_t, t_mask, d_lo, d_hi, D, iters, hc_eps, norm_eps, stride_xt,
           stride_ht, write_weights, N: tl.constexpr, NP: tl.constexpr, HEAD: tl.constexpr,
           BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr):
    """Epilogue on the summed projection, post / comb stores (if write_weights), h over
    [d_lo, d_hi)."""
    r = 1.0 / tl.sqrt_rn(sq / (N * D) + norm_eps)                           # [BLOCK_T]
    pp3 = tl.reshape(pp, (BLOCK_T, NP, NP))
    pre = pre_weights(pp3, r, scale_ptr, base_ptr, hc_eps, N, NP)
    i = tl.arange(0, NP)
    if not HEAD:
        post, comb = post_comb(pp3, tl.reshape(cm, (BLOCK_T, NP, NP)), r, scale_ptr, base_ptr,
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
def sum_partials(ws_ptr, sq_ptr, offs_t, t_mask, T, S,  # type: ignore[no-untyped-def]
                  NP: tl.constexpr, HEAD: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_S: tl.constexpr, CACHE: tl.constexpr):
    """Σ over the S splits of ws [S, T, 2, NP*NP] and sq [S, T] for tokens offs_t, in chunks of
    BLOCK_S splits (chunk sums in split order). CACHE: the loads' cache modifier (".cg" when other
    programs of the same launch wrote the partials)."""
    c = tl.arange(0, NP * NP)[None, None, :]
    pp = tl.zeros([BLOCK_T, NP * NP], tl.float32)
    cm = tl.zeros([BLOCK_T, NP * NP], tl.float32)
    sq = tl.zeros([BLOCK_T], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        m = t_mask[:, None] & (offs_s < S)[None, :]                         # [BLOCK_T, BLOCK_S]
        rows = offs_s[None, :] * T + offs_t[:, None]
        part = ws_ptr + (rows * (2 * NP * NP))[:, :, None] + c
        pp += tl.sum(tl.load(part, mask=m[:, :, None], other=0.0, cache_modifier=CACHE), axis=1)
        if not HEAD:
            cm += tl.sum(tl.load(part + NP * NP, mask=m[:, :, None], other=0.0,
                                 cache_modifier=CACHE), axis=1)
        sq += tl.sum(tl.load(sq_ptr + rows, mask=m, other=0.0, cache_modifier=CACHE), axis=1)
    return pp, cm, sq
