"""Parity of `triton_fp8_linear` (kernels/triton/fp8_linear.py) with its reference
`ref/fp8_linear.py::fp8_linear` (dequantise, then F.linear), plan and validation.

Reference: F.linear of x and the dequantised weight in float64. Tolerance, with scale = max
|y_ref|: fp32 outputs within 2e-6 * scale (exact products, fp32 sums in another order); bf16
outputs within half an output ulp of y_ref + 2e-6 * scale (the final rounding).

CPU: the interpreter at M in {1, 3, 17, 200} with N, K not multiples of 128, bf16 and fp32, the
FMA and tl.dot inner products, split-K off and on (counters left zero), row-strided x, a
3-D x; two calls bit-equal; the host plan; shape errors. The interpreter's fp32 -> bf16 cast
truncates; the tests patch it to round to nearest even, as the GPU does.
Engine (slow): micro with its FP8 linears in their encoding served by the `triton` backend
against those linears dequantised on `ref`: greedy tokens equal, log-probs within 1e-5.
GPU (`-m gpu`): the V4-Flash FP8 linears (benchmarks/kernels/bench_fp8_linear.py) at M = 1, 8,
32, 512, 2048 against the reference (at 512 and 2048 also the tiles, pinned).
CPU: from DEQUANT_MIN_M rows the decoded weight's F.linear, equal to the reference.

    PYTHONPATH=src python -m pytest -q tests/kernels/test_fp8_linear.py
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dsv4 import EngineConfig, SamplingParams  # noqa: E402
from dsv4.checkpoint.presets import micro  # noqa: E402
from dsv4.checkpoint.writer import random_model  # noqa: E402
from dsv4.config.engine import KernelBackend  # noqa: E402
from dsv4.engine.engine import LLMEngine  # noqa: E402
from dsv4.kernels.ref import quant  # noqa: E402
from dsv4.kernels.ref.fp8_linear import fp8_linear  # noqa: E402
from dsv4.kernels.triton.fp8_linear import plan_fp8_linear, triton_fp8_linear  # noqa: E402
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM  # noqa: E402
from dsv4.model.quant_linear import (  # noqa: E402
    QuantLinear,
    dequantize_linears_,
    quantize_linears_,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16, F32 = torch.bfloat16, torch.float32
HALF_ULP = {BF16: 2.0**-8, F32: 0.0}
# (N, K) of flash-4l's FP8 linears: wq_a, wkv, wq_b, indexer wq_b, wo_a (one group), wo_b,
# shared w1 / w3, shared w2
FLASH_SHAPES = [(1024, 4096), (512, 4096), (32768, 1024), (8192, 1024), (1024, 4096),
                (4096, 8192), (2048, 4096), (4096, 2048)]


pytestmark = pytest.mark.usefixtures("round_bf16_to_nearest_even")


def operands(M: int, N: int, K: int, dtype: torch.dtype,
             seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K], and an FP8 weight [N, K] with varied block scales (codes, scale)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g) / K**0.5
    w *= torch.exp2(torch.randint(-3, 4, (N, 1), generator=g).float())   # blocks differ
    codes, scale = quant.quant_fp8_block(w)
    return x.to(DEVICE), codes.to(DEVICE), scale.view(torch.uint8).to(DEVICE)


def assert_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> None:
    ref = F.linear(x.double(), quant.dequant_fp8_block(w, s, torch.float64))
    assert y.shape == ref.shape and y.dtype == x.dtype
    scale = float(ref.abs().max().clamp_min(1e-30))
    bound = HALF_ULP[y.dtype] * ref.abs() + 2e-6 * scale
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), f"max err {float(err.max()):.3g}, scale {scale:.3g}"


@pytest.mark.parametrize("M", [1, 3, 17, 200])
@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize(("N", "K"), [(200, 300), (130, 256), (64, 129)])
def test_matches_reference(M: int, dtype: torch.dtype, N: int, K: int) -> None:
    x, w, s = operands(M, N, K, dtype)
    y = triton_fp8_linear(x, w, s)
    assert_close(y, x, w, s)
    ref = fp8_linear(x, w, s)
    assert ref.dtype == y.dtype and ref.shape == y.shape


@pytest.mark.parametrize("knobs", [{"split_k": 1}, {"split_k": 3}, {"dot": True, "split_k": 2},
                                   {"dot": False, "block_n": 16}, {"block_n": 128},
                                   {"dot": False, "kb": 1}, {"dot": False, "kb": 2, "split_k": 2}])
def test_knobs_and_split_k(knobs: dict[str, Any]) -> None:
    """N = 140: two scale-block rows, the last partial, and a partial last tile at every block_n;
    K = 520: a K tail."""
    x, w, s = operands(3, 140, 520, F32, seed=1)
    counters = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    y = triton_fp8_linear(x, w, s, counters=counters, **knobs)
    assert_close(y, x, w, s)
    assert int(counters.abs().sum()) == 0
    assert torch.equal(y, triton_fp8_linear(x, w, s, counters=counters, **knobs))


def test_strided_and_batched_x() -> None:
    """M = 6 (the frag path); N = 24: a partial last tile (N tails at several scale-block rows:
    test_frag_path)."""
    x, w, s = operands(6, 24, 256, BF16, seed=2)
    wide = torch.cat((x, x), dim=1)[:, :256]                 # row stride 512
    assert_close(triton_fp8_linear(wide, w, s), x, w, s)
    y3 = triton_fp8_linear(x.view(2, 3, 256), w, s)
    assert y3.shape == (2, 3, 24)
    assert torch.equal(y3.view(6, 24), triton_fp8_linear(x, w, s))


@pytest.mark.parametrize(("M", "knobs"), [(1, {}), (3, {"split_k": 1}), (5, {"dot": True}),
                                           (2, {"dot": False, "kb": 1, "split_k": 3})])
def test_groups_match_per_group_products(M: int, knobs: dict[str, Any]) -> None:
    """groups=g (attention's wo_a): x [M, g, K] -> [M, g, N / g], group i through weight rows
    [i N / g, (i + 1) N / g), in one launch: each group as the ungrouped kernel's product of its
    own rows, within the tolerance (the split plans differ), and the reference's form."""
    g, rows, K = 3, 128, 640
    x, w, s = operands(M * g, g * rows, K, BF16, seed=5)
    x3 = x.view(M, g, K)
    y = triton_fp8_linear(x3, w, s, groups=g, **knobs)
    assert y.shape == (M, g, rows)
    blocks = rows // 128
    for i in range(g):
        wi, si = w[i * rows:(i + 1) * rows], s[i * blocks:(i + 1) * blocks]
        assert_close(y[:, i], x3[:, i].contiguous(), wi, si)
    ref = fp8_linear(x3.float(), w, s, groups=g)
    assert ref.shape == y.shape
    assert float((ref - y.float()).abs().max()) <= 2.0**-7 * float(ref.abs().max())
    with pytest.raises(ValueError, match="groups"):
        triton_fp8_linear(x3, w[:200], s[:2], groups=g)


# K 640 (5 steps): K splits of uneven length (3 + 2 by default, 2 + 2 + 1 with split_k 3), over
# N = 24 (two tiles of 16 rows, the last partial: the interpreter runs a program per tile and
# step); block_n 64 reads N = 136 (a partial last scale-block row and row tile) in 2 unsplit steps.
@pytest.mark.parametrize(("M", "N", "K", "knobs"), [(1, 24, 640, {}), (5, 24, 640, {"split_k": 3}),
                                                    (8, 24, 640, {"block_n": 16}),
                                                    (2, 136, 256, {"block_n": 64, "split_k": 1})])
def test_frag_path(M: int, N: int, K: int, knobs: dict[str, Any]) -> None:
    """The tensor-core decode path (bf16 x, M <= 8, K % 128 == 0): within the tolerance of the
    reference, counters left zero, and a token's row the same bits in a batch of 1 and of M (the
    plan does not depend on M)."""
    x, w, s = operands(M, N, K, BF16, seed=6)
    counters = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    assert plan_fp8_linear(M, N, K, 132, frag_ok=True).frag == (M > 4)   # the default
    assert plan_fp8_linear(M, N, K, 1, frag=True, frag_ok=True, **knobs).split_k == (
        knobs.get("split_k", 2))
    y = triton_fp8_linear(x, w, s, frag=True, counters=counters, **knobs)
    assert_close(y, x, w, s)
    assert int(counters.abs().sum()) == 0
    one = triton_fp8_linear(x[-1:].contiguous(), w, s, frag=True, counters=counters, **knobs)
    assert torch.equal(one[0], y[-1])


def test_frag_refusals() -> None:
    x, w, s = operands(2, 128, 256, F32)
    with pytest.raises(ValueError, match="frag=True needs bf16"):
        triton_fp8_linear(x, w, s, frag=True)
    xb = x.to(BF16)
    with pytest.raises(ValueError, match="frag=True takes block_n"):
        triton_fp8_linear(xb, w, s, frag=True, block_n=128)
    assert not plan_fp8_linear(9, 128, 256, 132, frag_ok=True).frag      # M > 8: tl.dot
    assert not plan_fp8_linear(4, 128, 256, 132, frag_ok=True).frag      # M <= 4: FMA
    assert not plan_fp8_linear(1, 128, 200, 132).frag                   # not frag_ok


def test_float8_dtype_and_uint8_codes_agree() -> None:
    x, w, s = operands(2, 128, 128, F32, seed=3)
    assert torch.equal(triton_fp8_linear(x, w, s), triton_fp8_linear(x, w.view(torch.uint8), s))
    assert torch.equal(fp8_linear(x, w, s), fp8_linear(x, w.view(torch.uint8), s))


def test_errors_name_the_argument() -> None:
    x, w, s = operands(2, 130, 256, F32)
    with pytest.raises(ValueError, match="scale must be"):
        triton_fp8_linear(x, w, s[:1])
    with pytest.raises(ValueError, match="w must be"):
        triton_fp8_linear(x, w.float(), s)
    with pytest.raises(ValueError, match="block_n must divide"):
        triton_fp8_linear(x, w, s, block_n=256)
    with pytest.raises(ValueError, match="split_k > 1 needs one M tile"):
        plan_fp8_linear(300, 128, 1024, 132, split_k=2)


def test_plan_at_h200_shapes() -> None:
    decode = plan_fp8_linear(1, 1024, 4096, 132)
    assert not decode.dot and decode.split_k > 1 and 128 % decode.block_n == 0
    # M <= 2, K <= 2048: no K split; rows per program halved, down to 8 per x row, while the
    # programs stay <= 8 per SM
    for M, rows in ((1, 8), (2, 16)):
        assert plan_fp8_linear(M, 8192, 1024, 132).split_k == 1
        assert plan_fp8_linear(M, 8192, 1024, 132).block_n == rows   # <= 1024 programs
        assert plan_fp8_linear(M, 4096, 2048, 132).block_n == rows
        assert plan_fp8_linear(M, 4096, 2048, 132).split_k == 1
        assert plan_fp8_linear(M, 32768, 1024, 132).block_n == 32    # 1024 programs
        assert plan_fp8_linear(M, 100, 256, 132).block_n == rows
    assert plan_fp8_linear(4, 8192, 1024, 132).split_k > 1               # M = 4: split as before
    assert plan_fp8_linear(1, 4096, 2048, 132, split_k=4).split_k == 4   # a given knob holds
    assert plan_fp8_linear(1, 4096, 2048, 132, block_n=32).split_k > 1
    mid = plan_fp8_linear(32, 4096, 8192, 132)
    assert mid.dot and mid.block_m == 32 and mid.split_k >= 1
    prefill = plan_fp8_linear(2048, 32768, 1024, 132)
    assert prefill.dot and prefill.split_k == 1 and (prefill.block_m, prefill.block_n) == (128,
                                                                                            128)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("N", "K"), sorted(set(FLASH_SHAPES)))
