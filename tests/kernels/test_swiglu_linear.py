"""The `swiglu_linear` op (`kernels/triton/swiglu_linear.py::triton_swiglu_linear`): the shared
expert's SwiGLU computed inside its w2 decode GEMV (one launch) has the bits of `triton_swiglu`
followed by `triton_decode_linear` (the two launches it replaces); outside the decode shape the
call is those two launches; the model's serving path keeps its bits.

CPU: the interpreter on small shapes: bf16 and fp16, M = 1..4, gate / up as the column halves of
one [M, 2 I] tensor and as separate tensors, a K tail, a K split, values beyond the clamp, a limit
bf16 cannot represent; the fallbacks; the counters left zero; validation; the registry's ops; the
shared expert's forward with and without w2's counters. fp32 -> bf16 casts round to nearest even
as on the GPU (`round_bf16_to_nearest_even`).
GPU (`-m gpu`): V4-Flash's shared expert (I 2048 -> d 4096, bf16 / fp16, M = 1..4) bit-equal to
the two launches, eager and inside a CUDA graph.

    PYTHONPATH=src python -m pytest -q tests/kernels/test_swiglu_linear.py
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import torch

# NOTE: must precede the first `import triton` (tests/kernels/conftest.py may already do this).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dsv4.kernels.ops import DECODE_BLOCK_N  # noqa: E402
from dsv4.kernels.ref.moe import swiglu, swiglu_linear  # noqa: E402
from dsv4.kernels.registry import create_kernels  # noqa: E402
from dsv4.kernels.triton import swiglu_linear as fused_module  # noqa: E402
from dsv4.kernels.triton.gemv import triton_decode_linear, triton_linear  # noqa: E402
from dsv4.kernels.triton.swiglu import triton_swiglu  # noqa: E402
from dsv4.kernels.triton.swiglu_linear import (  # noqa: E402
    triton_swiglu_linear,
    triton_swiglu_linear_invariant,
)
from dsv4.model.decode_gemv import attach_decode_gemv  # noqa: E402
from dsv4.model.fused_projections import fuse_projections  # noqa: E402
from dsv4.model.moe import MLP  # noqa: E402
from dsv4.model.quant_linear import GEMV_COUNTERS, linear  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LIMIT = 10.0

pytestmark = pytest.mark.usefixtures("round_bf16_to_nearest_even")


def operands(M: int, inter: int, d: int, dtype: torch.dtype, seed: int, *,
             halves: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate, up ~ 6 N(0, 1) (beyond the clamp at 10 in a few percent of the elements), [M, I]:
    the two column halves of one [M, 2 I] tensor (`halves`) or two tensors; w [d, I]."""
    g = torch.Generator().manual_seed(seed)
    both = (torch.randn(M, 2 * inter, generator=g) * 6).to(DEVICE, dtype)
    w = (torch.randn(d, inter, generator=g) / inter ** 0.5).to(DEVICE, dtype)
    gate, up = both[:, :inter], both[:, inter:]
    if not halves:
        gate, up = gate.contiguous(), up.contiguous()
    return gate, up, w


