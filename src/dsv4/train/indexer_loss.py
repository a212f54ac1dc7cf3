"""Indexer distillation: train the lightning indexer to predict where attention goes
(DeepSeek-V3.2 §2.1).

The indexer's scores only select entries, so the LM loss gives it no gradient. As in
DeepSeek-V3.2's warm-up, its target is the main attention's distribution over the C4 entries,
summed over heads and L1-normalised; its loss is KL(target || softmax(index scores)) over the
entries visible to each query. Inputs are detached, so this loss trains the indexer (its
projections and its own compressor) and nothing else. Simplification (documented in the model
card): the target is the attention among the compressed entries alone, not their share of the
full softmax with the window keys and the sink.

Attached with forward hooks on the CSA attention modules, so the model code is unchanged; `take()`
returns the mean KL over the CSA layers of the last forward and clears it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dsv4.model.attention import Attention
from dsv4.model.forward_mode import TRAINING


def indexer_kl(attn: Attention, x: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
    """Mean over queries (with >= 1 visible entry) of KL(attention target || indexer
    distribution)."""
    assert attn.indexer is not None and attn.compressor is not None
    x = x.detach()
    with torch.no_grad():
        q, _, q_lat = attn.qkv(x, cos, sin)                                # [B, S, H, D]
        entries = attn.compressor(x, cos, sin)                             # [B, E, D]
        logits = torch.einsum("bshd,bed->bshe", q.float(), entries.float()) * attn.scale
        visible = (torch.arange(x.shape[1], device=x.device) + 1) // attn.compressor.ratio
        hidden = torch.arange(entries.shape[1], device=x.device) >= visible[:, None]  # [S, E]
        rows = visible > 0                                                 # [S]
        logits = logits.masked_fill(hidden[None, :, None, :] | ~rows[None, :, None, None], 0.0)
        probs = torch.softmax(logits.masked_fill(hidden[None, :, None, :], float("-inf")), dim=-1)
        target = probs.sum(dim=2)
        target = (target / target.sum(-1, keepdim=True)).nan_to_num(0.0)   # [B, S, E]
    scores = attn.indexer.scores(x, q_lat, cos, sin)                       # [B, S, E], -inf hidden
    log_q = torch.log_softmax(scores.masked_fill(~rows[:, None], 0.0),
                              dim=-1).masked_fill(hidden, 0.0)
    kl = (target * (target.clamp_min(1e-20).log() - log_q)).sum(-1)        # [B, S]
    # masked mean, not kl[:, rows]: a boolean index has a data-dependent shape, which splits
    # torch.compile graphs
    # (no query sees an entry before `ratio` tokens: the loss is then 0, not 0 / 0)
    return kl.masked_fill(~rows, 0.0).sum() / (kl.shape[0] * rows.sum().clamp(min=1))


class IndexerDistiller:
    def __init__(self, model: nn.Module) -> None:
        self.losses: list[torch.Tensor] = []
        self.enabled = True
        self._handles: list[RemovableHandle] = [
            m.register_forward_hook(self._hook, with_kwargs=True) for m in model.modules()
            if isinstance(m, Attention) and m.indexer is not None]

    def _hook(self, module: nn.Module, args: tuple[torch.Tensor, ...], kwargs: dict[str, Any],
              _output: torch.Tensor) -> None:
        if not self.enabled or kwargs.get("mode") is not TRAINING:
            return  # TRAINING forwards only (never a serving step, an evaluation or an inference)
        assert isinstance(module, Attention)
        x, cos, sin = args[:3]
        self.losses.append(indexer_kl(module, x, cos, sin))

    def take(self) -> torch.Tensor | None:
        """Mean indexer KL over the CSA layers of the last forward (None without CSA layers)."""
        if not self.losses:
            return None
        loss = torch.stack(self.losses).mean()
        self.losses.clear()
        return loss

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