@pytest.mark.parametrize("M", [1, 8, 32, 512, 2048])
def test_flash_shapes_on_gpu(M: int, N: int, K: int) -> None:
    """The default path at each M (from DEQUANT_MIN_M the decoded weight and F.linear), and at
    prefill M the tiles too (`dot=True`)."""
    x, w, s = operands(M, N, K, BF16, seed=M)
    if M < 512:
        assert_close(triton_fp8_linear(x, w, s), x, w, s)
        return
    assert torch.equal(triton_fp8_linear(x, w, s), fp8_linear(x, w, s))   # the same F.linear
    assert_close(triton_fp8_linear(x, w, s, dot=True), x, w, s)


@pytest.mark.slow  # the whole engine's kernels under the Triton interpreter
@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs a CUDA GPU or the Triton interpreter")
def test_engine_triton_serves_like_dequantised() -> None:
    """A CSA layer's linears that the checkpoint stores in FP8 (`quantize_linears_`: the official
    set's every kind, the grouped wo_a, the indexer's wq_b and the shared expert's w1 / w2 / w3
    included) served by the `triton` backend (through `triton_fp8_linear`) give the greedy
    tokens of the model with those linears dequantised (`ref` backend, fp32), chosen log-probs
    within 1e-5. Prefill: 5 rows (the tl.dot path of fp32 x); decode: 2 rows (the FMA path, w2
    in the SwiGLU mode). Loading a checkpoint in that encoding: tests/model/test_quant_linear.py.
    """
    model = random_model(micro(), torch.float32, torch.device(DEVICE), seed=4)
    assert len(quantize_linears_(model.layers[3])) == 9
    dense = copy.deepcopy(model)
    dequantize_linears_(dense, torch.float32)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, logprobs=1)
    prompts = [[5, 9, 17], [7, 100]]
    outs = []
    runs: tuple[tuple[DeepSeekV4ForCausalLM, KernelBackend], ...] = ((dense, "ref"),
                                                                      (model, "triton"))
    for m, backend in runs:
        engine = LLMEngine(m, EngineConfig(page_size=16, max_total_tokens=512,
                                           kernel_backend=backend,
                                           index_cache_dtype="model"))  # one key format for both
        if backend == "triton":
            assert engine.runner.ops.quant_linear is triton_fp8_linear
            assert any(isinstance(q, QuantLinear) for q in m.modules())
        reqs = [engine.add_request(p, params) for p in prompts]
        while engine.has_unfinished():
            engine.step()
        outs.append(reqs)
    assert not any(isinstance(q, QuantLinear) for q in dense.modules())
    for a, b in zip(*outs, strict=True):
        assert a.output_ids == b.output_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5


