"""Initial weights for training from scratch (the checkpoint writer's random values are for
tests, not learning).

GPT-style scaled normal init for every projection, residual-output projections shrunk by
1/sqrt(2L), and mHC started near "one stream per residual": comb close to the identity (diagonal
logit `_COMB_DIAG`), pre/post at their midpoints, and small random `fn` so that the n streams
(identical copies of the embedding at the input) can diverge — with all-zero `fn` they would stay
identical forever, as every stream would see the same update. Hash-layer tables get k distinct
random experts per token id. Deterministic in `seed` (CPU generator).
"""

from __future__ import annotations

import math

import torch

from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM

_STD = 0.02
_COMB_DIAG = 2.0
_HC_FN_STD = 1e-3
_RESIDUAL_OUT = ("attn.wo_b.weight", "shared_experts.w2.weight", "experts.w2")


@torch.no_grad()
def init_weights(model: DeepSeekV4ForCausalLM, seed: int) -> DeepSeekV4ForCausalLM:
    """Fill `model` in place for training from scratch; returns it."""
    c = model.config
    g = torch.Generator().manual_seed(seed)
    out_std = _STD / math.sqrt(2 * (c.num_layers + c.num_mtp_layers))

    def normal(t: torch.Tensor, std: float) -> None:
        t.copy_(torch.randn(t.shape, generator=g) * std)

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name == "embed.weight":
            normal(p, 1.0)
        elif name.endswith((".ape", "attn_sink", "gate.bias")):
            p.zero_()
        elif leaf == "fn":
            normal(p, _HC_FN_STD)
        elif leaf == "scale":
            p.fill_(1.0)
        elif leaf == "base":
            _init_hc_base(p, c.hc_mult)
        elif name.endswith(_RESIDUAL_OUT):
            normal(p, out_std)
        else:
            normal(p, _STD)
    for name, buf in model.named_buffers():
        if name.endswith("tid2eid"):
            buf.copy_(torch.rand(buf.shape[0], c.n_routed_experts,
                                 generator=g).argsort(dim=-1)[:, :buf.shape[1]])
    return model


def _init_hc_base(base: torch.Tensor, n: int) -> None:
    """mHC sites: [pre n | post n | comb n*n] -> comb logits favour the identity; HyperHead
    (n entries): 0."""
    base.zero_()
    if base.numel() == (2 + n) * n:
        base[2 * n:].view(n, n).fill_diagonal_(_COMB_DIAG)
