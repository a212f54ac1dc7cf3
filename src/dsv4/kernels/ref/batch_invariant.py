"""Batch-invariant ops: a row's result does not depend on how many rows share the call.

Why: the engine computes a token's logits in a decode step of B requests (a [B, d] GEMM per
linear); the RL trainer recomputes the same token inside a [S, d] GEMM over the whole sequence.
A GEMM library picks its kernel (and its reduction order over K) from the shape, so the two
results may differ in the last bit. True on-policy RL (`dsv4 rl run --true-on-policy`) needs them
equal, so both sides run under `batch_invariant()`.

Contract (what `check_row_invariance` measures): inside the context, every output row of `mm`,
`addmm` and `bmm` (F.linear, matmul), of row reductions (`sum`, `mean` over any dims) and of
`softmax`, `log_softmax` and `logsumexp` has bit for bit the value it has in any other call with
the same weights, whatever the number of rows; and the transcendental element-wise ops
(`UNARY_OPS`, softplus) give an element the same value wherever it sits in the tensor.

CPU. Element-wise ops: torch's CPU loops run SIMD over whole vectors and a scalar loop over the
tail, and the two round differently (measured for rsqrt, sigmoid, silu, softplus), so an
element's bits depend on the tensor's size; the override pads the flattened input to a multiple
of `PAD_ELEMS` so every element takes the SIMD path. GEMMs: oneDNN / MKL pick their kernel by
shape (measured: 1-3 rows take a GEMV-like path with another reduction order), so every GEMM runs
on blocks of exactly `BLOCK_ROWS` rows, the last one zero-padded. Torch's one-thread CPU
reductions and softmax already reduce each row alone in an order fixed by its length (measured),
so they need no override.

CUDA. cuBLAS picks tiles and split-K by shape and torch's reduction kernels pick block shapes by
shape, so on CUDA the context installs
`kernels/triton/batch_invariant_aten.py::ATEN_OVERRIDES` (fixed-tile Triton GEMMs and row sums
whose config depends on N, K and the dtype, never on the row count) for mm, bmm, addmm,
sum.dim_IntList, mean.dim, _softmax, _log_softmax and logsumexp
(bf16 / fp16 / fp32; other dtypes and other ops, e.g. backward kernels, stay aten's). CUDA
element-wise kernels round each element alone, so they need no override. The Triton module is
imported only when CUDA is available: CPU-only processes never import Triton for this.

Scope: the overrides are installed with `torch.library` for the CPU (and CUDA) dispatch keys and
removed on exit (the aten kernels return); they cover autograd's backward matmuls too. They are
process-wide while the context is open (the dispatcher has one table), so enter it where the
whole process computes in this mode (the RL loop, an engine launched with
`batch_invariant=True`). Torch runs on one intra-op thread inside (a multi-threaded loop splits a
tensor at size-dependent offsets, each piece with its own tail); the thread count is restored on
exit. Nested entries are counted; the overrides stay until the outermost exits.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator

import torch

BLOCK_ROWS = 16
"""Every GEMM call runs on blocks of exactly this many rows (the last one zero-padded)."""

PAD_ELEMS = 64
"""Element-wise inputs are padded to a multiple of this (two AVX-512 vectors of fp32)."""

UNARY_OPS = ("rsqrt", "sigmoid", "silu", "exp", "log", "cos", "sin", "tanh", "log1p", "expm1")
"""Element-wise ops computed on SIMD-aligned padded inputs in the context (plus softplus)."""

_lock = threading.Lock()
_depth = 0
_threads = 1
_library: torch.library.Library | None = None


def _pad_rows(a: torch.Tensor, dim: int) -> torch.Tensor:
    """`a` with zero rows appended along `dim` up to a multiple of BLOCK_ROWS (at least one)."""
    rows = a.shape[dim]
    extra = -rows % BLOCK_ROWS if rows else BLOCK_ROWS
    if extra == 0:
        return a
    shape = list(a.shape)
    shape[dim] = extra
    return torch.cat((a, a.new_zeros(shape)), dim=dim)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    rows = a.shape[0]
    padded = _pad_rows(a, 0)
    out = padded.new_empty(padded.shape[0], b.shape[1])
    for s in range(0, padded.shape[0], BLOCK_ROWS):
        torch.ops.aten.mm.out(padded[s:s + BLOCK_ROWS], b, out=out[s:s + BLOCK_ROWS])
    return out[:rows]


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    rows = a.shape[1]
    padded = _pad_rows(a, 1)
    out = padded.new_empty(padded.shape[0], padded.shape[1], b.shape[2])
    for s in range(0, padded.shape[1], BLOCK_ROWS):
        block = padded[:, s:s + BLOCK_ROWS]
        torch.ops.aten.bmm.out(block, b, out=out[:, s:s + BLOCK_ROWS])
    return out[:, :rows]


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1,
           alpha: float = 1) -> torch.Tensor:
    prod = _mm(a, b)
    if alpha != 1:
        prod = prod * alpha
    return prod + (bias if beta == 1 else bias * beta)


def _aligned(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x flattened and zero-padded to a multiple of PAD_ELEMS, an empty output like it)."""
    flat = x.reshape(-1)
    extra = -flat.numel() % PAD_ELEMS
    if extra:
        flat = torch.cat((flat, flat.new_zeros(extra)))
    return flat, torch.empty_like(flat)


