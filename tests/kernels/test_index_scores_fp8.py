"""Index scores over FP8 indexer keys (`key_scales`): the reference against the scores of the
dequantised fp32 keys (bit-equal), the Triton kernel against the reference (CPU interpreter:
small shapes; `-m gpu`: V4-Flash shapes), and the argument checks."""

from __future__ import annotations

import pytest
import torch
from test_index_scores import BF16_REL, FP32_REL, assert_scores_close, make_case

from dsv4.kernels.ref.index_keys import (
    dequantize_index_keys,
    quantize_index_keys,
    round_index_keys,
)
from dsv4.kernels.ref.indexer import paged_index_scores
from dsv4.kernels.triton.index_scores import triton_index_scores

FP8_MMA_REL = 1e-3


def fp8_case(T: int, Ih: int, Id: int, V: int, dtype: torch.dtype, *, shared: bool,
             seed: int = 0) -> tuple[torch.Tensor, ...]:
    """`make_case` with the keys as FP8 codes and scales (rows of spread magnitudes)."""
    q, w, keys, cand = make_case(T, Ih, Id, V, dtype, shared=shared, seed=seed,
                                 key_dtype=torch.float32)
    spread = torch.logspace(-3, 3, keys.shape[0], device=keys.device)[:, None]
    codes, scales = quantize_index_keys(keys * spread)
    return q, w, codes, scales, cand


def spread_heads(q: torch.Tensor) -> torch.Tensor:
    """q [T, Ih, Id] with heads of spread magnitudes (each head's FP8 scale differs)."""
    spread = torch.logspace(-2, 2, q.shape[1], device=q.device)[None, :, None]
    return (q.float() * spread).to(q.dtype)


@pytest.mark.parametrize("shared", [False, True], ids=["decode", "prefill"])
def test_reference_equals_dequantised_keys(shared: bool) -> None:
    q, w, codes, scales, cand = fp8_case(5, 8, 32, 70, torch.float32, shared=shared)
    out = paged_index_scores(q, w, codes, cand, key_scales=scales, weight_scale=0.5)
    keys = dequantize_index_keys(codes, scales)
    assert torch.equal(out, paged_index_scores(q, w, keys, cand, weight_scale=0.5))
    q = spread_heads(q)
    out = paged_index_scores(q, w, codes, cand, key_scales=scales, fp8_q=True)
    assert torch.equal(out, paged_index_scores(round_index_keys(q), w, keys, cand))


@pytest.mark.parametrize("T,Ih,Id,V,shared", [(1, 4, 16, 37, False), (3, 8, 32, 50, False),
                                              (6, 8, 32, 45, True), (4, 6, 24, 33, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_keys_parity(T: int, Ih: int, Id: int, V: int, shared: bool,
                         dtype: torch.dtype) -> None:
    q, w, codes, scales, cand = fp8_case(T, Ih, Id, V, dtype, shared=shared)
    ref = paged_index_scores(q, w, codes, cand, key_scales=scales)
    out = triton_index_scores(q, w, codes, cand, key_scales=scales, block_v=16,
                              blocks_per_program=2)
    assert_scores_close(out, ref, FP32_REL)
    q = spread_heads(q)
    ref = paged_index_scores(q, w, codes, cand, key_scales=scales, fp8_q=True)
    out = triton_index_scores(q, w, codes, cand, key_scales=scales, fp8_q=True, block_v=16,
                              blocks_per_program=2)
    assert_scores_close(out, ref, FP32_REL)


def test_fp8_keys_argument_checks() -> None:
    q, w, codes, scales, cand = fp8_case(2, 4, 16, 20, torch.float32, shared=False)
    with pytest.raises(ValueError, match="key_scales go with float8_e4m3fn keys"):
        triton_index_scores(q, w, codes, cand)
    with pytest.raises(ValueError, match="key_scales go with float8_e4m3fn keys"):
        triton_index_scores(q, w, codes.float(), cand, key_scales=scales)
    with pytest.raises(ValueError, match=r"key_scales must be \[\d+\] fp32"):
        triton_index_scores(q, w, codes, cand, key_scales=scales[:-1])
    with pytest.raises(ValueError, match=r"key_scales must be \[\d+\] fp32"):
        triton_index_scores(q, w, codes, cand, key_scales=scales.double())
    with pytest.raises(ValueError, match="fp8_q needs FP8 keys"):
        triton_index_scores(q, w, dequantize_index_keys(codes, scales), cand, fp8_q=True)
    with pytest.raises(ValueError, match="fp8_q needs FP8 keys"):
        paged_index_scores(q, w, dequantize_index_keys(codes, scales), cand, fp8_q=True)


@pytest.mark.gpu
@pytest.mark.parametrize("V", [4096, 262144])
@pytest.mark.parametrize("T", [1, 64])
def test_fp8_keys_parity_real_shapes_cuda(T: int, V: int) -> None:
    q, w, codes, scales, cand = fp8_case(T, 64, 128, V, torch.bfloat16, shared=False)
    ref = paged_index_scores(q, w, codes, cand, key_scales=scales)
    assert_scores_close(triton_index_scores(q, w, codes, cand, key_scales=scales), ref, BF16_REL)
    q = spread_heads(q)
    ref = paged_index_scores(q, w, codes, cand, key_scales=scales, fp8_q=True)
    out = triton_index_scores(q, w, codes, cand, key_scales=scales, fp8_q=True)
    # FP8 products are exact, but Hopper's FP8 MMA adds them with fewer mantissa bits than fp32
    # (DeepGEMM promotes its partial sums to fp32 for this)
    assert_scores_close(out, ref, FP8_MMA_REL)
