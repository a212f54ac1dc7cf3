"""Lightning indexer of CSA layers: picks the top-k C4 entries per query (spec §6.6).

The scores are used only for selection (no gradient path to the attention logits); visibility
is `entry i < (t+1) // ratio`. Ties break toward the lower entry index
(`kernels/ref/indexer.py`).

On the serving path the layer runs the projections (`forward_cached` takes their outputs): with
fused projections (`model/fused_projections.py`) `weights_proj` rides the layer's x GEMM (an FP8
checkpoint's x GEMM cannot carry it: then it runs alone, in the indexer's branch) and `wq_b` its
q_lat GEMM, and the compressor its fp32 one.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.cache.pools import LayerCache
from dsv4.config.model import ModelConfig
from dsv4.kernels.ref.index_keys import round_index_keys
from dsv4.kernels.ref.indexer import causal_topk, index_scores
from dsv4.kernels.ref.rope_norm import apply_rope
from dsv4.kernels.registry import KernelOps
from dsv4.model.compressor import Compressor
from dsv4.model.forward_context import CompressPlan, ForwardContext
from dsv4.model.kernel_values import kernel_values
from dsv4.model.layers.rope import token_rows


class Indexer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.topk, self.ratio = config.index_topk, config.csa_ratio
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        self.compressor = Compressor(config.hidden_size, self.head_dim, self.ratio, True,
                                     config.rms_norm_eps)
        self.weight_scale = self.head_dim ** -0.5 * self.n_heads ** -0.5
        # FP8 keys and queries (`EngineConfig.index_cache_dtype`; set by
        # `DeepSeekV4ForCausalLM.set_index_cache_dtype`): both paths round them alike
        self.fp8 = False

    def query(self, x: torch.Tensor, q_lat: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              values: KernelOps | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-sequence path: x [B, S, d], q_lat [B, S, q_lora], cos/sin [S, rd/2] -> (roped
        indexer queries [B, S, Ih, Id], head weights [B, S, Ih] fp32).

        `values` (`ForwardMode.values`): the RoPE's values from that backend's `rope` op on
        per-token cos / sin rows, as the serving path (`forward_cached`) computes them."""
        q = self.wq_b(q_lat).unflatten(-1, (self.n_heads, self.head_dim))

        def ref(q_: torch.Tensor) -> torch.Tensor:
            return apply_rope(q_, cos.unsqueeze(-2), sin.unsqueeze(-2))

        if values is None:
            q = ref(q)
        else:
            ops, (B, S), rows = values, q.shape[:2], token_rows(cos, sin, q.shape[0])
            q = kernel_values(lambda q_: ops.rope(q_.reshape(B * S, *q_.shape[2:]),
                                                  *rows).view_as(q_), ref, q)
        return q, self.head_weights(x)

    def head_weights(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., d] -> the query heads' weights [..., Ih] fp32 (scaled)."""
        return self.scale_weights(self.weights_proj(x))

    def scale_weights(self, projected: torch.Tensor) -> torch.Tensor:
        """`weights_proj`'s output [..., Ih] -> the query heads' weights [..., Ih] fp32 (scaled)."""
        return projected.float() * self.weight_scale

    def scores(self, x: torch.Tensor, q_lat: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, values: KernelOps | None = None) -> torch.Tensor:
        """Full-sequence index scores [B, S, E] fp32, -inf where entry i >= (t+1)//ratio.

        `values`: the queries' RoPE values from that backend (`query`)."""
        keys = self.compressor(x, cos, sin)                       # [B, E, Id]
        q, w = self.query(x, q_lat, cos, sin, values)
        if self.fp8:        # the serving path's FP8 pool and the kernel's rounding of q
            keys, q = round_index_keys(keys), round_index_keys(q)
        scores = index_scores(q, keys, w)
        visible = (torch.arange(x.shape[1], device=x.device) + 1) // self.ratio
        hidden = torch.arange(keys.shape[1], device=x.device) >= visible[:, None]
        return scores.masked_fill(hidden, float("-inf"))

    def forward(self, x: torch.Tensor, q_lat: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, values: KernelOps | None = None) -> torch.Tensor:
        """x: [B, S, d], q_lat: [B, S, q_lora] -> picked entry ids [B, S, min(k, E)], -1 = none.

        `values`: the queries' RoPE values from that backend (`query`)."""
        with torch.no_grad():
            scores = self.scores(x, q_lat, cos, sin, values)
        visible = (torch.arange(x.shape[1], device=x.device) + 1) // self.ratio
        return causal_topk(scores, visible.expand(x.shape[0], -1), self.topk)

    @torch.no_grad()
    def forward_cached(self, q: torch.Tensor, weights: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, ctx: ForwardContext, plan: CompressPlan,
                       cache: LayerCache) -> torch.Tensor:
        """Serving path: this step's projections q = wq_b(q_lat) [T, Ih*Id] and weights =
        weights_proj(x) [T, Ih] (the layer computes them: alone, or as column slices of its fused
        GEMMs, `Attention.forward_cached`), cos/sin [T, rd/2] -> the top-k picks [T, min(k, V)]:
        candidate columns, -1 = none (`ops.pick_slots` turns them into entry ids and pool slots;
        [T, 0] while no entry is complete). The queries' RoPE is the `rope` op; the weights go to
        the `index_scores` op raw, with `weight_scale` (the op casts and scales them as
        `scale_weights` does, to the same bits).

        Candidates are ordered by entry id, so a pick's candidate column IS its entry id and the
        lower-index tie-break matches the full-sequence path. This step's keys are already in
        `cache.index_keys`: the layer wrote them with its own compressor's
        (`Attention._compress_pair`). With FP8 pools (`cache.index_scales`) each head's query is
        rounded to FP8 as the full-sequence path rounds it (`scores`), by the RoPE op
        (`rope_fp8`).
        """
        assert cache.index_keys is not None
        fp8 = cache.index_scales is not None
        assert fp8 == self.fp8, "the key pools' format and the model's indexer must agree"
        q = q.view(q.shape[0], self.n_heads, self.head_dim)
        q, q_scales = ctx.ops.rope_fp8(q, cos, sin) if fp8 else (ctx.ops.rope(q, cos, sin), None)
        if plan.candidates.shape[1] == 0:                                    # no entry complete yet
            return plan.candidates
        scores = ctx.ops.index_scores(q, weights, cache.index_keys, plan.candidates,
                                      weight_scale=self.weight_scale, key_scales=cache.index_scales,
                                      q_scales=q_scales)                # [T, V], -inf: none
        return ctx.ops.topk(scores, plan.visible, self.topk)                    # [T, k'], -1: none
