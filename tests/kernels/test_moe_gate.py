"""Parity of `triton_moe_gate_select` with `ref/moe.py::moe_gate_select`: equal expert ids, weights
within a few ulp, and on the GPU bit-equal to the reference's formula summed in the kernel's order.

The weights' k-sum: the kernel adds in the order of torch's CUDA row reduction at a few rows (for
k = 6: ((s0 + s4) + (s1 + s5)) + (s2 + s3)); torch's own order changes with the row count (its
launch configuration: at N = 64 and more it is neither that nor the sequential order), so against
the reference the weights are bit-equal at small N and within ~1 ulp beyond (measured on an H200:
max |diff| 8.9e-8 at route_scale 2.5, N 8..512; the kernel's softplus, sqrt and division are
bit-equal to torch's). `lane_sum` is that order in torch: on the GPU the weights equal the
reference formula with it bit for bit, at every N.

CPU: the interpreter on small shapes: top-k selection on scores + bias (E 256 / k 6, E 16 / k 2,
E 8 / k 2), hash rows, replayed rows with -1 rows and -1 slots (int64 and int32), N = 0, 1, 7, 64,
a row alone against the same row in a batch, validation. Under the interpreter softplus and sqrt
run on numpy and differ from torch's CPU ones by a few ulp, and torch's CPU row sum has yet
another order: weights within `TOL` (measured max |diff| 2.4e-7, max relative diff 3.8e-7 at
route_scale 2.5). The inputs have no tied keys (checked): among equal keys the kernel takes the
lower expert id first, torch.topk's order is unspecified.
GPU (`-m gpu`): V4-Flash (E 256, k 6, d 4096: the logits from the gate GEMM) at N = 1..512 inside a
CUDA graph, every mode.

    PYTHONPATH=src python -m pytest -q tests/kernels/test_moe_gate.py
"""

from __future__ import annotations

import itertools
import os

import torch

# NOTE: must precede the first `import triton` (tests/kernels/conftest.py may already do this).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dsv4.kernels.ref.moe import moe_gate_select  # noqa: E402
from dsv4.kernels.triton.moe_gate import triton_moe_gate_select  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 2.5
TOL = {"rtol": 2e-7, "atol": 3e-7}
Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def case(N: int, E: int, k: int, seed: int) -> Inputs:
    """(logits [N, E] fp32, bias [E] fp32, hashed [N, k] int64, replayed [N, k] int64 with about a
    third of the rows all -1 and a few single -1 slots); no two selection keys of a row tie (the
    first seed from `seed` on whose keys do not: with many rows an fp32 tie can happen)."""
    while True:
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(N, E, generator=g) * 3
        bias = torch.randn(E, generator=g) * 0.2
        if not has_ties(logits, bias):
            break
        seed += 1_000_003
    hashed = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)]) if N else \
        torch.empty(0, k, dtype=torch.int64)
    replayed = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)]) if N else \
        torch.empty(0, k, dtype=torch.int64)
    replayed = torch.where(torch.rand(N, 1, generator=g) < 0.3, -1, replayed)
    replayed = torch.where(torch.rand(N, k, generator=g) < 0.1, -1, replayed)
    return logits.to(DEVICE), bias.to(DEVICE), hashed.to(DEVICE), replayed.to(DEVICE)


def has_ties(logits: torch.Tensor, bias: torch.Tensor) -> bool:
    """Whether two selection keys of a row are equal (the selection's order is then the kernel's
    tie rule, which these tests do not pin)."""
    keys = (F.softplus(logits).sqrt() + bias).sort(dim=-1).values
    return bool((keys[:, 1:] == keys[:, :-1]).any())


def lane_sum(x: torch.Tensor) -> torch.Tensor:
    """Row sums of x [N, k] in the kernel's order: lane j of the largest power of two w <= k adds
    columns j and j + w, then the lanes pairwise ((0+1)+(2+3)) ..."""
    k = x.shape[1]
    w = 1 << (k.bit_length() - 1)
    parts = [x[:, j] + x[:, j + w] if j + w < k else x[:, j] for j in range(w)]
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0][:, None]


