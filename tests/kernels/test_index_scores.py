"""Parity of `triton_index_scores` with the reference `paged_index_scores` (spec §6.6).

CPU: small shapes under the Triton interpreter (ragged -1 padding, all -1 rows, V not a multiple of
BLOCK_V, decode T = 1 and prefill T > 1, permuted pool slots, Ih/Id small and not powers of two,
several blocks per program, fp32 / bf16 / mixed dtypes, exact ReLU zeros, input validation; raw
bf16 / fp16 / fp32 weights, a strided column slice and a `weight_scale`, bit-equal to pre-scaled
fp32 weights in both the reference and the kernel).
GPU (`-m gpu`): real V4-Flash shapes (Ih 64, Id 128, bf16, V up to 262,144), fp32 ieee dot, graph
capture, the folded weight scale.

    PYTHONPATH=src python -m pytest -q tests/kernels/test_index_scores.py  # interpreter on CPU
    PYTHONPATH=src python -m pytest -q tests/kernels/test_index_scores.py -m gpu  # on CUDA
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

# NOTE: must precede the first `import triton` (tests/kernels/conftest.py may already do it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from dsv4.kernels.ref.indexer import paged_index_scores  # noqa: E402
from dsv4.kernels.triton.index_scores import triton_index_scores  # noqa: E402

FP32_REL = 1e-5     # max |diff| / max |ref| over finite scores
BF16_REL = 1e-2


def make_case(T: int, Ih: int, Id: int, V: int, dtype: torch.dtype, *, shared: bool, seed: int = 0,
              device: str = "cuda" if torch.cuda.is_available() else "cpu",
              key_dtype: torch.dtype | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random (q, weights, keys, candidates) shaped like the engine's.

    The pool holds N = V + 7 keys; each row's candidates are a permutation of pool slots, visible
    prefix of ragged length, padded with -1. `shared`: all rows are one request (prefill: one slot
    order, causal lengths); otherwise each row is its own request (decode). Row 0 sees all V; with
    T > 1 the last row sees none (an all -1 row).
    """
    g = torch.Generator(device).manual_seed(seed)
    N = V + 7
    q = torch.randn(T, Ih, Id, generator=g, device=device).to(dtype)
    weights = torch.randn(T, Ih, generator=g, device=device) * (Id * Ih) ** -0.5
    keys = torch.randn(N, Id, generator=g, device=device).to(key_dtype or dtype)
    if shared:
        slots = torch.randperm(N, generator=g, device=device)[:V].expand(T, V)
        lengths = torch.linspace(V, 0, T, device=device).round().long()
    else:
        slots = torch.rand(T, N, generator=g, device=device).argsort(dim=1)[:, :V]
        lengths = torch.randint(0, V + 1, (T,), generator=g, device=device)
        lengths[-1] = 0
    lengths[0] = V
    visible = torch.arange(V, device=device)[None, :] < lengths[:, None]
    return q, weights, keys, torch.where(visible, slots, -1).contiguous()


