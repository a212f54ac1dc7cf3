"""Fused mHC post step (spec §5) in Triton: X'[k] = post[k] f + Σ_j comb[j, k] X[j] per token.

Owns `triton_mhc_post`, the fast form of `kernels/ref/mhc.py::mhc_post` (same signature, same
semantics), and its default chunking. The pre and head steps live in `mhc.py`, the shared input
checks in `launch.py`.

Kernel design: grid (T, cdiv(d, BLOCK_D)); one pass: each program reads x [n, BLOCK_D] and
f [BLOCK_D] once and writes x' [n, BLOCK_D] once, mixing the n streams in fp32 registers.
Invariants: x contiguous [T, n, d]; padded streams (NP > n) carry weight 0 and are never stored.
No host syncs: CUDA-graph safe.

Test: tests/kernels/test_mhc_triton.py. Benchmark: benchmarks/kernels/bench_mhc.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels.triton.launch import X_DTYPES, expect, one_device, pow2, sms
from dsv4.kernels.triton.pdl import pdl_args
from dsv4.kernels.triton.pdl_enter import pdl_enter


@triton.jit
def post_mix(f_ptr, x_ptr, post_ptr, comb_ptr, t, offs_d,  # type: ignore[no-untyped-def]
             d_ok, D, stride_ft, N: tl.constexpr, NP: tl.constexpr, BLOCK_D: tl.constexpr,
             EVEN_D: tl.constexpr):
    """Token t's X'[k, offs_d] = post[k] f + Σ_j comb[j, k] X[j] in fp32, [NP, BLOCK_D] (rows
    k >= N are 0). Shared with `mhc_post_pre.py`'s kernel, so both store the same bits."""
    k = tl.arange(0, NP)
    mixed = tl.zeros([NP, BLOCK_D], tl.float32)
    for j in tl.static_range(N):
        if EVEN_D:
            xj = tl.load(x_ptr + (t * N + j) * D + offs_d)
        else:
            xj = tl.load(x_ptr + (t * N + j) * D + offs_d, mask=d_ok, other=0.0)
        cj = tl.load(comb_ptr + t * N * N + j * N + k, mask=k < N, other=0.0)  # comb[t, j, :]
        mixed += cj[:, None] * xj.to(tl.float32)[None, :]
    if EVEN_D:
        f = tl.load(f_ptr + t * stride_ft + offs_d).to(tl.float32)              # [BLOCK_D]
    else:
        f = tl.load(f_ptr + t * stride_ft + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t * N + k, mask=k < N, other=0.0)
    return post[:, None] * f[None, :] + mixed


@triton.jit
def _mhc_post_kernel(f_ptr, x_ptr, post_ptr, comb_ptr, out_ptr, D,  # type: ignore[no-untyped-def]
                     stride_ft, N: tl.constexpr, NP: tl.constexpr, BLOCK_D: tl.constexpr,
                     EVEN_D: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    k = tl.arange(0, NP)
    d_ok = offs_d < D
    out = post_mix(f_ptr, x_ptr, post_ptr, comb_ptr, t, offs_d, d_ok, D, stride_ft, N, NP,
                   BLOCK_D, EVEN_D)                                         # [NP, BLOCK_D]
    tl.store(out_ptr + (t * N + k[:, None]) * D + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(k < N)[:, None] & d_ok[None, :])


def default_post_block_d(T: int, d: int, device: torch.device) -> int:
    """Widest d chunk (<= 1024: 16-byte bf16 loads at 4 warps) that still gives >= 2 programs per
    SM."""
    bd = min(1024, triton.next_power_of_2(d))
    while bd > 256 and T * triton.cdiv(d, bd) < 2 * sms(device):
        bd //= 2
    return bd


def check_post(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> None:
    """The post step's input contract (`triton_mhc_post`); raises ValueError naming the field."""
    if x.dim() != 3:
        raise ValueError(f"x must be [T, n, d]; got {list(x.shape)}")
    T, n, d = x.shape
    expect("x", x, (T, n, d), X_DTYPES)
    expect("post", post, (T, n), (torch.float32,))
    expect("comb", comb, (T, n, n), (torch.float32,))
    if tuple(f.shape) != (T, d) or f.dtype not in X_DTYPES or (T > 0 and f.stride(1) != 1):
        raise ValueError(f"f must be [{T}, {d}] of {X_DTYPES} with unit stride in d; "
                         f"got {list(f.shape)} {f.dtype} strides {f.stride()}")
    one_device(f, x, post, comb)


def triton_mhc_post(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, *,
                    block_d: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """Same contract as `mhc_post`: X'[k] = post[k] f + Σ_j comb[j, k] X[j] -> [T, n, d] in x's
    dtype.

    f: [T, d] (unit stride in d; any row stride), bf16 / fp16 / fp32; x: [T, n, d] contiguous;
    post [T, n], comb [T, n, n] contiguous fp32. One pass: x and f read once, x' written once.
    Graph-capture safe.
    """
    check_post(f, x, post, comb)
    T, n, d = x.shape
    out = torch.empty_like(x)
    if T == 0:
        return out
    bd = pow2("block_d", block_d or default_post_block_d(T, d, x.device), 1)
    _mhc_post_kernel[(T, triton.cdiv(d, bd))](
        f, x, post, comb, out, d, f.stride(0), N=n, NP=triton.next_power_of_2(n), BLOCK_D=bd,
        EVEN_D=d % bd == 0, num_warps=num_warps or max(1, min(8, bd // 256)), **pdl_args(f.device))
    return out
