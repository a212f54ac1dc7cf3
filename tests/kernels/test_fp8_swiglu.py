"""The FP8 linear's SwiGLU mode (`triton_fp8_linear(gate, w, scale, up=, limit=)`, the
`quant_linear` op's `up=`): the checkpoint-format shared expert's w2 computes h = swiglu(gate,
up) where it loads its input on the FMA path at M <= 2 (one launch instead of the `swiglu` op's
and the product's), with the bits of `triton_swiglu` followed by the plain call; larger M and the
other paths run those two; the shared expert's serving forward keeps its bits and calls the op
once.

CPU: the interpreter on small shapes: bf16, fp16 and fp32, M = 1..4 on the FMA path (gate / up as
the column halves of one tensor and apart, a K tail, a K split, the clamps biting; M = 3, 4 as
two launches), M = 8 (frag)
and 17 (tl.dot); validation; `MLP.forward` with FP8 w1 / w2 / w3 on the ref and triton backends.
fp32 -> bf16 casts round to nearest even as on the GPU (`round_bf16_to_nearest_even`).
GPU (`-m gpu`): V4-Flash's shared expert w2 (I 2048 -> d 4096) at M = 1..4, bit-equal to the two
launches.

    PYTHONPATH=src python -m pytest -q tests/kernels/test_fp8_swiglu.py
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dsv4.kernels.ref import quant  # noqa: E402
from dsv4.kernels.ref.fp8_linear import fp8_linear  # noqa: E402
from dsv4.kernels.ref.swiglu import swiglu  # noqa: E402
from dsv4.kernels.registry import create_kernels  # noqa: E402
from dsv4.kernels.triton import fp8_linear as fp8_module  # noqa: E402
from dsv4.kernels.triton.fp8_linear import (  # noqa: E402
    SWIGLU_MAX_M,
    plan_fp8_linear,
    triton_fp8_linear,
)
from dsv4.kernels.triton.swiglu import triton_swiglu  # noqa: E402
from dsv4.model.fused_projections import fuse_projections  # noqa: E402
from dsv4.model.moe import MLP  # noqa: E402
from dsv4.model.quant_linear import QuantLinear, linear, quantize_linears_  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LIMIT = 10.0

pytestmark = pytest.mark.usefixtures("round_bf16_to_nearest_even")


def operands(M: int, inter: int, d: int, dtype: torch.dtype, seed: int, *, halves: bool = True
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate, up ~ 6 N(0, 1) (beyond the clamp at 10 in a few percent of the elements), [M, I]:
    the two column halves of one [M, 2 I] tensor (`halves`) or two tensors; w2 [d, I] as FP8
    codes and block scales (blocks of varied scale)."""
    g = torch.Generator().manual_seed(seed)
    both = (torch.randn(M, 2 * inter, generator=g) * 6).to(DEVICE, dtype)
    w = torch.randn(d, inter, generator=g) / inter ** 0.5
    w *= torch.exp2(torch.randint(-3, 4, (d, 1), generator=g).float())
    codes, scale = quant.quant_fp8_block(w)
    gate, up = both[:, :inter], both[:, inter:]
    if not halves:
        gate, up = gate.contiguous(), up.contiguous()
    return gate, up, codes.to(DEVICE), scale.view(torch.uint8).to(DEVICE)


