"""Parity of `triton_rope` (RoPE only, no norm: the indexer's queries) with
`kernels/ref/rope_norm.py::rope`: bit-equal, in fp32 and bf16.

CPU: the interpreter on small shapes: one token and several, a rope slice narrower than the head
and one as wide, a head dim that is not a power of two, a non-contiguous input, an empty step (the
interpreter casts fp32 -> bf16 toward zero, so a bf16 result is checked as the fp32 op's bits
truncated).
GPU (`-m gpu`): the V4-Flash indexer's shape (Ih 64, Id 128, rd 64) at T = 1..8192 inside a CUDA
graph (compiled without FMA contraction, so bit-equal there too).

    PYTHONPATH=src python -m pytest -q tests/kernels/test_rope.py [-m gpu]
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

# NOTE: must precede the first `import triton` (tests/kernels/conftest.py may already do this).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from dsv4.kernels.ref.rope_norm import rope  # noqa: E402
from dsv4.kernels.triton.rope_norm import triton_rope  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def case(T: int, H: int, D: int, rd: int, dtype: torch.dtype,
         seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H, D] and fp32 cos / sin [T, rd/2] of real RoPE angles (positions up to 1M)."""
    g = torch.Generator(DEVICE).manual_seed(seed)
    pos = torch.randint(0, 1 << 20, (T, 1), generator=g, device=DEVICE).float()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rd, 2, device=DEVICE).float() / rd))
    angles = pos * inv_freq
    x = (torch.randn(T, H, D, generator=g, device=DEVICE) * 3).to(dtype)
    return x, angles.cos(), angles.sin()


def truncated(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 rounded toward zero: the Triton interpreter's cast (the GPU rounds to nearest
    even, as torch does)."""
    return (x.float().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


def assert_same(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Bit-equal to the reference; a bf16 result under the interpreter: bit-equal before the final
    cast (the same op in fp32) and then the interpreter's truncation of those fp32 values."""
    want, got = rope(x, cos, sin), triton_rope(x, cos, sin)
    assert got.dtype == want.dtype == x.dtype and got.shape == want.shape
    if x.dtype == torch.float32 or DEVICE == "cuda":
        assert torch.equal(got, want)
        return
    wide = rope(x.float(), cos, sin)
    assert torch.equal(triton_rope(x.float(), cos, sin), wide)
    assert torch.equal(wide.to(x.dtype), want)          # the reference rounds once, at the end
    assert torch.equal(got, truncated(wide))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("T", "H", "D", "rd"), [(1, 4, 32, 8), (7, 4, 32, 8), (5, 8, 64, 16),
                                                 (3, 2, 48, 48), (2, 3, 24, 8)])
def test_parity(T: int, H: int, D: int, rd: int, dtype: torch.dtype) -> None:
    assert_same(*case(T, H, D, rd, dtype, seed=T * 7 + D))


def test_unrotated_channels_copied_and_strided_input() -> None:
    """The leading D - rd channels are the input's bits; a head-strided view reads as a copy."""
    x, cos, sin = case(3, 4, 32, 8, torch.bfloat16, seed=1)
    got = triton_rope(x, cos, sin)
    assert torch.equal(got[..., :24], x[..., :24])
    wide = torch.randn(3, 8, 32, dtype=torch.bfloat16, device=DEVICE)
    assert_same(wide[:, ::2], cos, sin)


def test_empty_and_validation() -> None:
    x, cos, sin = case(0, 4, 32, 8, torch.float32, seed=0)
    assert triton_rope(x, cos, sin).shape == (0, 4, 32)
    x, cos, sin = case(2, 4, 32, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match=r"\[T, H, D\]"):
        triton_rope(x[0], cos, sin)
    with pytest.raises(ValueError, match="cos / sin"):
        triton_rope(x, cos[:1], sin[:1])
    with pytest.raises(ValueError, match="cos / sin"):
        triton_rope(x, cos.double(), sin.double())


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 8192])
def test_gpu_flash_indexer_shape_in_graph(T: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    x, cos, sin = case(T, 64, 128, 64, torch.bfloat16, seed=T)
    assert torch.equal(in_graph(triton_rope, x, cos, sin), rope(x, cos, sin))


def in_graph(op: Callable[..., Any], *args: torch.Tensor) -> Any:
    """`op(*args)` captured in a CUDA graph (compiled outside the capture), replayed once."""
    op(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(*args)
    graph.replay()
    return out
