"""One decoder block: attention and MoE, each wrapped by a hyper-connection site (spec §4)."""

from __future__ import annotations

import torch
from torch import nn

from dsv4.config.model import ModelConfig
from dsv4.model.attention import Attention
from dsv4.model.forward_context import ForwardContext
from dsv4.model.forward_mode import ForwardMode
from dsv4.model.hyper_connection import HyperConnection, PreOut
from dsv4.model.layers.norm import RMSNorm
from dsv4.model.moe import MoE


class Block(nn.Module):
    def __init__(self, config: ModelConfig, attn_type: str, moe_type: str, layer_id: int) -> None:
        super().__init__()
        self.attn_type, self.layer_id = attn_type, layer_id
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, attn_type, layer_id)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn = MoE(config, moe_type, layer_id)
        self.hc_attn = HyperConnection(config)
        self.hc_ffn = HyperConnection(config)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, ctx: ForwardContext | None = None, *,
                mode: ForwardMode | None = None) -> torch.Tensor:
        """x: [B, S, n, d] streams -> [B, S, n, d]; cos/sin: this layer's RoPE at x's positions.

        Exactly one of `ctx` (a serving step) and `mode` (a full-sequence forward) is given.
        """
        assert (ctx is None) != (mode is None), (
            "pass a serving ctx or a full-sequence mode, not both")
        if ctx is not None:
            return self.serve(x, self.hc_attn.pre(x, ctx), input_ids, cos, sin, ctx, None)[0]
        v = mode.values if mode is not None else None
        h, post, comb = self.hc_attn.pre(x, ctx, v)
        o = self.attn(self.attn_norm(h, ctx, v), cos, sin, ctx, self.layer_id, mode=mode)
        x = HyperConnection.post(o, x, post, comb, ctx, v)
        h, post, comb = self.hc_ffn.pre(x, ctx, v)
        return HyperConnection.post(self.ffn(self.ffn_norm(h, ctx, v), input_ids, ctx, mode=mode),
                                    x, post, comb, ctx, v)

    def serve(self, x: torch.Tensor, pre: PreOut, input_ids: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor, ctx: ForwardContext, next_site: HyperConnection | None,
              ) -> tuple[torch.Tensor, PreOut | None]:
        """A serving step of the block from its attention site's pre outputs `pre` on streams x:
        the attention, its post fused with the FFN site's pre, the MoE, and its post fused with
        `next_site`'s pre (the next block's attention site) -> (new streams, next_site's pre
        outputs), or the plain post -> (new streams, None) without a next site."""
        h, post, comb = pre
        o = self.attn(self.attn_norm(h, ctx), cos, sin, ctx, self.layer_id)
        x, (h, post, comb) = self.hc_ffn.post_pre(o, x, post, comb, ctx)
        f = self.ffn(self.ffn_norm(h, ctx), input_ids, ctx)
        if next_site is None:
            return HyperConnection.post(f, x, post, comb, ctx), None
        return next_site.post_pre(f, x, post, comb, ctx)
