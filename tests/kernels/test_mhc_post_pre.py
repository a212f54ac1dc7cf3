"""Parity of `triton_mhc_post_pre` (a post step fused with the next site's pre projection,
`kernels/triton/mhc_post_pre.py`) with the reference `mhc_post_pre` (post, then pre).

CPU: small shapes under the Triton interpreter: n = 4 and 3 (padded stream tiles), d in {64, 256}
and 40 (a partial d slice), T in {1, 3, 8} fused by default and T = 9 forced, several BLOCK_D;
fp32 x to 1e-5 relative per output (as test_mhc_triton.py), bf16 x to 2e-2 against the reference
chain (two bf16 roundings) and to the pre's own bounds against the reference pre on the kernel's
X'; the fused X' is the bits of `triton_mhc_post`; above `POST_PRE_MAX_T` and under `invariant`
the op is exactly the unfused post then pre; input validation.
GPU (`-m gpu`): V4-Flash shapes (n = 4, d = 4096, bf16), T in {1, 2, 8}, eagerly and through a
CUDA graph.
"""

from __future__ import annotations

import os

import torch

# NOTE: must precede the first `import triton` (tests/kernels/conftest.py may already do this).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from tests.kernels.test_mhc_triton import (  # noqa: E402
    BF16_REL,
    DEVICE,
    FP32_REL,
    HC_EPS,
    NORM_EPS,
    assert_close,
    make_params,
    make_x,
)

from dsv4.kernels.ref.mhc import mhc_post_pre, mhc_pre  # noqa: E402
from dsv4.kernels.triton.mhc import triton_mhc_pre  # noqa: E402
from dsv4.kernels.triton.mhc_post import triton_mhc_post  # noqa: E402
from dsv4.kernels.triton.mhc_post_pre import (  # noqa: E402
    POST_PRE_MAX_T,
    plan_post_pre,
    triton_mhc_post_pre,
)

ITERS = 20
Case = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]


def make_case(T: int, n: int, d: int, dtype: torch.dtype, seed: int,
              device: str = DEVICE) -> Case:
    """Streams x, a block output f, the previous site's post / comb, and the next site's params."""
    x = make_x(T, n, d, dtype, seed, device)
    g = torch.Generator(device).manual_seed(seed + 7)
    f = torch.randn(T, d, generator=g, device=device).to(dtype)
    rows = (2 + n) * n
    _, post, comb = mhc_pre(x, *make_params(n, d, rows, 3, seed, device), n, ITERS, HC_EPS,
                            NORM_EPS)
    return f, x, post, comb, make_params(n, d, rows, 3, seed + 1, device)


def check(case: Case, n: int, **knobs: int | bool) -> None:
    """Against the reference chain at the mHC tolerances; the pre part also against the reference
    pre on the kernel's own X' at fp32 accuracy (a bf16 X' a rounding away from the reference's
    moves the projection by more than the kernel's own error)."""
    f, x, post, comb, params = case
    got = triton_mhc_post_pre(f, x, post, comb, *params, n, ITERS, HC_EPS, NORM_EPS, **knobs)
    want = mhc_post_pre(f, x, post, comb, *params, n, ITERS, HC_EPS, NORM_EPS)
    rel = FP32_REL if x.dtype == torch.float32 else BF16_REL
    assert torch.equal(got[0], triton_mhc_post(f, x, post, comb)), "X' is the post kernel's"
    # two bf16 roundings in a row (X', then h from weights that moved with X'): twice the bound
    chain = FP32_REL if x.dtype == torch.float32 else 2 * BF16_REL
    for name, a, b in zip(("x'", "h", "post", "comb"), got, want, strict=True):
        assert_close(a, b, chain, name)
    own = mhc_pre(got[0], *params, n, ITERS, HC_EPS, NORM_EPS)
    assert_close(got[1], own[0], rel, "h on the kernel's X'")
    assert_close(got[2], own[1], FP32_REL, "post on the kernel's X'")
    assert_close(got[3], own[2], FP32_REL, "comb on the kernel's X'")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("d,T", [pytest.param(d, T, id=f"d{d}-T{T}")
                                 for d, T in ((64, 1), (64, 3), (256, 8), (40, 2))])
