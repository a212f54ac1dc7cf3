"""The triton backend's `linear` op (`kernels/triton/gemv.py::triton_decode_linear`): decode-sized
16-bit projections through the one-launch skinny GEMM with tiles and K splits fixed from K, so a
fused group's columns are its members' bits; everything else `F.linear`. Interpreter on CPU,
compiled on CUDA.

    TRITON_INTERPRET=1 PYTHONPATH=src python3 -m pytest -q tests/kernels/test_decode_linear.py
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from dsv4.kernels.ops import DECODE_BLOCK_N
from dsv4.kernels.triton.gemv import triton_decode_linear

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a CUDA GPU or the Triton interpreter")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _data(shape: tuple[int, ...], n: int, seed: int = 0,
          dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    w = torch.randn(n, shape[-1], generator=g) / shape[-1] ** 0.5
    return x.to(DEVICE, dtype), w.to(DEVICE, dtype)


def _counters(n: int) -> torch.Tensor:
    return torch.zeros(-(-n // DECODE_BLOCK_N), dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("shape", [(1, 2048), (3, 2048), (1, 2, 2048)])
def test_decode_rows_match_linear_and_fused_columns_are_exact(shape: tuple[int, ...]) -> None:
    x, w = _data(shape, 80)
    counters = _counters(80)
    got = triton_decode_linear(x, w, counters=counters)
    assert got.shape == (*shape[:-1], 80) and got.dtype == x.dtype
    want = F.linear(x.float(), w.float())
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
    parts = [triton_decode_linear(x, w[:48], counters=_counters(48)),
             triton_decode_linear(x, w[48:], counters=_counters(32))]
    assert torch.equal(got, torch.cat(parts, dim=-1)), "fused columns differ from the members'"
    assert int(counters.abs().sum()) == 0, "split-K counters left non-zero"


def test_row_bits_do_not_depend_on_the_other_rows() -> None:
    x, w = _data((4, 1024), 64)
    alone = triton_decode_linear(x[1:2], w, counters=_counters(64))
    assert torch.equal(triton_decode_linear(x, w, counters=_counters(64))[1:2], alone)


@pytest.mark.parametrize("case", ["no counters", "many rows", "fp32"])
def test_other_calls_take_linear(case: str) -> None:
    dtype = torch.float32 if case == "fp32" else torch.bfloat16
    x, w = _data((9 if case == "many rows" else 1, 256), 32, dtype=dtype)
    counters = None if case == "no counters" else _counters(32)
    assert torch.equal(triton_decode_linear(x, w, counters=counters), F.linear(x, w))
