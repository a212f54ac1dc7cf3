"""Grouped-GEMM MoE (`torch._grouped_mm`, bf16, Hopper) against the per-expert reference loop."""

from __future__ import annotations

import pytest
import torch

from dsv4.kernels.ref.moe import routed_experts, routed_experts_grouped


@pytest.mark.gpu
@pytest.mark.parametrize(("N", "E", "k", "d", "inter"),
                         [(7, 8, 2, 256, 128), (300, 256, 6, 4096, 2048)])
def test_grouped_moe_matches_loop(N: int, E: int, k: int, d: int, inter: int) -> None:
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("torch._grouped_mm needs Hopper")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(N, d, device="cuda", generator=g).bfloat16()
    w1, w3 = (torch.randn(E, inter, d, device="cuda", generator=g).div(d ** 0.5).bfloat16()
              for _ in range(2))
    w2 = torch.randn(E, d, inter, device="cuda", generator=g).div(inter ** 0.5).bfloat16()
    indices = torch.rand(N, E, device="cuda", generator=g).argsort(dim=-1)[:, :k]
    weights = torch.rand(N, k, device="cuda", generator=g)
    ref = routed_experts(x, w1, w2, w3, indices, weights, 10.0)
    out = routed_experts_grouped(x, w1, w2, w3, indices, weights, 10.0)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, rel


@pytest.mark.parametrize("routing", ["spread", "ragged"])
def test_grouped_moe_matches_loop_cpu_fp32(routing: str) -> None:
    """torch._grouped_mm on the CPU (fp32): the device grouping (counts by a scatter-add, no
    bincount) gives the loop's result, with experts of no token and, ragged, one with every
    token."""
    g = torch.Generator().manual_seed(0)
    N, E, k, d, inter = 9, 8, 2, 32, 16
    x = torch.randn(N, d, generator=g)
    w1, w3 = (torch.randn(E, inter, d, generator=g) / d ** 0.5 for _ in range(2))
    w2 = torch.randn(E, d, inter, generator=g) / inter ** 0.5
    if routing == "spread":
        indices = torch.rand(N, E, generator=g).argsort(dim=-1)[:, :k]
    else:   # expert 5 on every token, expert 2 on all but one, the rest empty but expert 7
        indices = torch.tensor([[5, 2]] * (N - 1) + [[7, 5]])
    weights = torch.rand(N, k, generator=g)
    ref = routed_experts(x, w1, w2, w3, indices, weights, 10.0)
    out = routed_experts_grouped(x, w1, w2, w3, indices, weights, 10.0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