def assert_scores_close(out: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    assert out.dtype == torch.float32 and out.shape == ref.shape, (out.dtype, out.shape, ref.shape)
    assert torch.equal(torch.isneginf(out), torch.isneginf(ref)), ("-inf must be exactly where "
                                                                   "candidates < 0")
    finite = torch.isfinite(ref)
    assert torch.isfinite(out[finite]).all(), "non-finite score where the reference is finite"
    if finite.any():
        scale = ref[finite].abs().max().clamp(min=1e-6)
        err = ((out[finite] - ref[finite]).abs().max() / scale).item()
        assert err <= rel, f"max |diff| / max |ref| = {err:.3e} > {rel:.0e}"


CASES = [  # (T, Ih, Id, V, shared)
    pytest.param(1, 4, 16, 37, False, id="decode-T1-4x16-V37"),
    pytest.param(3, 8, 32, 50, False, id="decode-T3-8x32-V50"),
    pytest.param(6, 8, 32, 45, True, id="prefill-T6-8x32-V45"),
    pytest.param(4, 6, 24, 33, True, id="prefill-T4-6x24-V33-nonpow2"),
    pytest.param(2, 64, 128, 150, False, id="decode-T2-64x128-V150-flash-heads"),
]


@pytest.mark.parametrize("T,Ih,Id,V,shared", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_parity(T: int, Ih: int, Id: int, V: int, shared: bool, dtype: torch.dtype) -> None:
    q, w, keys, cand = make_case(T, Ih, Id, V, dtype, shared=shared)
    out = triton_index_scores(q, w, keys, cand, block_v=16)
    assert_scores_close(out, paged_index_scores(q, w, keys, cand),
                        FP32_REL if dtype == torch.float32 else BF16_REL)


@pytest.mark.parametrize("block_v,bpp", [(16, 1), (16, 3), (32, 2), (64, None)])
def test_block_tiling(block_v: int, bpp: int | None) -> None:
    """Several blocks per program, a partial last split and a partial last block land correctly."""
    q, w, keys, cand = make_case(3, 4, 16, 75, torch.float32, shared=False, seed=1)
    out = triton_index_scores(q, w, keys, cand, block_v=block_v, blocks_per_program=bpp)
    assert_scores_close(out, paged_index_scores(q, w, keys, cand), FP32_REL)


def test_mixed_dtypes() -> None:
    """bf16 q against an fp32 pool (and the reverse) run the fp32 dot on the upcast values."""
    q, w, keys, cand = make_case(2, 4, 16, 20, torch.bfloat16, shared=False,
                                 key_dtype=torch.float32)
    assert_scores_close(triton_index_scores(q, w, keys, cand), paged_index_scores(q, w, keys, cand),
                        FP32_REL)
    q32, keys16 = q.float(), keys.bfloat16()
    assert_scores_close(triton_index_scores(q32, w, keys16, cand),
                        paged_index_scores(q32, w, keys16, cand), FP32_REL)


def test_all_negative_dots_give_exact_zeros() -> None:
    """ReLU zeros stay exact zeros (top-k ties depend on it), and -1 stays -inf."""
    q, w, keys, cand = make_case(2, 4, 16, 20, torch.float32, shared=False, seed=2)
    out = triton_index_scores(-q.abs(), w, keys.abs(), cand)
    valid = cand >= 0
    assert (out[valid] == 0).all() and torch.isneginf(out[~valid]).all()


def test_empty() -> None:
    q, w, keys, cand = make_case(2, 4, 16, 8, torch.float32, shared=False)
    assert triton_index_scores(q, w, keys, cand[:, :0]).shape == (2, 0)
    assert triton_index_scores(q[:0], w[:0], keys, cand[:0]).shape == (0, 8)


def test_rejects_bad_inputs() -> None:
    q, w, keys, cand = make_case(2, 4, 16, 8, torch.float32, shared=False)
    bad = {
        "candidates int32": (q, w, keys, cand.int()),
        "weights int32": (q, w.int(), keys, cand),
        "weights column stride 2": (q, torch.stack([w, w], dim=-1).flatten(1)[:, ::2], keys,
                                    cand),
        "keys int8": (q, w, keys.to(torch.int8), cand),
        "keys not contiguous": (q, w, keys.t().contiguous().t(), cand),
        "Id mismatch": (q, w, keys[:, :8].contiguous(), cand),
        "T mismatch": (q, w, keys, cand[:1]),
        "q 2-D": (q[0], w, keys, cand),
    }
    for name, args in bad.items():
        with pytest.raises(ValueError):
            triton_index_scores(*args)
            pytest.fail(f"accepted {name}")
    with pytest.raises(ValueError, match="block_v"):
        triton_index_scores(q, w, keys, cand, block_v=48)


INDEXER_SCALE = 128 ** -0.5 * 64 ** -0.5     # the V4 indexer's Id^-1/2 Ih^-1/2 (model/indexer.py)


def raw_weights(T: int, Ih: int, dtype: torch.dtype, strided: bool, device: str,
                seed: int = 0) -> torch.Tensor:
    """Unscaled head weights [T, Ih] in `dtype` like `weights_proj`'s output; `strided`: a column
    slice of a wider row (as from the layer's fused x GEMM), row stride Ih + 9, offset 5."""
    g = torch.Generator(device).manual_seed(seed)
    if not strided:
        return torch.randn(T, Ih, generator=g, device=device).to(dtype)
    wide = torch.randn(T, Ih + 9, generator=g, device=device).to(dtype)
    return wide[:, 5:5 + Ih]


WEIGHT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
WEIGHT_DTYPE_IDS = ["w-bf16", "w-fp16", "w-fp32"]


@pytest.mark.parametrize("op", [paged_index_scores, triton_index_scores], ids=["ref", "triton"])
@pytest.mark.parametrize("scale", [1.0, INDEXER_SCALE, 0.3], ids=["s1", "s-indexer", "s0.3"])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "column-slice"])
@pytest.mark.parametrize("wdtype", WEIGHT_DTYPES, ids=WEIGHT_DTYPE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_weight_scale_bit_equal_to_prescaled(op: Callable[..., torch.Tensor], scale: float,
                                             strided: bool, wdtype: torch.dtype,
                                             dtype: torch.dtype) -> None:
    """Raw weights (any float dtype, a strided column slice) + `weight_scale` give the bits of the
    op called with `weights.float() * weight_scale`: the cast and the fp32 multiply move into the
    op unchanged."""
    q, _, keys, cand = make_case(3, 8, 32, 45, dtype, shared=False, seed=4)
    w = raw_weights(3, 8, wdtype, strided, q.device.type)
    assert w.is_contiguous() != strided
    out = op(q, w, keys, cand, weight_scale=scale)
    prescaled = op(q, w.float() * scale, keys, cand)
    assert out.dtype == torch.float32 and torch.equal(out, prescaled)
    if scale == 1.0 and wdtype == torch.float32:
        assert torch.equal(op(q, w, keys, cand), out)


def test_weight_scale_triton_matches_ref() -> None:
    """The folded scale through both backends: the kernel agrees with the reference as before."""
    q, _, keys, cand = make_case(2, 8, 32, 40, torch.float32, shared=False, seed=5)
    w = raw_weights(2, 8, torch.bfloat16, True, q.device.type, seed=5)
    assert_scores_close(triton_index_scores(q, w, keys, cand, weight_scale=INDEXER_SCALE),
                        paged_index_scores(q, w, keys, cand, weight_scale=INDEXER_SCALE),
                        FP32_REL)


def reference_by_rows(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, cand: torch.Tensor,
                      budget_bytes: int = 2 << 30) -> torch.Tensor:
    """The reference materialises [T, V, Id] fp32 plus [T, Ih, V]: run it a few rows at a time."""
    T, Ih, Id = q.shape
    rows = max(1, budget_bytes // (cand.shape[1] * (Id + Ih) * 4 * 2))
    return torch.cat([paged_index_scores(q[i:i + rows], w[i:i + rows], keys, cand[i:i + rows])
                      for i in range(0, T, rows)])


@pytest.mark.gpu
@pytest.mark.parametrize("V", [4096, 65536, 262144])
@pytest.mark.parametrize("T", [1, 64, 512])
def test_parity_real_shapes_cuda(T: int, V: int) -> None:
    q, w, keys, cand = make_case(T, 64, 128, V, torch.bfloat16, shared=False, seed=T + V,
                                 device="cuda")
    out = triton_index_scores(q, w, keys, cand)
    assert_scores_close(out, reference_by_rows(q, w, keys, cand), BF16_REL)


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [False, True], ids=["decode", "prefill"])
def test_parity_fp32_ieee_cuda(shared: bool) -> None:
    q, w, keys, cand = make_case(32, 64, 128, 4096, torch.float32, shared=shared, device="cuda")
    assert_scores_close(triton_index_scores(q, w, keys, cand), paged_index_scores(q, w, keys, cand),
                        FP32_REL)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64])
