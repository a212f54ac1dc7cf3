"""Batch-invariant Triton GEMMs and row reductions (`kernels/triton/batch_invariant.py`).

CPU (Triton interpreter): parity of bi_mm / bi_bmm / bi_addmm / bi_sum_rows and the composites
(sum, mean, softmax, log_softmax, logsumexp) with torch, fp32 to 1e-5 relative to max |ref|; bf16
against the fp32 result of the same bf16 values rounded once (the interpreter upcasts 16-bit tiles
to fp32 before tl.dot, its bf16 dot being broken; so the tensor-core path is only checked on the
GPU); row invariance of every op, bit for bit, across tile boundaries; the `ATEN_OVERRIDES`
reached through the dispatcher (registered on the CPU key for the test: F.linear, torch.sum, ...
and their autograd backward land in them; uncovered dtypes reach aten's `.out` kernels).
GPU (`-m gpu`): `check_row_invariance("cuda")` at 4096 x 4096 and at vocab width, fp32 and bf16;
parity with cuBLAS / torch at real shapes; `batch_invariant()` on CUDA runs the Triton kernels
(profiler) and F.linear / softmax rows are invariant inside and aten's bits return outside.

    PYTHONPATH=src python3 -m pytest -q tests/kernels/test_batch_invariant_triton.py
    PYTHONPATH=src python3 -m pytest -q -m gpu tests/kernels/test_batch_invariant_triton.py
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator

import torch

# NOTE: must precede the first `import triton` (tests/kernels/conftest.py may already do this).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dsv4.kernels.ref.batch_invariant import batch_invariant, check_row_invariance  # noqa: E402
from dsv4.kernels.triton import batch_invariant as bi  # noqa: E402
from dsv4.kernels.triton.batch_invariant_aten import ATEN_OVERRIDES  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP32_REL = 1e-5
BF16_REL = 2 ** -7          # one bf16 rounding of the fp32 result (plus fp32 order noise)
SMALL = bi.MMConfig(16, 16, 16, 4, 2, group_m=2)   # many tiles at test shapes
Op = Callable[[torch.Tensor], torch.Tensor]


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).abs().max() / ref.double().abs().max().clamp(1e-30))


@pytest.mark.parametrize("config", [None, SMALL])
@pytest.mark.parametrize(("M", "K", "N"), [(1, 16, 16), (37, 50, 45), (130, 64, 96)])
def test_mm_fp32_matches_torch(M: int, K: int, N: int, config: bi.MMConfig | None) -> None:
    a, w = randn(M, K), randn(N, K, seed=1)
    assert rel(bi.bi_mm(a, w.t(), config=config), a @ w.t()) < FP32_REL        # F.linear layout
    assert rel(bi.bi_mm(a.t().contiguous().t(), w.t().contiguous(), config=config),
               a @ w.t()) < FP32_REL                                          # column-major a


def test_mm_bf16_rounds_the_fp32_result_once() -> None:
    a, w = randn(20, 72, dtype=torch.bfloat16), randn(72, 40, seed=1, dtype=torch.bfloat16)
    out = bi.bi_mm(a, w)
    assert out.dtype == torch.bfloat16
    assert rel(out, a.float() @ w.float()) < BF16_REL


def test_bmm_and_addmm_match_torch() -> None:
    a, w = randn(3, 17, 40), randn(3, 40, 24, seed=1)
    assert rel(bi.bi_bmm(a, w), torch.bmm(a, w)) < FP32_REL
    assert rel(bi.bi_bmm(a, w, config=SMALL), torch.bmm(a, w)) < FP32_REL
    x, wt = randn(9, 40), randn(24, 40, seed=2).t()
    for bias in (randn(24, seed=3), randn(9, 24, seed=4), randn(9, 1, seed=5)):
        for beta, alpha in ((1, 1), (0.5, -2.0)):
            ref = torch.addmm(bias, x, wt, beta=beta, alpha=alpha)
            assert rel(bi.bi_addmm(bias, x, wt, beta=beta, alpha=alpha), ref) < FP32_REL
    nan_bias = torch.full((24,), float("nan"), device=DEVICE)
    assert rel(bi.bi_addmm(nan_bias, x, wt, beta=0, alpha=3.0), 3.0 * (x @ wt)) < FP32_REL


def test_operand_alignment_does_not_change_bits() -> None:
    """Operands off 16-byte alignment (a view 2 bytes into a buffer) compile another variant
    (Triton specialises pointers on alignment): its loads differ, its MMA order must not."""
    M, K, N = (64, 4096, 4096) if DEVICE == "cuda" else (5, 48, 40)
    a, w = randn(M, K, dtype=torch.bfloat16), randn(K, N, seed=1, dtype=torch.bfloat16)
    shifted_a = torch.empty(M * K + 1, dtype=a.dtype, device=DEVICE)[1:].view(M, K).copy_(a)
    shifted_w = torch.empty(K * N + 1, dtype=w.dtype, device=DEVICE)[1:].view(K, N).copy_(w)
    assert shifted_a.data_ptr() % 16 and shifted_w.data_ptr() % 16
    assert torch.equal(bi.bi_mm(shifted_a, shifted_w), bi.bi_mm(a, w))
    assert torch.equal(bi.bi_mm(shifted_a, w.t().contiguous().t()), bi.bi_mm(a, w))


@pytest.mark.parametrize("N", [1, 7, 16, 100, 4100, 8192])
def test_sum_rows_matches_torch(N: int) -> None:
    x = randn(5, N)
    out = bi.bi_sum_rows(x)
    assert out.dtype == torch.float32 and out.shape == (5,)
    assert (out - x.double().sum(1)).abs().max() <= 1e-6 * x.abs().sum(1).max()


def test_sum_rows_reads_views_like_their_copies() -> None:
    """A misaligned, strided view is summed by the same compiled kernel as its contiguous copy."""
    x = randn(9, 300)[1:, 3:]
    assert torch.equal(bi.bi_sum_rows(x), bi.bi_sum_rows(x.contiguous()))
    assert torch.equal(bi.bi_sum_rows(x.t().contiguous().t()), bi.bi_sum_rows(x.contiguous()))


@pytest.mark.parametrize(("dim", "keepdim"), [([-1], False), ([1], True), ([0, 2], False),
                                              (None, False), ([], True)])
def test_sum_and_mean_match_torch(dim: list[int] | None, keepdim: bool) -> None:
    x = randn(4, 6, 33)
    for ours, ref in ((bi.sum_dim, torch.sum), (bi.mean_dim, torch.mean)):
        out, want = ours(x, dim, keepdim), ref(x, dim, keepdim)
        assert out.shape == want.shape and rel(out, want) < FP32_REL


def test_reduction_dtypes_follow_aten() -> None:
    x = randn(3, 40, dtype=torch.bfloat16)
    assert bi.sum_dim(x, [1]).dtype == torch.bfloat16
    assert torch.equal(bi.sum_dim(x, [1], dtype=torch.float32), x.float().sum(1))  # exact
    assert bi.mean_dim(x, [1]).dtype == torch.bfloat16
    assert bi.sum_dim(torch.arange(6, device=DEVICE).view(2, 3), [1],
                      dtype=torch.float32).tolist() == [3.0, 12.0]
    assert bi.softmax(x, 1, half_to_float=True).dtype == torch.float32
    assert rel(bi.softmax(x, 1), x.float().softmax(1)) < BF16_REL
    empty = torch.empty(2, 0, device=DEVICE)
    assert bi.sum_dim(empty, [1]).tolist() == [0.0, 0.0]
    assert bi.mean_dim(empty, [1]).isnan().all()
    assert bi.logsumexp(empty, [1]).tolist() == [float("-inf")] * 2
    with pytest.raises(ValueError, match="real x"):
        bi.sum_dim(torch.ones(3, dtype=torch.int64, device=DEVICE), [0])


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_softmax_family_matches_torch(dim: int) -> None:
    x = randn(5, 7, 40) * 4
    assert rel(bi.softmax(x, dim), torch.softmax(x, dim)) < FP32_REL
    assert rel(bi.log_softmax(x, dim), torch.log_softmax(x, dim)) < FP32_REL
    assert rel(bi.logsumexp(x, [dim]), torch.logsumexp(x, dim)) < FP32_REL
    assert rel(bi.logsumexp(x, [0, 2], keepdim=True),
               torch.logsumexp(x, (0, 2), keepdim=True)) < FP32_REL


def test_infinite_rows_match_torch() -> None:
    x = randn(4, 16)
    x[0] = float("-inf")
    x[1, 3] = float("inf")
    x[2, :8] = float("-inf")
    for ours, ref in ((bi.softmax(x, 1), torch.softmax(x, 1)),
                      (bi.log_softmax(x, 1), torch.log_softmax(x, 1)),
                      (bi.logsumexp(x, [1]), torch.logsumexp(x, 1))):
        assert torch.equal(ours.isnan(), ref.isnan())
        finite = ref.isfinite()
        assert torch.equal(ours[~finite & ~ref.isnan()], ref[~finite & ~ref.isnan()])
        assert rel(ours[finite], ref[finite]) < FP32_REL


def row_ops() -> dict[str, Op]:
    w, wb, bias = randn(48, 64, seed=1), randn(2, 32, 24, seed=2), randn(48, seed=3)
    return {
        "mm": lambda t: bi.bi_mm(t, w.t()),
        "mm_small_tiles": lambda t: bi.bi_mm(t, w.t(), config=SMALL),
        "addmm": lambda t: bi.bi_addmm(bias, t, w.t(), beta=0.5, alpha=2.0),
        "bmm": lambda t: bi.bi_bmm(t.view(-1, 2, 32).transpose(0, 1), wb).transpose(0, 1),
        "sum_rows": bi.bi_sum_rows,
        "sum_dim1": lambda t: bi.sum_dim(t.view(-1, 4, 16), [1]),
        "mean": lambda t: bi.mean_dim(t, [-1]),
        "softmax": lambda t: bi.softmax(t, -1),
        "log_softmax": lambda t: bi.log_softmax(t, -1),
        "logsumexp": lambda t: bi.logsumexp(t, [-1]),
    }


@pytest.mark.parametrize("name", list(row_ops()))
def test_rows_are_invariant_to_the_row_count(name: str) -> None:
    """Rows of an M-row call equal the same rows of a 150-row call bit for bit (150 rows: two
    128-row GEMM tiles; SMALL: ten 16-row tiles)."""
    fn, x = row_ops()[name], randn(150, 64, seed=7)
    full = fn(x)
    for m in (1, 2, 17, 128, 129):
        assert torch.equal(fn(x[:m]), full[:m]), f"{name}@{m}"


@contextlib.contextmanager
def overrides_on(key: str, calls: dict[str, int]) -> Iterator[None]:
    """ATEN_OVERRIDES registered on dispatch key `key`, counting their calls."""
    def counted(name: str, kernel: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def run(*args: object, **kwargs: object) -> torch.Tensor:
            calls[name] = calls.get(name, 0) + 1
            return kernel(*args, **kwargs)
        return run

    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            for name, kernel in ATEN_OVERRIDES.items():
                lib.impl(name, counted(name, kernel), key)
        yield
    finally:
        lib._destroy()


def dispatched() -> dict[str, torch.Tensor]:
    x, w, b = randn(5, 48), randn(40, 48, seed=1), randn(40, seed=2)
    return {
        "linear": F.linear(x, w), "linear_bias": F.linear(x, w, b),
        "addmm": torch.addmm(b, x, w.t(), beta=0.5, alpha=3), "matmul_3d": x[None] @ w.t(),
        "bmm": torch.bmm(x.view(5, 4, 12), x.view(5, 12, 4)), "sum": x.sum(-1),
        "sum_all": x.sum(), "sum_dtype": x.bfloat16().sum(0, dtype=torch.float32),
        "mean": x.mean((0, 1), keepdim=True), "softmax": x.softmax(0),
        "log_softmax": F.log_softmax(x, -1), "logsumexp": x.logsumexp(1),
        "softmax_bf16": x.bfloat16().softmax(-1),
        # dtypes the overrides leave to aten (`.out` kernels): must be aten's bits
        "int_sum": torch.arange(10, device=DEVICE).sum(), "bool_sum": (x > 0).sum(-1),
        "f64_mm": x.double() @ w.double().t(),
        "int_logsumexp": torch.arange(4, device=DEVICE).logsumexp(0),
    }


@pytest.mark.skipif(DEVICE != "cpu", reason="registers the overrides on the CPU key")
def test_overrides_serve_aten_ops_through_the_dispatcher() -> None:
    ref, calls = dispatched(), {}
    with overrides_on("CPU", calls):
        out = dispatched()
    assert set(calls) == set(ATEN_OVERRIDES), calls
    for name, want in ref.items():
        assert out[name].dtype == want.dtype and out[name].shape == want.shape, name
        exact = name in ("int_sum", "bool_sum", "f64_mm", "int_logsumexp")
        assert torch.equal(out[name], want) if exact else rel(out[name], want) < FP32_REL, name


@pytest.mark.skipif(DEVICE != "cpu", reason="registers the overrides on the CPU key")
def test_overrides_serve_autograd_backward() -> None:
    def grads() -> tuple[torch.Tensor, torch.Tensor]:
        x = randn(6, 32).requires_grad_()
        w = randn(24, 32, seed=1).requires_grad_()
        F.log_softmax(F.linear(x, w), -1)[:, 0].sum().backward()
        assert x.grad is not None and w.grad is not None
        return x.grad, w.grad

    ref, calls = grads(), {}
    with overrides_on("CPU", calls):
        out = grads()
    assert calls["mm"] >= 3, calls             # forward and both backward matmuls
    assert all(rel(o, r) < FP32_REL for o, r in zip(out, ref, strict=True))


def test_invalid_inputs_raise() -> None:
    a = randn(4, 8)
    with pytest.raises(ValueError, match="cannot be multiplied"):
        bi.bi_mm(a, randn(9, 3))
    with pytest.raises(ValueError, match="share one of"):
        bi.bi_mm(a, randn(8, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="3-D"):
        bi.bi_bmm(a, randn(8, 3))
    with pytest.raises(ValueError, match=r"\[R, N\]"):
        bi.bi_sum_rows(randn(2, 3, 4))
    with pytest.raises(IndexError):
        bi.sum_dim(a, [2])


def test_configs_depend_on_n_k_dtype_only() -> None:
    assert bi.mm_config(4096, 4096, torch.bfloat16) == bi.MMConfig(128, 64, 64, 4, 4)
    assert bi.mm_config(129280, 4096, torch.bfloat16) == bi.MMConfig(128, 128, 64, 8, 3)
    assert bi.mm_config(40, 20, torch.float32) == bi.MMConfig(64, 64, 32, 4, 2)
    assert bi.sum_config(129280) == (1, 4096, 8) and bi.sum_config(100) == (32, 128, 8)


# --- GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dims", [(4096, 4096), (129280, 256)])      # (features, linear out)
def test_check_row_invariance_cuda(dims: tuple[int, int], dtype: torch.dtype) -> None:
    assert check_row_invariance("cuda", dims=dims, max_rows=64, dtype=dtype) == []


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 64, 4096])
def test_mm_parity_cuda(M: int) -> None:
    a, w = randn(M, 4096, dtype=torch.bfloat16), randn(4096, 4096, seed=1, dtype=torch.bfloat16)
    assert rel(bi.bi_mm(a, w.t()), a.float() @ w.float().t()) < BF16_REL
    assert rel(bi.bi_mm(a.float(), w.float().t()), a.double() @ w.double().t()) < FP32_REL
    assert rel(bi.bi_bmm(a.view(M, 2, 2048).transpose(0, 1), w.view(2, 2048, 4096)),
               torch.bmm(a.view(M, 2, 2048).transpose(0, 1).float(),
                         w.view(2, 2048, 4096).float())) < BF16_REL


@pytest.mark.gpu
def test_reductions_parity_cuda() -> None:
    x = randn(64, 129280) * 3
    assert rel(bi.logsumexp(x, [-1]), torch.logsumexp(x.double(), -1)) < FP32_REL
    assert rel(bi.log_softmax(x, -1), torch.log_softmax(x.double(), -1)) < FP32_REL
    assert rel(bi.softmax(x, -1), torch.softmax(x.double(), -1)) < FP32_REL
    assert rel(bi.sum_dim(x, [-1]), x.double().sum(-1)) < FP32_REL
    xb = x.bfloat16()
    assert rel(bi.log_softmax(xb, -1), torch.log_softmax(xb.float(), -1)) < BF16_REL


def cuda_kernel_names(fn: Callable[[], object]) -> set[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.key for e in prof.key_averages()}


@pytest.mark.gpu
def test_context_routes_cuda_ops_and_restores_aten() -> None:
    x, w = randn(64, 4096, dtype=torch.bfloat16), randn(4096, 4096, seed=1, dtype=torch.bfloat16)
    ops: dict[str, Op] = {"linear": lambda t: F.linear(t, w),
                          "softmax": lambda t: torch.softmax(t.float() * 8, -1)}
    before = {name: fn(x[:1]) for name, fn in ops.items()}
    with batch_invariant():
        for name, fn in ops.items():
            full = fn(x)
            assert all(torch.equal(fn(x[:m]), full[:m]) for m in (1, 3, 17)), name
        inside = cuda_kernel_names(lambda: [fn(x[:1]) for fn in ops.values()])
    outside = cuda_kernel_names(lambda: [fn(x[:1]) for fn in ops.values()])
    ours = {"_mm_kernel", "_sum_rows_kernel"}
    assert ours <= inside, inside
    assert not ours & outside, outside
    assert all(torch.equal(fn(x[:1]), before[name]) for name, fn in ops.items())


@pytest.mark.gpu
def test_graph_replay_matches_eager_cuda() -> None:
    a, w = randn(8, 1024, dtype=torch.bfloat16), randn(1024, 512, seed=1, dtype=torch.bfloat16)
    eager = (bi.bi_mm(a, w), bi.logsumexp(a, [-1]))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = (bi.bi_mm(a, w), bi.logsumexp(a, [-1]))
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(o, e) for o, e in zip(out, eager, strict=True))
