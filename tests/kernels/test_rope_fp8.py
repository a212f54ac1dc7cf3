"""Parity of `triton_rope_fp8` (RoPE, then each head quantised as an FP8 indexer key) with
`kernels/ref/rope_norm.py::rope_fp8`: the codes and the scales bit-equal.

CPU: the interpreter on small shapes (one token and several, rope slices narrower than the head
and as wide, a head dim that is not a power of two, a head-strided input, heads of spread
magnitudes, an empty step). The interpreter casts fp32 -> bf16 toward zero (`test_rope.py`), so a
bf16 input is checked against the reference quantising the truncated rotation, and against
`triton_rope`'s own output quantised. GPU (`-m gpu`): the V4-Flash indexer's shape inside a CUDA
graph, bit-equal to the reference.

    PYTHONPATH=src:tests/kernels python -m pytest -q tests/kernels/test_rope_fp8.py [-m gpu]
"""

from __future__ import annotations

import os

import torch

# NOTE: must precede the first `import triton` (tests/kernels/conftest.py may already do this).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from test_rope import DEVICE, case, in_graph, truncated  # noqa: E402

from dsv4.kernels.ref.index_keys import quantize_index_keys  # noqa: E402
from dsv4.kernels.ref.rope_norm import rope, rope_fp8  # noqa: E402
from dsv4.kernels.triton.rope_fp8 import triton_rope_fp8  # noqa: E402
from dsv4.kernels.triton.rope_norm import triton_rope  # noqa: E402


def spread(x: torch.Tensor) -> torch.Tensor:
    """Heads of magnitudes from 1e-3 to 1e3: each head's scale differs, some codes subnormal."""
    scale = torch.logspace(-3, 3, x.shape[1], device=x.device)[None, :, None]
    return (x.float() * scale).to(x.dtype)


def assert_same(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    codes, scales = triton_rope_fp8(x, cos, sin)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == x.shape[:2]
    if x.dtype == torch.float32 or DEVICE == "cuda":
        want = rope_fp8(x, cos, sin)
    else:                     # the interpreter's bf16 cast truncates (`test_rope.truncated`)
        want = quantize_index_keys(truncated(rope(x.float(), cos, sin)))
    assert torch.equal(codes.view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(scales, want[1])
    rotated = quantize_index_keys(triton_rope(x, cos, sin))
    assert torch.equal(codes.view(torch.uint8), rotated[0].view(torch.uint8))
    assert torch.equal(scales, rotated[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("T", "H", "D", "rd"), [(1, 4, 32, 8), (7, 4, 32, 8), (5, 8, 64, 16),
                                                 (3, 2, 48, 48), (2, 3, 24, 8)])
def test_parity(T: int, H: int, D: int, rd: int, dtype: torch.dtype) -> None:
    x, cos, sin = case(T, H, D, rd, dtype, seed=T * 7 + D)
    assert_same(x, cos, sin)
    assert_same(spread(x), cos, sin)


def test_strided_input_empty_step_and_validation() -> None:
    x, cos, sin = case(3, 4, 32, 8, torch.bfloat16, seed=1)
    wide = torch.randn(3, 8, 32, dtype=torch.bfloat16, device=DEVICE)
    assert_same(wide[:, ::2], cos, sin)
    codes, scales = triton_rope_fp8(x[:0], cos[:0], sin[:0])
    assert codes.shape == (0, 4, 32) and scales.shape == (0, 4)
    with pytest.raises(ValueError, match=r"\[T, H, D\]"):
        triton_rope_fp8(x[0], cos, sin)
    with pytest.raises(ValueError, match="cos / sin"):
        triton_rope_fp8(x, cos[:1], sin[:1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [1, 64, 8192])
def test_flash_indexer_queries_in_a_cuda_graph(tokens: int) -> None:
    x, cos, sin = case(tokens, 64, 128, 64, torch.bfloat16, seed=tokens)
    want = rope_fp8(x, cos, sin)
    codes, scales = in_graph(triton_rope_fp8, x, cos, sin)
    assert torch.equal(codes.view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(scales, want[1])