@pytest.mark.parametrize("wdtype", WEIGHT_DTYPES, ids=WEIGHT_DTYPE_IDS)
def test_weight_scale_bit_equal_cuda(T: int, wdtype: torch.dtype) -> None:
    """Real shapes: raw column-sliced weights + the indexer's scale are bit-equal to the
    pre-scaled fp32 weights (bf16 16-bit dot), and to the reference within bf16 rounding."""
    q, _, keys, cand = make_case(T, 64, 128, 65536, torch.bfloat16, shared=False, seed=T,
                                 device="cuda")
    w = raw_weights(T, 64, wdtype, True, "cuda", seed=T)
    out = triton_index_scores(q, w, keys, cand, weight_scale=INDEXER_SCALE)
    assert torch.equal(out, triton_index_scores(q, w.float() * INDEXER_SCALE, keys, cand))
    assert_scores_close(out, reference_by_rows(q, w.float() * INDEXER_SCALE, keys, cand),
                        BF16_REL)


@pytest.mark.gpu
def test_cuda_graph_replay_matches_eager() -> None:
    q, w, keys, cand = make_case(8, 64, 128, 8192, torch.bfloat16, shared=False, device="cuda")
    eager = triton_index_scores(q, w, keys, cand)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = triton_index_scores(q, w, keys, cand)
    q.copy_(torch.randn_like(q))
    graph.replay()
    assert_scores_close(captured, paged_index_scores(q, w, keys, cand), BF16_REL)
    assert not torch.equal(captured, eager)
