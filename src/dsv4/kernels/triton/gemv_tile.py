"""The skinny GEMM's tile pieces (`gemv.py`), shared with the FP8 linear (`fp8_linear.py`):
a weight block's load, the FMA path's products of one block with each x row, and the store of a
y^T tile with the in-launch split-K reduction (the module docstring of `gemv.py` states the
counter contract)."""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4.kernels.triton.swiglu import swiglu_f32


@triton.jit
def w_block(w_ptrs, k0, offs_k, K, EVEN_K: tl.constexpr):  # type: ignore[no-untyped-def]
    """The [BLOCK_N, BLOCK_K] weight block at k0 (a K tail masked to zero)."""
    if EVEN_K:
        wt = tl.load(w_ptrs + k0)
    else:
        wt = tl.load(w_ptrs + k0, mask=(k0 + offs_k < K)[None, :], other=0.0)
    return wt


@triton.jit
def fma_block(acc, wt, k0, offs_k, x_ptr, u_ptr, K, stride_xm,  # type: ignore[no-untyped-def]
               stride_um, limit, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
               EVEN_K: tl.constexpr, SWIGLU: tl.constexpr, LIBDEVICE: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] plus the FMA products of weight block wt (at k0) with each x row
    (unrolled; 2-D tiles, in-warp sums)."""
    k_ok = k0 + offs_k < K                                     # used only if not EVEN_K
    cols_m = tl.arange(0, BLOCK_M)[None, :]
    wf = wt.to(tl.float32)
    for m in tl.static_range(ROWS):
        if EVEN_K:
            xm = tl.load(x_ptr + m * stride_xm + k0 + offs_k)
        else:
            xm = tl.load(x_ptr + m * stride_xm + k0 + offs_k, mask=k_ok, other=0.0)
        xf = xm.to(tl.float32)
        if SWIGLU:                      # x is the gate; h = swiglu(gate, up), rounded
            if EVEN_K:
                um = tl.load(u_ptr + m * stride_um + k0 + offs_k)
            else:
                um = tl.load(u_ptr + m * stride_um + k0 + offs_k, mask=k_ok, other=0.0)
            dtype = x_ptr.dtype.element_ty
            xf = swiglu_f32(xf, um.to(tl.float32), limit, dtype, LIBDEVICE)
            xf = xf.to(dtype).to(tl.float32)
        part = tl.sum(wf * xf[None, :], axis=1)
        acc += tl.where(cols_m == m, part[:, None], 0.0)
    return acc


@triton.jit
def store_tile(acc, y_ptr, part_ptr, cnt_ptr, counter, split, M, N,  # type: ignore[no-untyped-def]
               offs_m, offs_n, SPLIT_K: tl.constexpr):
    """Store the y^T tile `acc` [BLOCK_N, BLOCK_M] (fp32) at rows offs_m, columns offs_n of y
    [M, N]: at once without a K split; else as split `split`'s partial into part [SPLIT_K, M, N],
    and the tile's last arrival on counter `counter` sums the partials in split order, stores y
    and resets the counter to zero (module docstring). Shared with `fp8_linear.py`."""
    out = tl.trans(acc)                                         # [BLOCK_M, BLOCK_N]
    out_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    out_offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptr + out_offs, out.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        plane = M.to(tl.int64) * N                               # one split's [M, N] partial
        tl.store(part_ptr + split * plane + out_offs, out, mask=out_mask)
        tl.debug_barrier()          # every thread's partial stores precede the release below
        done = tl.atomic_add(cnt_ptr + counter, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT_K - 1:     # the tile's last arrival: sum the partials in split order
            total = tl.load(part_ptr + out_offs, mask=out_mask, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                total += tl.load(part_ptr + s * plane + out_offs, mask=out_mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(y_ptr + out_offs, total.to(y_ptr.dtype.element_ty), mask=out_mask)
            tl.store(cnt_ptr + counter, 0)                       # zero for the next call
