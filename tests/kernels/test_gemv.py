"""Parity of `triton_linear` (kernels/triton/gemv.py) with `F.linear`, determinism, validation.

Reference: y_ref = x @ w.T in float64 (F.linear of the upcast operands). Tolerance, with
scale = max |y_ref|: fp32 outputs within 2e-6 * scale (fp32 accumulation in another order);
bf16 / fp16 outputs element-wise within half an output ulp of y_ref (2^-8 |y_ref| for bf16,
2^-11 for fp16: the final rounding) + 2e-6 * scale (the fp32 sum under it).

CPU: the interpreter on small shapes: M in {1, 3, 17}, N and K not multiples of the blocks, bf16
and fp32 (and mixed / fp16 operands), the FMA and tl.dot inner products, split-K off and on
(the last-arrival reduction, its counters left zero), row-strided x and w; two calls bit-equal;
empty shapes; shape / dtype / knob errors naming the argument; the host plan at H200 shapes.
The interpreter's fp32 -> bf16 cast truncates; the tests patch it to round to nearest even, as the
GPU does.
GPU (`-m gpu`): the decode projections' shapes at M = 1, 8, 32 inside a CUDA graph (replays
bit-equal to eager, new inputs replayed), against the float64 reference.

    PYTHONPATH=src python -m pytest -q tests/kernels/test_gemv.py
"""

from __future__ import annotations

import os

import torch

# NOTE: must precede the first `import triton` (tests/kernels/conftest.py may already do this).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from dsv4.kernels.triton import gemv  # noqa: E402
from dsv4.kernels.triton.gemv import (  # noqa: E402
    MAX_M,
    GemvCounters,
    plan_gemv,
    triton_linear,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16, F32 = torch.bfloat16, torch.float32
HALF_ULP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 0.0}
# (N, K, dtype) of the decode projections (benchmarks/decode_gemms.py)
REAL_SHAPES = [(1024, 4096, BF16), (1536, 4096, BF16), (4096, 4096, BF16), (4096, 2048, BF16),
               (8192, 1024, BF16), (4096, 8192, BF16), (32768, 1024, BF16), (64, 4096, BF16),
               (2560, 4096, F32), (256, 4096, F32)]


pytestmark = pytest.mark.usefixtures("round_bf16_to_nearest_even")