def _unary(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    out_op = getattr(torch.ops.aten, name).out

    def impl(x: torch.Tensor) -> torch.Tensor:
        flat, out = _aligned(x)
        out_op(flat, out=out)
        return out[:x.numel()].view(x.shape)
    return impl


def _softplus(x: torch.Tensor, beta: float = 1, threshold: float = 20) -> torch.Tensor:
    flat, out = _aligned(x)
    torch.ops.aten.softplus.out(flat, beta, threshold, out=out)
    return out[:x.numel()].view(x.shape)


def _install() -> torch.library.Library:
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module="torch.library")
        lib.impl("mm", _mm, "CPU")
        lib.impl("bmm", _bmm, "CPU")
        lib.impl("addmm", _addmm, "CPU")
        lib.impl("softplus", _softplus, "CPU")
        for name in UNARY_OPS:
            lib.impl(name, _unary(name), "CPU")
        if torch.cuda.is_available():
            from dsv4.kernels.triton.batch_invariant_aten import ATEN_OVERRIDES

            for name, kernel in ATEN_OVERRIDES.items():
                lib.impl(name, kernel, "CUDA")
    return lib


@contextlib.contextmanager
def batch_invariant() -> Iterator[None]:
    """Run the enclosed CPU matmuls batch-invariantly (see the module docstring)."""
    global _depth, _library, _threads
    with _lock:
        if _depth == 0:
            _library = _install()
            _threads = torch.get_num_threads()
            torch.set_num_threads(1)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _library is not None:
                _library._destroy()
                _library = None
                torch.set_num_threads(_threads)


def is_active() -> bool:
    """Whether a `batch_invariant()` context is open in this process."""
    return _depth > 0


def _row_ops(k: int, n: int, device: str, dtype: torch.dtype
             ) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The checked ops, each mapping [M, k] rows to a result whose first dim is M."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(n, k, generator=gen).to(device, dtype)
    bias = torch.randn(n, generator=gen).to(device, dtype)
    wb = torch.randn(2, k // 2, n, generator=gen).to(device, dtype)
    return {
        "linear": lambda t: torch.nn.functional.linear(t, w),
        "linear_bias": lambda t: torch.nn.functional.linear(t, w, bias),
        "bmm": lambda t: torch.bmm(t.view(t.shape[0], 2, -1).transpose(0, 1), wb).transpose(0, 1),
        "sum": lambda t: t.sum(-1),
        "sum_dim1": lambda t: t.view(t.shape[0], 4, -1).sum(1),      # a non-last dim
        "mean": lambda t: t.mean(-1),
        "softmax": lambda t: torch.softmax(t, -1),
        "log_softmax": lambda t: torch.log_softmax(t, -1),
        "logsumexp": lambda t: torch.logsumexp(t, -1),
        "softplus": torch.nn.functional.softplus,
        **{name: getattr(torch.ops.aten, name) for name in UNARY_OPS if name != "log"}}


def check_row_invariance(device: str = "cpu", dims: tuple[int, int] = (256, 512),
                         max_rows: int = 64, dtype: torch.dtype = torch.float32) -> list[str]:
    """The ops whose first M rows (M in 1..max_rows) differ from the same rows of a
    `max_rows`-row call inside `batch_invariant()`, as "op@M"; [] means the contract holds on
    this machine and device. dims = (k, n): rows of k (a multiple of 4) features, linear
    layers k -> n (the reductions run over the k features: a vocab-size k checks logsumexp at
    vocab width)."""
    k, n = dims
    if k % 4:
        raise ValueError(f"dims[0] = {k} is invalid; allowed: a multiple of 4")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(max_rows, k, generator=gen).abs().add(0.5).to(device, dtype)  # rsqrt, log1p
    bad: list[str] = []
    with batch_invariant():
        for name, fn in _row_ops(k, n, device, dtype).items():
            full = fn(x)
            bad += [f"{name}@{m}" for m in range(1, max_rows)
                    if not torch.equal(fn(x[:m]), full[:m])]
    return bad