def check(logits: torch.Tensor, bias: torch.Tensor | None, hashed: torch.Tensor | None,
          replayed: torch.Tensor | None, k: int) -> None:
    want = moe_gate_select(logits, bias, hashed, replayed, k, SCALE)
    got = triton_moe_gate_select(logits, bias, hashed, replayed, k, SCALE)
    assert got[0].dtype == torch.int64 and got[1].dtype == torch.float32
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], **TOL)
    if DEVICE == "cuda":
        picked = F.softplus(logits).sqrt().gather(1, want[0])
        assert torch.equal(got[1], picked / (lane_sum(picked) + 1e-20) * SCALE)


@pytest.mark.parametrize("N", [0, 1, 7, 64])
@pytest.mark.parametrize(("E", "k"), [(256, 6), (16, 2), (8, 2)])
def test_parity(N: int, E: int, k: int) -> None:
    logits, bias, hashed, replayed = case(N, E, k, seed=N * 7 + E)
    check(logits, bias, None, None, k)                  # routed: top-k on scores + bias
    check(logits, None, hashed, None, k)                # hash rows
    check(logits, bias, hashed, replayed, k)            # R3 replay (wins over the hash rows)
    check(logits, None, None, replayed.int(), k)        # int32 ids


def test_replayed_minus_one_rows_take_the_first_experts() -> None:
    logits, bias, _, replayed = case(7, 16, 2, seed=3)
    replayed[2] = -1
    ids, weights = triton_moe_gate_select(logits, bias, None, replayed, 2, SCALE)
    assert ids[2].tolist() == [0, 1]
    assert bool(((weights.sum(-1) - SCALE).abs() < 1e-5).all())


def test_row_does_not_depend_on_the_row_count() -> None:
    logits, bias, _, _ = case(64, 256, 6, seed=5)
    ids, weights = triton_moe_gate_select(logits, bias, None, None, 6, SCALE)
    for n in (0, 31, 63):
        one = triton_moe_gate_select(logits[n:n + 1], bias, None, None, 6, SCALE)
        assert torch.equal(one[0][0], ids[n]) and torch.equal(one[1][0], weights[n])


def test_validation() -> None:
    logits, bias, hashed, _ = case(3, 16, 2, seed=0)
    with pytest.raises(ValueError, match="bias"):
        triton_moe_gate_select(logits, None, None, None, 2, SCALE)
    with pytest.raises(ValueError, match="float32"):
        triton_moe_gate_select(logits.double(), bias, None, None, 2, SCALE)
    with pytest.raises(ValueError, match="hashed"):
        triton_moe_gate_select(logits, None, hashed[:, :1], None, 2, SCALE)
    with pytest.raises(ValueError, match="k <= E"):
        triton_moe_gate_select(logits, bias, None, None, 17, SCALE)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 8, 64, 512])
def test_gpu_flash_shapes_in_graph(N: int) -> None:
    """The logits from the gate GEMM of V4-Flash (bf16 u [N, 4096] and weight [256, 4096] in fp32,
    as `Gate.forward` computes them); every mode inside one CUDA graph: equal ids, weights within
    `TOL` of the reference and bit-equal to its formula summed in the kernel's order."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    E, k, d = 256, 6, 4096
    _, bias, hashed, replayed = case(N, E, k, seed=N)
    for seed in itertools.count(N, 1_000_003):          # the first untied logits
        g = torch.Generator(DEVICE).manual_seed(seed)
        u = torch.randn(N, d, generator=g, device=DEVICE).bfloat16()
        w = (torch.randn(E, d, generator=g, device=DEVICE) * d ** -0.5).bfloat16()
        logits = F.linear(u.float(), w.float())
        if not has_ties(logits, bias):
            break
    modes = [(bias, None, None), (None, hashed, None), (bias, hashed, replayed)]
    want = [moe_gate_select(logits, *m, k, SCALE) for m in modes]
    for m in modes:                                     # compile outside the capture
        triton_moe_gate_select(logits, *m, k, SCALE)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = [triton_moe_gate_select(logits, *m, k, SCALE) for m in modes]
    graph.replay()
    for w_, g_ in zip(want, got, strict=True):
        assert torch.equal(w_[0], g_[0])
        torch.testing.assert_close(g_[1], w_[1], **TOL)
        picked = F.softplus(logits).sqrt().gather(1, w_[0])
        assert torch.equal(g_[1], picked / (lane_sum(picked) + 1e-20) * SCALE)
