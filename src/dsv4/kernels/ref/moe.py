"""Reference routed-expert application (spec §8): SwiGLU with clamp, weights applied before W2.

Tokens are grouped by expert with one sort; the per-expert counts come to the host once
(the named sync point of this op) so each expert runs one dense matmul over its tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit)."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def routed_experts(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, indices: torch.Tensor,
                   weights: torch.Tensor, limit: float) -> torch.Tensor:
    """y[t] = Σ_k weights[t,k] * W2_e (swiglu(W1_e x, W3_e x)) with e = indices[t,k].

    x: [N, d]; w1, w3: [E, I, d]; w2: [E, d, I]; indices: [N, k] int64; weights: [N, k] fp32.
    Returns [N, d] fp32 (the caller adds the shared expert and casts).
    """
    N, k = indices.shape
    num_experts = w1.shape[0]
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # sync point: per-expert token counts
    out = torch.zeros(N, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        slots = order[start:start + count]
        start += count
        tokens = slots // k
        xe = x.index_select(0, tokens)         # (index_select: its backward is index_add, not a sorted scatter)
        h = swiglu(F.linear(xe, w1[e]), F.linear(xe, w3[e]), limit)
        h = (h.float() * weights.reshape(-1).index_select(0, slots)[:, None]).to(x.dtype)
        out.index_add_(0, tokens, F.linear(h, w2[e]).float())
    return out


def routed_experts_grouped(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                           indices: torch.Tensor, weights: torch.Tensor, limit: float) -> torch.Tensor:
    """Same contract as `routed_experts`, as three grouped GEMMs (`torch._grouped_mm`, CUDA bf16, Hopper) with
    the token-to-expert grouping on the device: no host sync and three launches instead of three per expert."""
    N, k = indices.shape
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=w1.shape[0]), 0).to(torch.int32)
    tokens = order // k
    xs = x[tokens]                                                            # [N*k, d] grouped by expert
    gate = torch._grouped_mm(xs, w1.transpose(1, 2), offs=offs)             # [N*k, I]
    up = torch._grouped_mm(xs, w3.transpose(1, 2), offs=offs)
    h = (swiglu(gate, up, limit).float() * weights.reshape(-1)[order, None]).to(x.dtype)
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)                  # [N*k, d]
    return torch.zeros(N, x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, tokens, y.float())