def counters(d: int) -> torch.Tensor:
    return torch.zeros(-(-d // DECODE_BLOCK_N), dtype=torch.int32, device=DEVICE)


def two_launches(gate: torch.Tensor, up: torch.Tensor, limit: float, w: torch.Tensor,
                 held: torch.Tensor | None) -> torch.Tensor:
    """Today's serving path: the `swiglu` op, then the `linear` op."""
    return triton_decode_linear(triton_swiglu(gate, up, limit), w, counters=held)


def no_swiglu_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the wrapper's fallback (the separate SwiGLU launch) fail: the call must be fused."""
    def fail(*args: Any) -> torch.Tensor:
        raise AssertionError("the fused call ran the separate SwiGLU launch")
    monkeypatch.setattr(fused_module, "triton_swiglu", fail)


@pytest.mark.parametrize("M", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("halves", [True, False], ids=["halves", "separate"])
def test_bits_equal_swiglu_then_linear(M: int, dtype: torch.dtype, halves: bool,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """I = 1100: a K split (1100 // 1024) and a K tail (1100 % 256 = 76 at bf16's BLOCK_K); d = 40:
    a partial N tile."""
    gate, up, w = operands(M, 1100, 40, dtype, seed=M, halves=halves)
    assert (gate.abs() > LIMIT).any() and (up.abs() > LIMIT).any(), "the clamps must bite"
    want = two_launches(gate, up, LIMIT, w, counters(40))
    held = counters(40)
    assert fused_module.fused(gate, up, w, held)
    no_swiglu_launch(monkeypatch)
    got = triton_swiglu_linear(gate, up, LIMIT, w, counters=held)
    assert got.dtype == dtype and got.shape == (M, 40) and got.is_contiguous()
    assert torch.equal(got, want)
    assert int(held.abs().sum()) == 0, "split-K counters left non-zero"
    ref = F.linear(swiglu(gate, up, LIMIT).float(), w.float())
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)


def test_limit_not_representable_and_one_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """limit 7.3 (not a bf16 value: the clamped elements round to bf16 as the reference's do);
    I = 300 < DECODE_SPLIT_K: one split, a K tail."""
    gate, up, w = operands(2, 300, 24, torch.bfloat16, seed=5)
    want = two_launches(gate, up, 7.3, w, counters(24))
    no_swiglu_launch(monkeypatch)
    assert torch.equal(triton_swiglu_linear(gate, up, 7.3, w, counters=counters(24)), want)


def test_row_bits_do_not_depend_on_the_other_rows() -> None:
    gate, up, w = operands(4, 512, 32, torch.bfloat16, seed=3)
    alone = triton_swiglu_linear(gate[2:3], up[2:3], LIMIT, w, counters=counters(32))
    assert torch.equal(triton_swiglu_linear(gate, up, LIMIT, w, counters=counters(32))[2:3],
                       alone)


@pytest.mark.parametrize("case", ["no counters", "many rows", "fp32", "3-d", "few counters"])
def test_fallbacks_are_the_two_launches(case: str) -> None:
    """Outside the decode shape: `triton_swiglu`, then `triton_decode_linear` (F.linear here),
    which is the reference composition (`ref/moe.py::swiglu_linear`; bit-equal on a GPU)."""
    dtype = torch.float32 if case == "fp32" else torch.bfloat16
    gate, up, w = operands(9 if case == "many rows" else 2, 300, 24, dtype, seed=1)
    if case == "3-d":
        gate, up = gate.reshape(1, 2, 300), up.reshape(1, 2, 300)
    held = None if case == "no counters" else counters(24 if case != "few counters" else 16)
    assert not fused_module.fused(gate, up, w, held)
    got = triton_swiglu_linear(gate, up, LIMIT, w, counters=held)
    assert torch.equal(got, two_launches(gate, up, LIMIT, w, held))
    want = swiglu_linear(gate, up, LIMIT, w)
    if case != "3-d" and case != "few counters":
        assert torch.equal(got, F.linear(triton_swiglu(gate, up, LIMIT), w))
    if DEVICE == "cuda":
        assert torch.equal(got, want)
    else:       # the interpreter's silu is a few fp32 ulp off torch's (test_swiglu.py)
        torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 2 ** -7,
                                   atol=1e-5)
    if held is not None:
        assert int(held.abs().sum()) == 0


def test_validation() -> None:
    gate, up, w = operands(2, 64, 16, torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="FMA path"):
        triton_linear(gate, w, up=up, limit=LIMIT, dot=True)
    with pytest.raises(ValueError, match="up must match"):
        triton_linear(gate, w, up=up[:1], limit=LIMIT)
    with pytest.raises(ValueError, match="up must match"):
        triton_linear(gate, w, up=up.half(), limit=LIMIT)


def test_registry_ops() -> None:
    assert create_kernels("ref").swiglu_linear is swiglu_linear
    assert create_kernels("triton").swiglu_linear is triton_swiglu_linear
    invariant = create_kernels("triton", invariant_plans=True).swiglu_linear
    assert invariant is triton_swiglu_linear_invariant
    gate, up, w = operands(2, 300, 24, torch.bfloat16, seed=2)
    assert torch.equal(invariant(gate, up, LIMIT, w, counters=counters(24)),
                       F.linear(triton_swiglu(gate, up, LIMIT), w))


@pytest.mark.parametrize("backend", ["ref", "triton"])
@pytest.mark.parametrize("M", [1, 3, 9])
@pytest.mark.parametrize("fuse", [True, False], ids=["w13-fused", "w13-apart"])
def test_shared_expert_keeps_its_bits(backend: str, M: int, fuse: bool,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`MLP.forward` on the serving path: with w2's counters the op `swiglu_linear`, whose output
    equals the former `swiglu` then `linear` calls bit for bit; without them those calls."""
    torch.manual_seed(M)
    mlp = MLP(64, 300, LIMIT).to(DEVICE, torch.bfloat16)
    if fuse:
        assert fuse_projections(mlp) == 1
    assert attach_decode_gemv(mlp) == 3 + fuse
    ops = create_kernels(backend)  # type: ignore[arg-type]
    ctx: Any = SimpleNamespace(ops=ops)
    x = (torch.randn(M, 64) * 4).to(DEVICE, torch.bfloat16)
    gate, up = (mlp.fused_w13(x, mlp.fused_w13.gemm(ops)) if mlp.fused_w13 is not None
                else (linear(mlp.w1, x, ops), linear(mlp.w3, x, ops)))
    want = linear(mlp.w2, ops.swiglu(gate, up, LIMIT), ops)
    calls: list[int] = []
    op = ops.swiglu_linear

    def spied(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return op(*args, **kwargs)
    ctx.ops = SimpleNamespace(**{n: getattr(ops, n) for n in ("linear", "swiglu")},
                              swiglu_linear=spied)
    with torch.no_grad():
        assert torch.equal(mlp(x, ctx), want)
        assert calls == [1]
        assert not getattr(mlp.w2, GEMV_COUNTERS).any()
        attach_decode_gemv(mlp, on=False)
        assert torch.equal(mlp(x, SimpleNamespace(ops=ops)), F.linear(
            ops.swiglu(mlp.w1(x), mlp.w3(x), LIMIT), mlp.w2.weight))
        assert calls == [1]


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_flash_shared_expert(M: int, dtype: torch.dtype) -> None:
    """V4-Flash: I 2048 -> d 4096; gate / up the halves of the fused w1 | w3 output, and apart."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for halves in (True, False):
        gate, up, w = operands(M, 2048, 4096, dtype, seed=M, halves=halves)
        held = counters(4096)
        assert fused_module.fused(gate, up, w, held)
        want = two_launches(gate, up, LIMIT, w, counters(4096))
        assert torch.equal(triton_swiglu_linear(gate, up, LIMIT, w, counters=held), want)
        ref = F.linear(swiglu(gate, up, LIMIT).float(), w.float())
        torch.testing.assert_close(want.float(), ref, rtol=2e-2, atol=2e-2)
        assert int(held.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 4])
def test_gpu_cuda_graph(M: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gate, up, w = operands(M, 2048, 4096, torch.bfloat16, seed=10 + M)
    held = counters(4096)
    want = two_launches(gate, up, LIMIT, w, counters(4096))
    triton_swiglu_linear(gate, up, LIMIT, w, counters=held)       # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = triton_swiglu_linear(gate, up, LIMIT, w, counters=held)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)
        assert int(held.abs().sum()) == 0
