"""Manifold-constrained hyper-connections (mHC, spec §5).

The residual is `n = hc_mult` parallel streams X: [B, S, n, d]. Before each sub-block the
streams are collapsed with input-dependent weights `pre`; after it the block output is spread
back with `post` and the old streams are mixed by the Sinkhorn-projected `comb`:
    X'[k] = post[k] * f + Σ_j comb[j, k] * X[j]          (sum over the FIRST index of comb)
The learned parameters are only `fn`, `base` and `scale` (all fp32). With a ForwardContext
(serving) the three steps run as the kernel backend's `mhc_pre` / `mhc_post` / `mhc_head` ops on
the [T, n, d] tokens (the `ref` ops compute exactly what the full-sequence path below computes, op
for op).
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.config.model import ModelConfig
from dsv4.kernels.ref.mhc import hc_split_sinkhorn
from dsv4.model.forward_context import ForwardContext


def _scaled_mix(x: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """r * (fn @ flatten(x)) with r = 1/rms(flatten(x)).

    x: [B, S, n, d] -> [B, S, rows(fn)] fp32.
    """
    flat = x.flatten(2).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)
    return flat @ fn.float().t()


class HyperConnection(nn.Module):
    """One mHC site (attention or FFN) of a block."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        n, d = config.hc_mult, config.hidden_size
        self.n, self.iters = n, config.hc_sinkhorn_iters
        self.hc_eps, self.norm_eps = config.hc_eps, config.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros(config.hc_mix_dim, n * d, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros(config.hc_mix_dim, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def pre(self, x: torch.Tensor, ctx: ForwardContext | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, S, n, d] -> (block input h [B, S, d], post [B, S, n], comb [B, S, n, n]).

        h is in x's dtype.
        """
        if ctx is not None:
            B, S, n, d = x.shape
            flat = x.reshape(B * S, n, d).contiguous()   # (the first layer's streams are an expand)
            h, post, comb = ctx.ops.mhc_pre(flat, self.fn, self.scale, self.base, n, self.iters,
                                            self.hc_eps, self.norm_eps)
            return h.view(B, S, d), post.view(B, S, n), comb.view(B, S, n, n)
        mix = _scaled_mix(x, self.fn, self.norm_eps)
        pre, post, comb = hc_split_sinkhorn(mix, self.scale, self.base, self.n, self.iters,
                                            self.hc_eps)
        h = (pre.unsqueeze(-1) * x.float()).sum(dim=2)
        return h.to(x.dtype), post, comb

    @staticmethod
    def post(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
             ctx: ForwardContext | None = None) -> torch.Tensor:
        """f: [B, S, d] block output; x: [B, S, n, d] old streams -> new streams [B, S, n, d]."""
        if ctx is not None:
            B, S, n, d = x.shape
            out = ctx.ops.mhc_post(f.reshape(B * S, d), x.reshape(B * S, n, d).contiguous(),
                                   post.reshape(B * S, n), comb.reshape(B * S, n, n).contiguous())
            return out.view(B, S, n, d)
        mixed = torch.einsum("bsjk,bsjd->bskd", comb, x.float())
        return (post.unsqueeze(-1) * f.float().unsqueeze(-2) + mixed).to(x.dtype)


class HyperHead(nn.Module):
    """Final collapse of the streams before the last norm: sigmoid weights, no post/comb."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        n, d = config.hc_mult, config.hidden_size
        self.hc_eps, self.norm_eps = config.hc_eps, config.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros(n, n * d, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        """x: [B, S, n, d] -> [B, S, d] in x's dtype."""
        if ctx is not None:
            B, S, n, d = x.shape
            return ctx.ops.mhc_head(x.reshape(B * S, n, d).contiguous(), self.fn, self.scale,
                                    self.base, self.hc_eps, self.norm_eps).view(B, S, d)
        mix = _scaled_mix(x, self.fn, self.norm_eps)
        pre = torch.sigmoid(mix * self.scale.float() + self.base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * x.float()).sum(dim=2).to(x.dtype)
