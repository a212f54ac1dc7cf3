"""Multi-token prediction block (spec §9): a full SWA + routed-MoE block with its own input
mixing.

    e  = enorm(embed(ids))                               embed is the main model's (shared)
    X  = e_proj(e)[:, :, None] + h_proj(hnorm(X_main))   X_main: main streams before hc_head
    X  = Block(X)
    logits = head(norm(hc_head(X)))                      head is the main model's (shared)

Used with ids = the tokens one step ahead: position k combines the main streams at k with the
embedding of token k+1 and predicts token k+2.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.config.model import ModelConfig
from dsv4.model.block import Block
from dsv4.model.forward_context import ForwardContext
from dsv4.model.forward_mode import ForwardMode
from dsv4.model.hyper_connection import HyperHead
from dsv4.model.layers.norm import RMSNorm
from dsv4.model.quant_linear import linear


class MTPBlock(Block):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__(config, "swa", "routed", layer_id)
        d, eps = config.hidden_size, config.rms_norm_eps
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        self.enorm = RMSNorm(d, eps)
        self.hnorm = RMSNorm(d, eps)
        self.norm = RMSNorm(d, eps)
        self.hc_head = HyperHead(config)

    def mix_inputs(self, streams: torch.Tensor, embedded: torch.Tensor,
                   ctx: ForwardContext | None = None) -> torch.Tensor:
        """streams: [B, S, n, d] main streams; embedded: [B, S, d] embeddings -> [B, S, n, d].
        A serving step passes its `ctx` (the norms run as the kernel backend's op)."""
        ops = ctx.ops if ctx is not None else None
        return (linear(self.e_proj, self.enorm(embedded, ctx), ops).unsqueeze(2)
                + linear(self.h_proj, self.hnorm(streams, ctx), ops))

    def hidden(self, streams: torch.Tensor, embedded: torch.Tensor, input_ids: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor, mode: ForwardMode) -> torch.Tensor:
        """-> the normed [B, S, d] state this block feeds to the shared head."""
        x = super().forward(self.mix_inputs(streams, embedded), input_ids, cos, sin, mode=mode)
        return self.norm(self.hc_head(x))