def test_fused(d: int, T: int, dtype: torch.dtype) -> None:
    check(make_case(T, 4, d, dtype, d + T), 4)


@pytest.mark.parametrize("block_d", [16, 32, 128])
def test_block_d_and_padded_streams(block_d: int) -> None:
    check(make_case(2, 3, 64, torch.float32, block_d), 3, block_d=block_d)
    check(make_case(9, 4, 64, torch.bfloat16, block_d), 4, block_d=block_d, fuse=True)


@pytest.mark.parametrize("T,d", [(1, 512), (3, 256)], ids=["T1-d512", "T3-d256"])
def test_weights_apart_same_bits(T: int, d: int) -> None:
    """The finish with its post / comb programs apart (`mhc_split.plan_apart`; the plan's at
    decode) writes the bits of the finish without them."""
    f, x, post, comb, params = make_case(T, 4, d, torch.bfloat16, d)
    args = (f, x, post, comb, *params, 4, ITERS, HC_EPS, NORM_EPS)
    apart = triton_mhc_post_pre(*args, fuse=True, block_d=128, weights_apart=True)
    together = triton_mhc_post_pre(*args, fuse=True, block_d=128, weights_apart=False)
    for name, a, b in zip(("x'", "h", "post", "comb"), apart, together, strict=True):
        assert torch.equal(a, b), name


def test_unfused_above_the_limit_and_invariant() -> None:
    """Past POST_PRE_MAX_T tokens (and under `invariant`) the op is the post then the pre."""
    for T, knobs in ((POST_PRE_MAX_T + 1, {}), (2, {"invariant": True}), (2, {"fuse": False})):
        f, x, post, comb, params = make_case(T, 4, 64, torch.float32, T)
        got = triton_mhc_post_pre(f, x, post, comb, *params, 4, ITERS, HC_EPS, NORM_EPS, **knobs)
        new = triton_mhc_post(f, x, post, comb)
        want = (new, *triton_mhc_pre(new, *params, 4, ITERS, HC_EPS, NORM_EPS,
                                     invariant=bool(knobs.get("invariant"))))
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), knobs


def test_plan_and_validation() -> None:
    assert (plan_post_pre(1, 4096), plan_post_pre(2, 4096), plan_post_pre(8, 64)) == (32, 128, 64)
    f, x, post, comb, params = make_case(2, 4, 64, torch.float32, 0)
    with pytest.raises(ValueError, match="fuse=True with invariant=True"):
        triton_mhc_post_pre(f, x, post, comb, *params, 4, ITERS, HC_EPS, NORM_EPS, fuse=True,
                            invariant=True)
    with pytest.raises(ValueError, match="block_d must be a power of two >= 16; got 24"):
        triton_mhc_post_pre(f, x, post, comb, *params, 4, ITERS, HC_EPS, NORM_EPS, block_d=24)
    with pytest.raises(ValueError, match=r"fn must be \[24, 256\]"):
        triton_mhc_post_pre(f, x, post, comb, params[0][:, :128], *params[1:], 4, ITERS, HC_EPS,
                            NORM_EPS)
    with pytest.raises(ValueError, match=r"f must be \[2, 64\]"):
        triton_mhc_post_pre(f[:, :32], x, post, comb, *params, 4, ITERS, HC_EPS, NORM_EPS)
    empty = triton_mhc_post_pre(f[:0], x[:0], post[:0], comb[:0], *params, 4, ITERS, HC_EPS,
                                NORM_EPS)
    assert [tuple(t.shape) for t in empty] == [(0, 4, 64), (0, 64), (0, 4), (0, 4, 4)]


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 8])
def test_flash_cuda(T: int) -> None:
    case = make_case(T, 4, 4096, torch.bfloat16, T, "cuda")
    check(case, 4)
    f, x, post, comb, params = case
    eager = triton_mhc_post_pre(f, x, post, comb, *params, 4, ITERS, HC_EPS, NORM_EPS)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_mhc_post_pre(f, x, post, comb, *params, 4, ITERS, HC_EPS, NORM_EPS)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(out, eager, strict=True))
