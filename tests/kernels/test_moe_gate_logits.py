"""The MoE gate's logits: `triton_moe_gate_logits` (a decode GEMV with the call site's split-K
counters) vs `ref.moe.moe_gate_logits` (`F.linear(u.float(), weight.float())`), and the gate's use
of the op (spec §8).

CPU (the Triton interpreter): decode calls (1-4 rows, bf16 / fp16, E and K tails, one or several
K splits, a row stride) within the fp32 sum-order bound, counters left zero; every other call (no
counters, more rows, fp32 operands) is the reference bit for bit; `Gate` under
`ForwardMode.values` keeps the reference logits (its ids and weights equal the ops' chain) and the
reference GEMM's gradient.
GPU (`-m gpu`): V4-Flash shapes (E 256, d 4096; N = 1..4), run to run bit-identical, CUDA-graph
capture and replay; the prefill GEMM (N = 5, 8192) within the sum-order bound.

    PYTHONPATH=src python -m pytest -q tests/kernels/test_moe_gate_logits.py
"""

from __future__ import annotations

import os

import torch

# NOTE: must precede the first `import triton` (tests/kernels/conftest.py may already do this).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from dsv4.checkpoint.presets import micro  # noqa: E402
from dsv4.kernels.ops import DECODE_BLOCK_N  # noqa: E402
from dsv4.kernels.ref.moe import moe_gate_logits  # noqa: E402
from dsv4.kernels.registry import create_kernels  # noqa: E402
from dsv4.kernels.triton.moe_gate import triton_moe_gate_select  # noqa: E402
from dsv4.kernels.triton.moe_gate_logits import gate_plan, triton_moe_gate_logits  # noqa: E402
from dsv4.model.moe import Gate  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 sums in another order: a few ulp of the largest partial sums
REL = 1e-6
# ... in the tensor cores' fp32 accumulation (not round-to-nearest at every add): the bound
# `test_project_gemv.py` holds the same cuBLAS path to
REL_TC = 1e-5


