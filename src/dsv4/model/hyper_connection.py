"""Manifold-constrained hyper-connections (mHC, spec §5).

The residual is `n = hc_mult` parallel streams X: [B, S, n, d]. Before each sub-block the
streams are collapsed with input-dependent weights `pre`; after it the block output is spread
back with `post` and the old streams are mixed by the Sinkhorn-projected `comb`:
    X'[k] = post[k] * f + Σ_j comb[j, k] * X[j]          (sum over the FIRST index of comb)
The learned parameters are only `fn`, `base` and `scale` (all fp32). With a ForwardContext
(serving) the three steps run as the kernel backend's `mhc_pre` / `mhc_post` / `mhc_head` ops on
the [T, n, d] tokens (the `ref` ops compute exactly what the full-sequence path below computes, op
for op); where a post step is followed by another site's pre (inside a block, and from one block
to the next) both run as one `mhc_post_pre` op. A full-sequence forward given `values`
(`ForwardMode.values`) takes those ops' values and the formulation's gradients
(`model/kernel_values.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.config.model import ModelConfig
from dsv4.kernels.ref.mhc import hc_split_sinkhorn
from dsv4.kernels.registry import KernelOps
from dsv4.model.forward_context import ForwardContext
from dsv4.model.kernel_values import kernel_values

PreOut = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""A pre step's (block input h [B, S, d], post [B, S, n], comb [B, S, n, n])."""


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

    def pre(self, x: torch.Tensor, ctx: ForwardContext | None = None,
            values: KernelOps | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, S, n, d] -> (block input h [B, S, d], post [B, S, n], comb [B, S, n, n]).

        h is in x's dtype.
        """
        if ctx is not None:
            return self._pre_op(ctx.ops, x, self.fn, self.scale, self.base)
        if values is not None:
            ops = values
            return kernel_values(lambda *a: self._pre_op(ops, *a), self._pre_ref, x, self.fn,
                                 self.scale, self.base)
        return self._pre_ref(x, self.fn, self.scale, self.base)

    def _pre_op(self, ops: KernelOps, x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor,
                base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, S, n, d = x.shape
        flat = x.reshape(B * S, n, d).contiguous()   # (the first layer's streams are an expand)
        h, post, comb = ops.mhc_pre(flat, fn, scale, base, n, self.iters, self.hc_eps,
                                    self.norm_eps)
        return h.view(B, S, d), post.view(B, S, n), comb.view(B, S, n, n)

    def _pre_ref(self, x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor,
                 base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mix = _scaled_mix(x, fn, self.norm_eps)
        pre, post, comb = hc_split_sinkhorn(mix, scale, base, self.n, self.iters, self.hc_eps)
        h = (pre.unsqueeze(-1) * x.float()).sum(dim=2)
        return h.to(x.dtype), post, comb

    def post_pre(self, f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                 ctx: ForwardContext) -> tuple[torch.Tensor, PreOut]:
        """Serving: the previous site's post step (f: its block output, x / post / comb: its
        streams and weights), then this site's pre on the new streams, as one op
        (`mhc_post_pre`) -> (new streams [B, S, n, d], this site's (h, post, comb))."""
        B, S, n, d = x.shape
        new, h, p, c = ctx.ops.mhc_post_pre(
            f.reshape(B * S, d), x.reshape(B * S, n, d).contiguous(), post.reshape(B * S, n),
            comb.reshape(B * S, n, n).contiguous(), self.fn, self.scale, self.base, n,
            self.iters, self.hc_eps, self.norm_eps)
        return new.view(B, S, n, d), (h.view(B, S, d), p.view(B, S, n), c.view(B, S, n, n))

    @staticmethod
    def post(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
             ctx: ForwardContext | None = None, values: KernelOps | None = None) -> torch.Tensor:
        """f: [B, S, d] block output; x: [B, S, n, d] old streams -> new streams [B, S, n, d]."""
        if ctx is not None:
            return _post_op(ctx.ops, f, x, post, comb)
        if values is not None:
            ops = values
            return kernel_values(lambda *a: _post_op(ops, *a), _post_ref, f, x, post, comb)
        return _post_ref(f, x, post, comb)


def _post_op(ops: KernelOps, f: torch.Tensor, x: torch.Tensor, post: torch.Tensor,
             comb: torch.Tensor) -> torch.Tensor:
    B, S, n, d = x.shape
    out = ops.mhc_post(f.reshape(B * S, d), x.reshape(B * S, n, d).contiguous(),
                       post.reshape(B * S, n), comb.reshape(B * S, n, n).contiguous())
    return out.view(B, S, n, d)


def _post_ref(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor,
              comb: torch.Tensor) -> torch.Tensor:
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

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None,
                values: KernelOps | None = None) -> torch.Tensor:
        """x: [B, S, n, d] -> [B, S, d] in x's dtype."""
        if ctx is not None:
            return self._op(ctx.ops, x, self.fn, self.scale, self.base)
        if values is not None:
            ops = values
            return kernel_values(lambda *a: self._op(ops, *a), self._ref, x, self.fn, self.scale,
                                 self.base)
        return self._ref(x, self.fn, self.scale, self.base)

    def _op(self, ops: KernelOps, x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor,
            base: torch.Tensor) -> torch.Tensor:
        B, S, n, d = x.shape
        return ops.mhc_head(x.reshape(B * S, n, d).contiguous(), fn, scale, base, self.hc_eps,
                            self.norm_eps).view(B, S, d)

    def _ref(self, x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor,
             base: torch.Tensor) -> torch.Tensor:
        mix = _scaled_mix(x, fn, self.norm_eps)
        pre = torch.sigmoid(mix * scale.float() + base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * x.float()).sum(dim=2).to(x.dtype)