def operands(M: int, N: int, K: int, x_dtype: torch.dtype, w_dtype: torch.dtype | None = None,
             seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(x_dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(w_dtype or x_dtype)
    return x.to(DEVICE), w.to(DEVICE)


def assert_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y against x @ w.T in float64, within the module docstring's tolerance."""
    ref = F.linear(x.double(), w.double())
    assert y.shape == ref.shape and y.dtype == x.dtype and y.is_contiguous()
    scale = float(ref.abs().max().clamp_min(1e-30))
    bound = HALF_ULP[y.dtype] * ref.abs() + 2e-6 * scale
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), f"max err {float(err.max()):.3e}, scale {scale:.3e}"


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize("dot", [False, True])
@pytest.mark.parametrize("split_k", [1, 3])
def test_parity_small(dtype: torch.dtype, M: int, dot: bool, split_k: int) -> None:
    """N = 37, K = 100: a partial N tile and a masked K tail; three K splits of one block each
    but the last partial."""
    x, w = operands(M, 37, 100, dtype, seed=M)
    y = triton_linear(x, w, block_n=16, block_k=32, split_k=split_k, dot=dot)
    assert_close(y, x, w)


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("M", [1, 3, 17])
def test_parity_default_plan(dtype: torch.dtype, M: int) -> None:
    """The default plan (on the CPU: planned for one SM), K a multiple of the block."""
    x, w = operands(M, 50, 256, dtype, seed=10 + M)
    assert_close(triton_linear(x, w), x, w)


@pytest.mark.parametrize(("x_dtype", "w_dtype"), [(F32, BF16), (BF16, F32),
                                                  (torch.float16, torch.float16)])
@pytest.mark.parametrize("dot", [False, True])
def test_mixed_and_fp16(x_dtype: torch.dtype, w_dtype: torch.dtype, dot: bool) -> None:
    """Mixed operands: F.linear of the fp32 upcasts, rounded to x's dtype."""
    x, w = operands(5, 40, 96, x_dtype, w_dtype, seed=3)
    assert_close(triton_linear(x, w, block_n=16, block_k=32, split_k=2, dot=dot), x, w)


def test_many_splits_and_tiles() -> None:
    """More splits than SPLIT_K's default, several N tiles each reduced by its own last arrival;
    the held counters are left zero."""
    x, w = operands(2, 70, 520, F32, seed=4)
    held = GemvCounters()
    for dot, split in ((False, 9), (True, 40)):
        y = triton_linear(x, w, block_n=16, block_k=16, split_k=split, dot=dot,
                          counters=held.get(x.device))
        assert_close(y, x, w)
    assert int(held.get(x.device).abs().sum()) == 0


def test_deterministic() -> None:
    """Two calls are bit-equal (split-K included); the split plan is the only source of
    another sum order."""
    x, w = operands(3, 45, 300, F32, seed=5)
    for knobs in ({"split_k": 1}, {"split_k": 4}, {"split_k": 4, "dot": True}):
        a = triton_linear(x, w, block_n=16, block_k=32, **knobs)
        b = triton_linear(x, w, block_n=16, block_k=32, **knobs)
        assert torch.equal(a, b), knobs


def test_own_counters() -> None:
    counters = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    x, w = operands(1, 40, 128, BF16, seed=6)
    assert_close(triton_linear(x, w, block_n=16, block_k=32, split_k=4, counters=counters), x, w)
    assert int(counters.abs().sum()) == 0


def test_strided_rows() -> None:
    """x and w may be column slices of wider rows (unit stride along K); y is contiguous."""
    xb, wb = operands(3, 33, 160, BF16, seed=7)
    x, w = xb[:, :130], wb[:, 10:140]
    assert x.stride(0) == 160 and w.stride(0) == 160
    assert_close(triton_linear(x, w, block_n=16, block_k=32, split_k=2), x, w)
    assert_close(triton_linear(x, w, block_n=16, block_k=32, split_k=2, dot=True), x, w)


def test_empty_shapes() -> None:
    x, w = operands(2, 5, 8, F32)
    assert triton_linear(x[:0], w).shape == (0, 5)
    assert triton_linear(x, w[:0]).shape == (2, 0)
    y = triton_linear(x[:, :0], w[:, :0])
    assert y.shape == (2, 5) and not bool(y.any())


def test_validation_names_the_argument() -> None:
    x, w = operands(2, 16, 32, F32)
    cases = [
        ((x[0], w), {}, "x must be"),
        ((x, w[:, :16]), {}, "w must be"),
        ((x, w[0]), {}, "w must be"),
        ((x.double(), w), {}, "x dtype"),
        ((x, w.to(torch.int32)), {}, "w dtype"),
        ((torch.randn(32, 2, device=DEVICE).t(), w), {}, "x must have unit stride"),
        ((x, torch.randn(32, 16, device=DEVICE).t()), {}, "w must have unit stride"),
        ((torch.randn(MAX_M + 1, 32, device=DEVICE), w), {}, f"M <= {MAX_M}"),
        ((x, w), {"block_n": 24}, "block_n"),
        ((x, w), {"block_k": 8, "dot": True}, "block_k"),
        ((x, w), {"num_warps": 3}, "num_warps"),
        ((x, w), {"num_stages": 0}, "num_stages"),
        ((x, w), {"split_k": 0}, "split_k"),
        ((x, w), {"precision": "tf32"}, "precision"),
        ((x, w), {"block_k": 16, "split_k": 2, "counters": torch.zeros(4)}, "counters"),
    ]
    for args, knobs, match in cases:
        with pytest.raises(ValueError, match=match):
            triton_linear(*args, **knobs)


@pytest.mark.parametrize(("N", "K", "dtype"), REAL_SHAPES)
@pytest.mark.parametrize("M", [1, 8, 32])
def test_plan_fills_the_gpu(N: int, K: int, dtype: torch.dtype, M: int) -> None:
    """Host plan on an H200 (132 SMs): at least two programs per SM, or every K block its own
    split; whole K blocks per split, none empty; the FMA path only for small M."""
    p = plan_gemv(M, N, K, dtype, dtype, 132)
    k_blocks = triton.cdiv(K, p.block_k)
    per = triton.cdiv(k_blocks, p.split_k)
    assert 1 <= p.split_k <= k_blocks and triton.cdiv(k_blocks, per) == p.split_k
    programs = triton.cdiv(N, p.block_n) * p.split_k
    assert programs >= 264 or p.split_k == k_blocks, p
    assert p.dot == (M > gemv.FMA_MAX_M)
    assert p.block_n & (p.block_n - 1) == 0 and p.block_k & (p.block_k - 1) == 0


@pytest.mark.gpu
@pytest.mark.parametrize(("N", "K", "dtype"), REAL_SHAPES)
@pytest.mark.parametrize("M", [1, 8, 32])
def test_gpu_real_shapes_in_graph(N: int, K: int, dtype: torch.dtype, M: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    g = torch.Generator(DEVICE).manual_seed(M * 7 + N)
    x = torch.randn(M, K, generator=g, device=DEVICE).to(dtype)
    w = (torch.randn(N, K, generator=g, device=DEVICE) / K**0.5).to(dtype)
    held = GemvCounters()
    eager = triton_linear(x, w, counters=held.get(x.device))   # compiles, holds the counters
    assert_close(eager, x, w)
    assert torch.equal(triton_linear(x, w, counters=held.get(x.device)), eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = triton_linear(x, w, counters=held.get(x.device))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, eager)
    x.copy_(torch.randn(M, K, generator=g, device=DEVICE).to(dtype))   # new values, same graph
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert_close(got, x, w)
    assert torch.equal(got, triton_linear(x, w))
    assert int(held.get(x.device).abs().sum()) == 0