def operands(N: int, E: int, d: int, dtype: torch.dtype,
             seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(DEVICE).manual_seed(seed)
    u = torch.randn(N, d, generator=g, device=DEVICE).to(dtype)
    w = (torch.randn(E, d, generator=g, device=DEVICE) * d ** -0.5).to(dtype)
    return u, w


def counters(E: int) -> torch.Tensor:
    return torch.zeros(-(-E // DECODE_BLOCK_N), dtype=torch.int32, device=DEVICE)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("N,E,d", [(1, 16, 64), (2, 33, 300), (4, 40, 1100), (3, 256, 1024)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_decode_parity(N: int, E: int, d: int, dtype: torch.dtype) -> None:
    u, w = operands(N, E, d, dtype)
    cnt = counters(E)
    got = triton_moe_gate_logits(u, w, counters=cnt)
    assert got.dtype == torch.float32 and got.shape == (N, E) and got.is_contiguous()
    assert _rel(got, moe_gate_logits(u, w)) <= REL
    assert not cnt.any(), "every call leaves its counters zero"
    assert torch.equal(got, triton_moe_gate_logits(u, w, counters=cnt))      # run to run


def test_plan_and_strided_rows() -> None:
    """The plan depends on (E, K) only; a row stride (u a column slice of a wider buffer) reads
    the right elements."""
    assert gate_plan(256, 4096) == (DECODE_BLOCK_N, 8)
    assert gate_plan(33, 300) == (DECODE_BLOCK_N, 1)
    u, w = operands(2, 24, 1024, torch.bfloat16, seed=4)
    wide = torch.cat((u, u), dim=1)[:, 1024:]
    cnt = counters(24)
    assert torch.equal(triton_moe_gate_logits(wide, w, counters=cnt),
                       triton_moe_gate_logits(u, w, counters=cnt))


@pytest.mark.parametrize("case", ["no counters", "5 rows", "fp32", "too few counters"])
def test_other_calls_are_the_reference(case: str) -> None:
    """Off the decode shape: the reference bit for bit, except bf16 rows past it on CUDA (the
    prefill GEMM: the same products summed in another order)."""
    dtype = torch.float32 if case == "fp32" else torch.bfloat16
    u, w = operands(5 if case == "5 rows" else 2, 40, 96, dtype, seed=6)
    cnt = None if case == "no counters" else counters(16 if case == "too few counters" else 40)
    got, want = triton_moe_gate_logits(u, w, counters=cnt), moe_gate_logits(u, w)
    if case == "5 rows" and DEVICE == "cuda":
        assert _rel(got, want) <= REL_TC
    else:
        assert torch.equal(got, want)


def test_gate_values_mode_keeps_the_reference_logits() -> None:
    """Under `ForwardMode.values` (no serving ctx; the engine's invariant modes give the gate no
    counters either) the gate's ids and weights are the triton select op's chain on the reference
    logits (`F.linear` of the fp32 casts), bit for bit, and the gate weight's gradient is the
    reference path's."""
    config = micro()
    gate = Gate(config, "routed").to(DEVICE)
    torch.nn.init.normal_(gate.weight, std=config.hidden_size ** -0.5)
    u, _ = operands(9, 1, config.hidden_size, torch.float32, seed=5)
    ids = torch.zeros(9, dtype=torch.int64, device=DEVICE)
    ops = create_kernels("triton")
    idx, weights = gate(u, ids, values=ops)
    logits = torch.nn.functional.linear(u.float(), gate.weight.detach().float())
    want_idx, want_w = triton_moe_gate_select(logits, gate.bias, None, None, gate.topk,
                                              gate.route_scale)
    assert torch.equal(idx, want_idx) and torch.equal(weights, want_w)
    weights.sum().backward()
    grad = gate.weight.grad.clone()
    gate.weight.grad = None
    ref_idx, ref_w = gate(u, ids)
    assert torch.equal(ref_idx, idx)
    ref_w.sum().backward()
    torch.testing.assert_close(grad, gate.weight.grad, rtol=1e-4, atol=1e-6)


# ---- GPU: V4-Flash shapes ------------------------------------------------------------------------

FLASH_E, FLASH_D = 256, 4096


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 2, 4])
def test_flash_parity(N: int) -> None:
    u, w = operands(N, FLASH_E, FLASH_D, torch.bfloat16, seed=7)
    cnt = counters(FLASH_E)
    got = triton_moe_gate_logits(u, w, counters=cnt)
    assert _rel(got, moe_gate_logits(u, w)) <= REL
    assert torch.equal(got, triton_moe_gate_logits(u, w, counters=cnt))     # run to run
    assert not cnt.any()


@pytest.mark.gpu
@pytest.mark.parametrize("N", [5, 8192])
def test_flash_prefill_gemm(N: int) -> None:
    """Past the decode shape (bf16, counters): the tensor-core GEMM with fp32 out, within the
    fp32 sum-order bound of the reference, counters untouched."""
    u, w = operands(N, FLASH_E, FLASH_D, torch.bfloat16, seed=10)
    cnt = counters(FLASH_E)
    got = triton_moe_gate_logits(u, w, counters=cnt)
    assert got.dtype == torch.float32 and got.shape == (N, FLASH_E)
    assert _rel(got, moe_gate_logits(u, w)) <= REL_TC
    assert not cnt.any()


@pytest.mark.gpu
def test_flash_graph_capture() -> None:
    u, w = operands(1, FLASH_E, FLASH_D, torch.bfloat16, seed=8)
    cnt = counters(FLASH_E)
    eager = triton_moe_gate_logits(u, w, counters=cnt)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_moe_gate_logits(u, w, counters=cnt)
    u.copy_(operands(1, FLASH_E, FLASH_D, torch.bfloat16, seed=9)[0])
    graph.replay()
    want = triton_moe_gate_logits(u, w, counters=cnt)
    assert torch.equal(out, want) and not torch.equal(out, eager) and not cnt.any()
