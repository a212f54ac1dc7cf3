"""The aten overloads that `kernels/ref/batch_invariant.py::batch_invariant()` replaces on CUDA:
`ATEN_OVERRIDES`, each the batch-invariant kernel of `batch_invariant.py` for the float dtypes it
covers (bf16, fp16, fp32; one dtype across the operands) and aten's own `.out` kernel (not
overridden, not row-invariant) for the rest (fp64, complex, integer, mixed dtypes), with aten's
result dtypes.

Test: tests/kernels/test_batch_invariant_triton.py (`test_overrides_*`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from dsv4.kernels.triton.batch_invariant import (
    FLOAT_DTYPES,
    bi_addmm,
    bi_bmm,
    bi_mm,
    log_softmax,
    logsumexp,
    mean_dim,
    softmax,
    sum_dim,
)


def _aten_out(op: Any, result_dtype: torch.dtype, like: torch.Tensor, /, *args: Any,
              **kwargs: Any) -> torch.Tensor:
    """aten's own kernel through the op's `.out` overload (not overridden), into a new tensor."""
    out: torch.Tensor = op(*args, **kwargs, out=like.new_empty(0, dtype=result_dtype))
    return out


def _same_float(*tensors: torch.Tensor) -> bool:
    return tensors[0].dtype in FLOAT_DTYPES and len({t.dtype for t in tensors}) == 1


def _float_result(x: torch.Tensor, dtype: torch.dtype | None) -> bool:
    return (dtype or x.dtype) in FLOAT_DTYPES and not x.is_complex()


def _matmul(fast: Callable[..., torch.Tensor], out_op: Any) -> Callable[..., torch.Tensor]:
    def impl(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return fast(a, w) if _same_float(a, w) else _aten_out(out_op, a.dtype, a, a, w)
    return impl


def _addmm(bias: torch.Tensor, a: torch.Tensor, w: torch.Tensor, *, beta: float = 1,
           alpha: float = 1) -> torch.Tensor:
    if _same_float(bias, a, w):
        return bi_addmm(bias, a, w, beta=beta, alpha=alpha)
    return _aten_out(torch.ops.aten.addmm.out, a.dtype, a, bias, a, w, beta=beta, alpha=alpha)


def _sum(x: torch.Tensor, dim: Sequence[int] | None = None, keepdim: bool = False, *,
         dtype: torch.dtype | None = None) -> torch.Tensor:
    if _float_result(x, dtype):
        return sum_dim(x, dim, keepdim, dtype=dtype)
    real = x.is_floating_point() or x.is_complex()
    want = dtype or (x.dtype if real else torch.int64)
    return _aten_out(torch.ops.aten.sum.IntList_out, want, x, x, dim, keepdim, dtype=dtype)


def _mean(x: torch.Tensor, dim: Sequence[int] | None = None, keepdim: bool = False, *,
          dtype: torch.dtype | None = None) -> torch.Tensor:
    if _float_result(x, dtype):
        return mean_dim(x, dim, keepdim, dtype=dtype)
    return _aten_out(torch.ops.aten.mean.out, dtype or x.dtype, x, x, dim, keepdim, dtype=dtype)


def _softmax_like(fast: Callable[..., torch.Tensor], out_op: Any) -> Callable[..., torch.Tensor]:
    def impl(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
        if x.dtype in FLOAT_DTYPES and not (half_to_float and x.dtype == torch.float32):
            return fast(x, dim, half_to_float)
        want = torch.float32 if half_to_float else x.dtype
        return _aten_out(out_op, want, x, x, dim, half_to_float)
    return impl


def _logsumexp(x: torch.Tensor, dim: Sequence[int], keepdim: bool = False) -> torch.Tensor:
    if x.dtype in FLOAT_DTYPES:
        return logsumexp(x, dim, keepdim)
    real = x.is_floating_point() or x.is_complex()
    want = x.dtype if real else torch.get_default_dtype()
    return _aten_out(torch.ops.aten.logsumexp.out, want, x, x, dim, keepdim)


ATEN_OVERRIDES: dict[str, Callable[..., torch.Tensor]] = {
    "mm": _matmul(bi_mm, torch.ops.aten.mm.out), "bmm": _matmul(bi_bmm, torch.ops.aten.bmm.out),
    "addmm": _addmm, "sum.dim_IntList": _sum, "mean.dim": _mean,
    "_softmax": _softmax_like(softmax, torch.ops.aten._softmax.out),
    "_log_softmax": _softmax_like(log_softmax, torch.ops.aten._log_softmax.out),
    "logsumexp": _logsumexp,
}
"""aten overload -> CUDA kernel while `batch_invariant()` is open; dtypes these do not cover go
to aten's `.out` kernels."""