def counters(d: int) -> torch.Tensor:
    return torch.zeros(-(-d // 16), dtype=torch.int32, device=DEVICE)


def no_swiglu_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the wrapper's separate SwiGLU launch fail: the call must compute h in the kernel."""
    def fail(*args: Any) -> torch.Tensor:
        raise AssertionError("the SwiGLU mode ran the separate SwiGLU launch")
    monkeypatch.setattr(fp8_module, "triton_swiglu", fail)


FMA_DTYPES = [pytest.param(torch.bfloat16, id="dtype0"), pytest.param(torch.float16, id="dtype1"),
              pytest.param(torch.float32, id="dtype2")]
# Every M in every dtype. The layout of gate / up (halves of one tensor: row stride 2 I; apart: I)
# is a runtime stride, alternating so that each M and each dtype runs both layouts.
FMA_CASES = [pytest.param(M, dt.values[0], (M + i) % 2 == 0,
                          id=f"{'halves' if (M + i) % 2 == 0 else 'separate'}-{dt.id}-{M}")
             for M in (1, 2, 3, 4) for i, dt in enumerate(FMA_DTYPES)]


@pytest.mark.parametrize(("M", "dtype", "halves"), FMA_CASES)
def test_fma_path_bits_equal_swiglu_then_linear(M: int, dtype: torch.dtype, halves: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """I = 1100: a K tail (1100 % 512 at M <= 2's four blocks a step, % 256 at M = 3, 4), three
    K splits at odd M (the plan splits no K this short at M <= 2); d = 200: two scale-block
    rows, a partial N tile. M = 3, 4 (above SWIGLU_MAX_M) run `triton_swiglu` first."""
    gate, up, w, s = operands(M, 1100, 200, dtype, seed=M, halves=halves)
    assert (gate.abs() > LIMIT).any() and (up.abs() > LIMIT).any(), "the clamps must bite"
    assert not plan_fp8_linear(M, 200, 1100, 132).dot
    knobs = {"split_k": 3} if M % 2 else {}
    want = triton_fp8_linear(triton_swiglu(gate, up, LIMIT), w, s, counters=counters(200),
                             **knobs)
    held = counters(200)
    launches: list[int] = []
    if M <= SWIGLU_MAX_M:
        no_swiglu_launch(monkeypatch)
    else:                                   # above: the two launches, by design
        def counted(*args: Any) -> torch.Tensor:
            launches.append(1)
            return triton_swiglu(*args)
        monkeypatch.setattr(fp8_module, "triton_swiglu", counted)
    got = triton_fp8_linear(gate, w, s, up=up, limit=LIMIT, counters=held, **knobs)
    assert len(launches) == (0 if M <= SWIGLU_MAX_M else 1)
    assert got.dtype == dtype and got.shape == (M, 200)
    assert torch.equal(got, want)
    assert int(held.abs().sum()) == 0, "split-K counters left non-zero"
    # the reference in float64 from h in x's dtype (the reference `swiglu`, rounded as the
    # kernel rounds h): within the output's rounding and fp32 sums of the largest value
    h = swiglu(gate, up, LIMIT).double()
    ref = F.linear(h, quant.dequant_fp8_block(w, s, torch.float64))
    assert torch.equal(fp8_linear(gate, w, s, up=up, limit=LIMIT),
                       fp8_linear(swiglu(gate, up, LIMIT), w, s))
    bound = (2.0**-8 if dtype != torch.float32 else 0.0) * ref.abs() + 1e-5 * ref.abs().max()
    assert bool(((got.double() - ref).abs() <= bound).all())


@pytest.mark.parametrize("knobs", [{"split_k": 1}, {"kb": 1, "split_k": 3}, {"block_n": 16}])
def test_fma_knobs(knobs: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A limit bf16 cannot represent (7.3: the clamped elements round as the reference's do)."""
    gate, up, w, s = operands(2, 520, 130, torch.bfloat16, seed=7)
    want = triton_fp8_linear(triton_swiglu(gate, up, 7.3), w, s, **knobs)
    no_swiglu_launch(monkeypatch)
    assert torch.equal(triton_fp8_linear(gate, w, s, up=up, limit=7.3, **knobs), want)


# d = 24 on the frag path (the interpreter runs a program per 16-row tile and 128-k step): two
# tiles, the last partial; the frag path over several scale-block rows is test_fp8_linear.py's
# test_frag_path (N = 136)
@pytest.mark.parametrize(("M", "d", "path"), [(8, 24, "frag"), (17, 200, "dot")])
def test_other_paths_run_swiglu_first(M: int, d: int, path: str) -> None:
    """Above SWIGLU_MAX_M the frag (M 8) and tl.dot (M 17) paths take h from `triton_swiglu`
    and give its bits; I = 512: several K blocks per split."""
    gate, up, w, s = operands(M, 512, d, torch.bfloat16, seed=M)
    plan = plan_fp8_linear(M, d, 512, 132, frag_ok=True)
    assert (plan.frag if path == "frag" else plan.dot)
    # as planned on the CPU: the frag path's 4 steps in 2 splits, tl.dot's unsplit
    assert plan_fp8_linear(M, d, 512, 1, frag_ok=True).split_k == (2 if path == "frag" else 1)
    want = triton_fp8_linear(triton_swiglu(gate, up, LIMIT), w, s)
    assert torch.equal(triton_fp8_linear(gate, w, s, up=up, limit=LIMIT), want)


def test_validation() -> None:
    gate, up, w, s = operands(2, 256, 256, torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match="up must match x"):
        triton_fp8_linear(gate, w, s, up=up[:, :128], limit=LIMIT)
    with pytest.raises(ValueError, match="up must match x"):
        triton_fp8_linear(gate, w, s, up=up.half(), limit=LIMIT)
    with pytest.raises(ValueError, match="takes groups 1"):
        triton_fp8_linear(gate.reshape(1, 2, 256), w, s, groups=2, up=up.reshape(1, 2, 256))
    with pytest.raises(ValueError, match="takes groups 1"):
        fp8_linear(gate.reshape(1, 2, 256), w, s, groups=2, up=up.reshape(1, 2, 256))


@pytest.mark.parametrize("backend", ["ref", "triton"])
@pytest.mark.parametrize("M", [1, 3, 9])
@pytest.mark.parametrize("fuse", [True, False], ids=["w13-fused", "w13-apart"])
def test_shared_expert_keeps_its_bits(backend: str, M: int, fuse: bool) -> None:
    """`MLP.forward` on the serving path with FP8 w1 / w2 / w3: w2's `quant_linear` call in the
    SwiGLU mode, one op call, whose output equals the `swiglu` op then `quant_linear` bit for
    bit."""
    torch.manual_seed(M)
    mlp = MLP(128, 256, LIMIT).to(DEVICE, torch.bfloat16)
    assert sorted(quantize_linears_(mlp, {"w1", "w2", "w3"})) == ["w1", "w2", "w3"]
    if fuse:
        assert fuse_projections(mlp) == 1
    ops = create_kernels(backend)  # type: ignore[arg-type]
    x = (torch.randn(M, 128) * 4).to(DEVICE, torch.bfloat16)
    gate, up = (mlp.fused_w13(x, mlp.fused_w13.gemm(ops)) if mlp.fused_w13 is not None
                else (linear(mlp.w1, x, ops), linear(mlp.w3, x, ops)))
    assert isinstance(mlp.w2, QuantLinear)
    want = mlp.w2(ops.swiglu(gate, up, LIMIT), ops)
    calls: list[bool] = []

    def spied(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(kwargs.get("up") is not None)
        return ops.quant_linear(*args, **kwargs)
    ctx: Any = SimpleNamespace(ops=SimpleNamespace(
        **{n: getattr(ops, n) for n in ("linear", "swiglu")}, quant_linear=spied))
    with torch.no_grad():
        assert torch.equal(mlp(x, ctx), want)
    assert calls == [False] * (1 if fuse else 2) + [True]


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 2, 3, 4])
def test_gpu_flash_shared_expert(M: int) -> None:
    """V4-Flash: I 2048 -> d 4096; gate / up the halves of the fused w1 | w3 output, and apart."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for halves in (True, False):
        gate, up, w, s = operands(M, 2048, 4096, torch.bfloat16, seed=M, halves=halves)
        held = counters(4096)
        want = triton_fp8_linear(triton_swiglu(gate, up, LIMIT), w, s, counters=counters(4096))
        assert torch.equal(triton_fp8_linear(gate, w, s, up=up, limit=LIMIT, counters=held),
                           want)
        assert int(held.abs().sum()) == 0
