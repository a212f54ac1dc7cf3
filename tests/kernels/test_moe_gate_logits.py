"""The MoE gate's logits in one launch: `triton_moe_gate_logits` vs `ref.moe.moe_gate_logits`
(`F.linear(u.float(), weight.float())`), and the gate's use of the op (spec §8).

CPU (the Triton interpreter): bf16 / fp32 operands at small shapes (E and K tails, several row
blocks, a row stride) within the fp32 sum-order bound; a row's bits independent of the row count
(one row alone = the same row among 7 and among 21); validation; `Gate` under
`ForwardMode.values` takes the op's logits (its ids and weights equal the ops' chain) and the
reference GEMM's gradient.
GPU (`-m gpu`): V4-Flash shapes (E 256, d 4096; N = 1, 8, 32), rows independent of N (up to 512),
CUDA-graph capture and replay.

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
from dsv4.kernels.ref.moe import moe_gate_logits  # noqa: E402
from dsv4.kernels.registry import create_kernels  # noqa: E402
from dsv4.kernels.triton.moe_gate import triton_moe_gate_select  # noqa: E402
from dsv4.kernels.triton.moe_gate_logits import (  # noqa: E402
    gate_logits_config,
    triton_moe_gate_logits,
)
from dsv4.model.moe import Gate  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 sums in another order: a few ulp of the largest partial sums
REL = {torch.bfloat16: 1e-6, torch.float32: 2e-6}


def operands(N: int, E: int, d: int, dtype: torch.dtype,
             seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(DEVICE).manual_seed(seed)
    u = torch.randn(N, d, generator=g, device=DEVICE).to(dtype)
    w = (torch.randn(E, d, generator=g, device=DEVICE) * d ** -0.5).to(dtype)
    return u, w


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("N,E,d", [(1, 16, 64), (7, 10, 300), (21, 33, 512), (3, 256, 1024)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_parity(N: int, E: int, d: int, dtype: torch.dtype) -> None:
    u, w = operands(N, E, d, dtype)
    got = triton_moe_gate_logits(u, w)
    assert got.dtype == torch.float32 and got.shape == (N, E) and got.is_contiguous()
    assert _rel(got, moe_gate_logits(u, w)) <= REL[dtype]


def test_rows_do_not_depend_on_the_row_count() -> None:
    """Each row of a 7-row call (one row block) and of a 21-row call (three; the row at another
    position of its block) equals the row computed alone, bit for bit."""
    u, w = operands(21, 40, 700, torch.bfloat16, seed=3)
    many, seven = triton_moe_gate_logits(u, w), triton_moe_gate_logits(u[:7], w)
    assert torch.equal(many[:7], seven)
    for r in (0, 3, 6, 13, 20):
        assert torch.equal(triton_moe_gate_logits(u[r:r + 1], w)[0], many[r])


def test_strided_operands_and_empty() -> None:
    """A row stride (u a column slice of a wider buffer) and a transposed weight read the right
    elements; N = 0 gives an empty result."""
    u, w = operands(5, 12, 96, torch.bfloat16, seed=4)
    wide = torch.cat((u, u), dim=1)[:, 96:]
    wt = w.t().contiguous().t()
    assert torch.equal(triton_moe_gate_logits(wide, wt), triton_moe_gate_logits(u, w))
    assert triton_moe_gate_logits(u[:0], w).shape == (0, 12)


def test_config_ignores_the_row_count_and_validation() -> None:
    assert gate_logits_config(4096, torch.bfloat16) == (2, 256)
    assert gate_logits_config(4096, torch.float32) == (2, 128)
    assert gate_logits_config(64, torch.bfloat16) == (2, 64)
    u, w = operands(2, 4, 32, torch.bfloat16)
    with pytest.raises(ValueError, match="expected u"):
        triton_moe_gate_logits(u, w[:, :16])
    with pytest.raises(ValueError, match="not supported"):
        triton_moe_gate_logits(u.double(), w)


def test_gate_values_mode_keeps_the_reference_logits() -> None:
    """The model does not use this op (its kernel measured slower at decode on the H200): under
    `ForwardMode.values` the gate's ids and weights are the triton select op's chain on the
    reference logits (`F.linear` of the fp32 casts), bit for bit, and the gate weight's gradient
    is the reference path's."""
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
@pytest.mark.parametrize("N", [1, 8, 32])
def test_flash_parity_and_invariance(N: int) -> None:
    u, w = operands(512, FLASH_E, FLASH_D, torch.bfloat16, seed=7)
    big = triton_moe_gate_logits(u, w)
    got = triton_moe_gate_logits(u[:N], w)
    assert _rel(got, moe_gate_logits(u[:N], w)) <= REL[torch.bfloat16]
    assert torch.equal(got, big[:N])
    assert torch.equal(got, triton_moe_gate_logits(u[:N], w))          # run to run


@pytest.mark.gpu
def test_flash_graph_capture() -> None:
    u, w = operands(8, FLASH_E, FLASH_D, torch.bfloat16, seed=8)
    eager = triton_moe_gate_logits(u, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_moe_gate_logits(u, w)
    u.copy_(operands(8, FLASH_E, FLASH_D, torch.bfloat16, seed=9)[0])
    graph.replay()
    assert torch.equal(out, triton_moe_gate_logits(u, w)) and not torch.equal(out, eager)
