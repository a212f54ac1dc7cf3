"""Index scores over FP8 indexer keys (`key_scales`), and FP8 queries over them (`q_scales`):
the reference against the scores of the dequantised fp32 keys and queries (bit-equal), the Triton
kernel against the reference (CPU interpreter: small shapes; `-m gpu`: V4-Flash shapes), and the
argument checks."""

from __future__ import annotations

import pytest
import torch
from test_index_scores import BF16_REL, FP32_REL, assert_scores_close, make_case

from dsv4.kernels.ref.index_keys import dequantize_index_keys, quantize_index_keys
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


def fp8_heads(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Ih, Id] with heads of spread magnitudes (each head's FP8 scale differs), quantised
    per head: (codes, scales [T, Ih])."""
    spread = torch.logspace(-2, 2, q.shape[1], device=q.device)[None, :, None]
    return quantize_index_keys((q.float() * spread).to(q.dtype))


@pytest.mark.parametrize("shared", [False, True], ids=["decode", "prefill"])
def test_reference_equals_dequantised_keys(shared: bool) -> None:
    q, w, codes, scales, cand = fp8_case(5, 8, 32, 70, torch.float32, shared=shared)
    out = paged_index_scores(q, w, codes, cand, key_scales=scales, weight_scale=0.5)
    keys = dequantize_index_keys(codes, scales)
    assert torch.equal(out, paged_index_scores(q, w, keys, cand, weight_scale=0.5))
    qc, qs = fp8_heads(q)
    out = paged_index_scores(qc, w, codes, cand, key_scales=scales, q_scales=qs)
    assert torch.equal(out, paged_index_scores(dequantize_index_keys(qc, qs), w, keys, cand))


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
    qc, qs = fp8_heads(q)
    ref = paged_index_scores(qc, w, codes, cand, key_scales=scales, q_scales=qs)
    out = triton_index_scores(qc, w, codes, cand, key_scales=scales, q_scales=qs, block_v=16,
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
    qc, qs = quantize_index_keys(q)
    keys = dequantize_index_keys(codes, scales)
    for scores in (triton_index_scores, paged_index_scores):
        with pytest.raises(ValueError, match="q_scales go with float8_e4m3fn q"):
            scores(qc, w, codes, cand, key_scales=scales)
        with pytest.raises(ValueError, match="q_scales go with float8_e4m3fn q"):
            scores(q, w, codes, cand, key_scales=scales, q_scales=qs)
        with pytest.raises(ValueError, match="need FP8 keys"):
            scores(qc, w, keys, cand, q_scales=qs)
        with pytest.raises(ValueError, match=r"q_scales must be \[2, 4\] fp32"):
            scores(qc, w, codes, cand, key_scales=scales, q_scales=qs[:, :3].contiguous())


@pytest.mark.gpu
@pytest.mark.parametrize("V", [4096, 262144])
@pytest.mark.parametrize("T", [1, 64])
def test_fp8_keys_parity_real_shapes_cuda(T: int, V: int) -> None:
    q, w, codes, scales, cand = fp8_case(T, 64, 128, V, torch.bfloat16, shared=False)
    ref = paged_index_scores(q, w, codes, cand, key_scales=scales)
    assert_scores_close(triton_index_scores(q, w, codes, cand, key_scales=scales), ref, BF16_REL)
    qc, qs = fp8_heads(q)
    ref = paged_index_scores(qc, w, codes, cand, key_scales=scales, q_scales=qs)
    out = triton_index_scores(qc, w, codes, cand, key_scales=scales, q_scales=qs)
    # FP8 products are exact, but Hopper's FP8 MMA adds them with fewer mantissa bits than fp32
    # (DeepGEMM promotes its partial sums to fp32 for this)
    assert_scores_close(out, ref, FP8_MMA_REL)


@pytest.mark.gpu
@pytest.mark.parametrize("Id", [16, 24, 32])
def test_fp8_queries_below_the_fp8_dot_width_cuda(Id: int) -> None:
    """Indexers narrower than an FP8 dot's 32-channel minimum (the test models'): the channel
    tile is padded with masked zeros, so the FP8 dot compiles and scores as the reference."""
    q, w, codes, scales, cand = fp8_case(2, 8, Id, 300, torch.bfloat16, shared=False)
    qc, qs = fp8_heads(q)
    ref = paged_index_scores(qc, w, codes, cand, key_scales=scales, q_scales=qs)
    out = triton_index_scores(qc, w, codes, cand, key_scales=scales, q_scales=qs)
    assert_scores_close(out, ref, FP8_MMA_REL)