@pytest.mark.parametrize("groups", [1, 2])
def test_prefill_rows_take_the_decoded_weight(groups: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """From DEQUANT_MIN_M rows (lowered here to keep the interpreter quick) the default call
    decodes the weight and runs the reference's own product: equal to `fp8_linear` (bf16 and
    fp32, one group or the grouped wo_a), the SwiGLU mode included; a pinned knob keeps the
    tiles."""
    from dsv4.kernels.triton import fp8_linear as mod

    monkeypatch.setattr(mod, "DEQUANT_MIN_M", 8)
    for dtype in (BF16, F32):
        x, w, s = operands(9, 256 * groups, 384, dtype, seed=groups)
        if groups > 1:
            x = torch.stack([x, x.flip(0)], 1)                     # [M, 2, K]
        ref = fp8_linear(x, w, s, groups=groups)
        assert torch.equal(triton_fp8_linear(x, w, s, groups=groups), ref)
    gate, up = (operands(9, 256, 384, BF16, seed=s_)[0] for s_ in (5, 6))
    ref = fp8_linear(gate, w, s, up=up, limit=7.0)
    assert torch.equal(triton_fp8_linear(gate, w, s, up=up, limit=7.0), ref)
    calls: list[int] = []
    monkeypatch.setattr(mod, "_dequant_linear", lambda *a: calls.append(1))
    triton_fp8_linear(gate, w, s, dot=True)
    assert not calls
