"""DeepSeek-V4 attention: shared single-KV-head MQA over a sliding window plus compressed entries.

Per layer type (spec §3, §6):
- swa: the W raw keys `max(0, t-W+1) .. t` only ("main" RoPE);
- csa: window + the indexer's top-k C4 entries (overlap compressor, ratio 4);
- hca: window + every visible C128 entry (ratio m').
One softmax runs over the union with a per-head sink; K = V carries RoPE on its trailing channels,
so the output is de-rotated at the query position before the grouped output projection.

Full-sequence path: every key (raw window keys of all rows, then compressed entries of all rows)
goes into one flat buffer and each query gets a row of indices into it
(`kernels/ref/attention.py`).

Serving path with HiSparse (`LayerCache.hot`): a CSA layer's entries go to the HotSet's host
mirror, and its sparse attention reads the picks from the hot rows or from the step's staged
picks (`_c4_reads`) instead of an entry pool; same values, same index columns.

Serving path with fused projections (`model/fused_projections.py`, the engine's default): the
projections that read one input run as one GEMM per group (x: wq_a, wkv and the indexer's
weights_proj, or wq_a | wkv alone when they are FP8 codes; q_lat: wq_b and the indexer's wq_b; x in
fp32: the compressors' wkv and wgate, through the `project` op), and the ops read the output's
column slices in place. The full-sequence path's index and mask helpers: `attention_masks.py`.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.cache.pools import LayerCache
from dsv4.config.model import ModelConfig
from dsv4.kernels.ref.attention import sparse_attention
from dsv4.kernels.ref.rope_norm import apply_rope, rms_norm, rms_normalize
from dsv4.kernels.registry import KernelOps
from dsv4.model.attention_masks import (
    dense_entry_indices,
    dense_masked_attention,
    pad_columns,
    window_indices,
)
from dsv4.model.compressor import Compressor
from dsv4.model.forward_context import CompressPlan, ForwardContext
from dsv4.model.forward_mode import ForwardMode
from dsv4.model.indexer import Indexer
from dsv4.model.kernel_values import kernel_values
from dsv4.model.layers.fused import FusedRows
from dsv4.model.layers.norm import RMSNorm
from dsv4.model.layers.rope import token_rows
from dsv4.model.quant_linear import QuantLinear, linear
from dsv4.model.streams import join, side


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, attn_type: str, layer_id: int = -1) -> None:
        super().__init__()
        c = config
        self.attn_type, self.window = attn_type, c.window
        # the layer's index into Replay.indexer (the j-th CSA layer); None if never replayed
        self.csa_index = (c.attn_types[:layer_id].count("csa")
                          if attn_type == "csa" and 0 <= layer_id < c.num_layers else None)
        # fixed index-row width of the compressed part (ForwardMode / ForwardContext
        # `fixed_widths`): the indexer's k (CSA), every entry of the longest context (HCA)
        self.entry_width = (c.index_topk if attn_type == "csa" else
                            c.max_position_embeddings // c.hca_ratio if attn_type == "hca" else 0)
        self.n_heads, self.head_dim, self.o_groups = c.num_heads, c.head_dim, c.o_groups
        self.eps, self.scale = c.rms_norm_eps, c.softmax_scale
        self.wq_a = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.wq_b = nn.Linear(c.q_lora_rank, c.num_heads * c.head_dim, bias=False)
        self.wkv = nn.Linear(c.hidden_size, c.head_dim, bias=False)
        self.kv_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.wo_a = nn.Linear(c.num_heads * c.head_dim // c.o_groups, c.o_groups * c.o_lora_rank,
                              bias=False)
        self.wo_b = nn.Linear(c.o_groups * c.o_lora_rank, c.hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(c.num_heads, dtype=torch.float32))
        # wo_b's output reduced across tensor-parallel ranks (`distributed/tp.py` swaps in an
        # all-reduce; one process: identity)
        self.reduce: nn.Module = nn.Identity()
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        if attn_type != "swa":
            ratio = c.csa_ratio if attn_type == "csa" else c.hca_ratio
            self.compressor = Compressor(c.hidden_size, c.head_dim, ratio, attn_type == "csa",
                                         c.rms_norm_eps)
        if attn_type == "csa":
            self.indexer = Indexer(c)
        # the serving path's fused projections (`model/fused_projections.py`; None: one GEMM per
        # projection): x -> wq_a | wkv (| indexer weights_proj); q_lat -> wq_b (| indexer wq_b);
        # x fp32 -> compressor wkv | wgate (| indexer compressor wkv | wgate)
        self.fused_x: FusedRows | None = None
        self.fused_q: FusedRows | None = None
        self.fused_compress: FusedRows | None = None

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            values: KernelOps | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, S, d] -> (q [B, S, H, D] roped, kv [B, S, D] roped, q_lat [B, S, q_lora]).

        `values`: `ForwardMode.values` (the q norm and the fused norm + RoPE ops' values from that
        backend, on per-token cos / sin rows as the serving path passes them)."""
        q_lat = self.q_norm(self.wq_a(x), None, values)
        q = self.wq_b(q_lat).unflatten(-1, (self.n_heads, self.head_dim))
        kv, w, eps = self.wkv(x), self.kv_norm.weight, self.kv_norm.eps

        # normalised and rotated in fp32, rounded once (the serving ops' rounding)
        def q_ref(q_: torch.Tensor) -> torch.Tensor:
            return apply_rope(rms_normalize(q_.float(), self.eps), cos.unsqueeze(-2),
                              sin.unsqueeze(-2)).to(q_.dtype)

        def kv_ref(kv_: torch.Tensor, w_: torch.Tensor) -> torch.Tensor:
            return apply_rope(rms_norm(kv_.float(), w_, eps), cos, sin).to(kv_.dtype)

        if values is None:
            return q_ref(q), kv_ref(kv, w), q_lat
        ops, (B, S), rows = values, x.shape[:2], token_rows(cos, sin, x.shape[0])

        def q_op(q_: torch.Tensor) -> torch.Tensor:
            return ops.q_norm_rope(q_.reshape(B * S, *q_.shape[2:]), *rows, self.eps).view_as(q_)

        def kv_op(kv_: torch.Tensor, w_: torch.Tensor) -> torch.Tensor:
            pool = torch.empty(B * S, kv_.shape[-1], dtype=kv_.dtype, device=kv_.device)
            slots = torch.arange(B * S, device=kv_.device)
            ops.kv_norm_rope_store(kv_.reshape(B * S, -1), w_, eps, *rows, pool, slots)
            return pool.view_as(kv_)

        return kernel_values(q_op, q_ref, q), kernel_values(kv_op, kv_ref, kv, w), q_lat

    def output(self, o: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
               ops: KernelOps | None = None) -> torch.Tensor:
        """o: [B, S, H, D] attention output -> [B, S, d]: de-rotate (unless cos is None: done by the
        attention op, `inverse_rope`), grouped wo_a, then wo_b. `ops`: the serving path's
        backend, for checkpoint-format FP8 projections (`model/quant_linear.py`)."""
        B, S = o.shape[:2]
        if cos is not None and sin is not None:
            o = apply_rope(o, cos.unsqueeze(-2), sin.unsqueeze(-2), inverse=True)
        groups = o.reshape(B, S, self.o_groups, -1)                     # [B, S, g, H*D/g]
        if isinstance(self.wo_a, QuantLinear):
            z = self.wo_a.grouped(groups, ops)
        else:
            w = self.wo_a.weight.view(self.o_groups, -1, groups.shape[-1])  # [g, o_lora, H*D/g]
            z = torch.einsum("bsgd,grd->bsgr", groups, w)
        return self.reduce(linear(self.wo_b, z.flatten(2), ops))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx: ForwardContext | None = None, layer_id: int = -1, *,
                mode: ForwardMode | None = None) -> torch.Tensor:
        """x: [B, S, d] (serving path: [1, T, d]); cos/sin: [S, rd/2] of this layer's table ->
        [B, S, d]. A serving step passes its `ctx`; a full-sequence forward its `mode`."""
        if ctx is not None:
            return self.forward_cached(x, cos, sin, ctx, ctx.caches[layer_id])
        assert mode is not None, "a full-sequence forward needs a ForwardMode"
        return self.forward_full(x, cos, sin, mode)

    def forward_full(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     mode: ForwardMode) -> torch.Tensor:
        """Full-sequence path: x [B, S, d] -> [B, S, d]; cos/sin: [S, rd/2] of this layer's table.

        `mode.attention` "gathered": the serving path's formulation (one index row per query into
        the flat [window keys | entries] buffer); "dense": the same softmax as masked dense
        attention (`dense_masked_attention`), two matmuls whose backward is cheap where the
        gathered form's scatters every key into hundreds of query rows. Both are tested equal
        (`model/forward_mode.py`). `mode.values`: the backend's `sparse_attention` gives the
        values, the chosen form the gradients.
        """
        B, S, _ = x.shape
        q, kv, q_lat = self.qkv(x, cos, sin, mode.values)
        entries, picks = None, None
        if self.compressor is not None:
            paired = self.indexer.compressor if self.indexer is not None else None
            entries = self.compressor(x, cos, sin, mode.values, paired)         # [B, E, D]
            replay = mode.replay
            if self.indexer is not None and replay is not None and replay.indexer is not None:
                assert self.csa_index is not None, "indexer replay on a layer outside the model"
                picks = replay.indexer[:, :, self.csa_index].long()           # [B, S, k]
            elif self.indexer is not None:
                picks = self.indexer(x, q_lat, cos, sin, mode.values)          # [B, S, k']
            else:
                picks = dense_entry_indices(B, S, entries.shape[1], self.compressor.ratio,
                                            x.device)
            if mode.fixed_widths:
                picks = pad_columns(picks, self.entry_width)
        if entries is None:
            entries = kv.new_zeros(B, 0, self.head_dim)
        attend = self._dense if mode.attention == "dense" else self._gathered
        if mode.values is None:
            return self.output(attend(picks, q, kv, entries, self.attn_sink), cos, sin)
        # the serving op de-rotates o itself (`inverse_rope`), as the serving path calls it
        ops, rows = mode.values, token_rows(cos, sin, B)

        def ref(*a: torch.Tensor) -> torch.Tensor:
            return apply_rope(attend(picks, *a), cos.unsqueeze(-2), sin.unsqueeze(-2),
                              inverse=True)
        o = kernel_values(lambda *a: self._kernel(ops, picks, *a, inverse_rope=rows), ref, q, kv,
                          entries, self.attn_sink)
        return self.output(o, None, None)

    def _dense(self, picks: torch.Tensor | None, q: torch.Tensor, kv: torch.Tensor,
               entries: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
        """`dense_masked_attention` of a full-sequence forward: [B, S, H, D]."""
        return dense_masked_attention(q, kv, entries if picks is not None else None, picks,
                                      self.window, sink, self.scale)

    def _gathered(self, picks: torch.Tensor | None, q: torch.Tensor, kv: torch.Tensor,
                  entries: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
        """One index row per query into the flat [window keys | entries] buffer: [B, S, H, D]."""
        B, S = q.shape[:2]
        keys, idx = kv.reshape(B * S, -1), window_indices(B, S, self.window, q.device)
        if picks is not None:
            E = entries.shape[1]
            offset = B * S + torch.arange(B, device=q.device)[:, None, None] * E
            picks = torch.where(picks >= 0, picks + offset, picks)
            keys = torch.cat((keys, entries.reshape(B * E, self.head_dim)))
            idx = torch.cat((idx, picks), dim=-1)
        o = sparse_attention(q.reshape(B * S, self.n_heads, -1), keys, idx.reshape(B * S, -1),
                             sink, self.scale)
        return o.view(B, S, self.n_heads, -1)

    def _kernel(self, ops: KernelOps, picks: torch.Tensor | None, q: torch.Tensor,
                kv: torch.Tensor, entries: torch.Tensor, sink: torch.Tensor, *,
                inverse_rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The backend's `sparse_attention` on the serving path's sources (window keys, then the
        entries, each query's index rows laid out as the engine lays them out) with its output
        de-rotated (`inverse_rope`: per-token rows, as the serving path passes them):
        [B, S, H, D]."""
        B, S = q.shape[:2]
        window = window_indices(B, S, self.window, q.device).reshape(B * S, -1)
        sources = [(kv.reshape(B * S, -1), window)]
        if picks is not None:
            E = entries.shape[1]
            rows = torch.arange(B, device=q.device)[:, None, None] * E
            ids = torch.where(picks >= 0, picks + rows, picks).reshape(B * S, -1)
            sources.append((entries.reshape(B * E, self.head_dim).to(kv.dtype), ids))
        o = ops.sparse_attention(q.reshape(B * S, self.n_heads, -1), sources, sink, self.scale,
                                 inverse_rope=inverse_rope)
        return o.view(B, S, self.n_heads, -1)

    def compressors(self) -> list[Compressor]:
        """The layer's compressors: its own, then (CSA) its indexer's."""
        assert self.compressor is not None
        return [self.compressor] + ([self.indexer.compressor] if self.indexer is not None else [])

    def _compress_projections(self, x: torch.Tensor,
                              ctx: ForwardContext) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The raw (kv, score) [T, c*Dc] fp32 of each compressor (`compressors`) for x [T, d] (the
        `project` op takes x's fp32 values: no cast here): each compressor's two `project` ops,
        or one `project` on the fused weight whose column slices they are. The compress ops add
        the scores' ape as they pool (`model/compressor.py`)."""
        compressors = self.compressors()
        if self.fused_compress is None:
            return [c.project(x, ctx.ops) for c in compressors]
        parts = self.fused_compress(x, ctx.ops.project)
        return [(parts[2 * i], parts[2 * i + 1]) for i in range(len(compressors))]

    def _compress_pair(self, projected: list[tuple[torch.Tensor, torch.Tensor]],
                       ctx: ForwardContext, plan: CompressPlan, cache: LayerCache) -> None:
        """CSA: this step's entries and ring rows of both compressors, attention and indexer, from
        their projections (`_compress_projections`)."""
        assert self.compressor is not None and self.indexer is not None and cache.state is not None
        assert cache.index_state is not None and cache.index_keys is not None
        assert plan.entry_cos is not None and plan.entry_sin is not None
        own, idx = self.compressor, self.indexer.compressor
        assert own.norm.eps == idx.norm.eps, "compress_pair takes one eps"
        if cache.hot is not None:
            self._compress_pair_hot(projected, ctx, plan, cache)
            return
        assert cache.entries is not None
        # FP8 keys: each rounded to the model dtype (the pool's other tensors') first
        ctx.ops.compress_pair(own.target(projected[0], cache.state, cache.entries),
                              idx.target(projected[1], cache.index_state, cache.index_keys,
                                         cache.index_scales, cache.swa.dtype),
                              plan.index, own.norm.eps, plan.entry_cos, plan.entry_sin)

    def _compress_pair_hot(self, projected: list[tuple[torch.Tensor, torch.Tensor]],
                           ctx: ForwardContext, plan: CompressPlan, cache: LayerCache) -> None:
        """`_compress_pair` with HiSparse: both compressors write a per-step scratch (one index
        serves the pair); the indexer keys then go to their pool, the entries to the host mirror
        and their hot copies (`HotLayer.write`)."""
        assert self.compressor is not None and self.indexer is not None and cache.hot is not None
        assert cache.state is not None and cache.index_state is not None
        assert cache.index_keys is not None
        assert plan.entry_cos is not None and plan.entry_sin is not None
        own, idx = self.compressor, self.indexer.compressor
        hs = ctx.hisparse
        assert hs is not None, "a layer with a HotSet needs the step's HiSparse rows"
        T = projected[0][0].shape[0]
        entries = cache.hot.pool.new_zeros(T + 1, own.out_dim)
        keys = cache.index_keys.new_zeros(T + 1, idx.out_dim)
        scales = None if cache.index_scales is None else cache.index_scales.new_zeros(T + 1)
        ctx.ops.compress_pair(own.target(projected[0], cache.state, entries),
                              idx.target(projected[1], cache.index_state, keys, scales,
                                         cache.swa.dtype),
                              plan.index._replace(write_slot=hs.scratch_rows), own.norm.eps,
                              plan.entry_cos, plan.entry_sin)
        cache.index_keys[plan.write_slot] = keys[:T]
        if scales is not None:
            assert cache.index_scales is not None
            cache.index_scales[plan.write_slot] = scales[:T]
        cache.hot.write(hs.write_slots, hs.write_entries, entries[:T], hot=hs.use_hot,
                        one_row=hs.one_row)

    def _c4_reads(self, ids: torch.Tensor, slots: torch.Tensor, ctx: ForwardContext,
                  cache: LayerCache) -> tuple[torch.Tensor, torch.Tensor]:
        """(pool, rows [T, k]) the sparse attention reads for the indexer's picks: entry ids and
        their entry-pool slots [T, k] (-1 = none; `ops.pick_slots`). The entry pool at those
        slots, or with HiSparse the hot set's rows (`select`: misses are copied in) or, for a step
        with a longer prefill chunk, the step's picks staged from the host mirror (`stage`). Same
        values in the same columns either way."""
        if cache.hot is not None:
            hs = ctx.hisparse
            assert hs is not None, "a layer with a HotSet needs the step's HiSparse rows"
            if hs.use_hot:
                return cache.hot.pool, cache.hot.select(hs.token_slots, ids, hs.one_row)
            return cache.hot.stage(hs.token_slots, ids)
        assert cache.entries is not None
        return cache.entries, slots

    def _x_projections(self, x: torch.Tensor, ops: KernelOps
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x [T, d] -> (wq_a [T, q_lora], wkv [T, D], the indexer's weights_proj [T, Ih] where it
        rides the fused GEMM, else None): one GEMM when fused (`fused_x`), else one each."""
        if self.fused_x is not None:             # (FP8 checkpoints: wq_a | wkv only)
            parts = self.fused_x(x, self.fused_x.gemm(ops))
            return parts[0], parts[1], parts[2] if len(parts) > 2 else None
        return linear(self.wq_a, x, ops), linear(self.wkv, x, ops), None

    def _index_weights_alone(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor | None:
        """The indexer's weights_proj(x) [T, Ih] where no fused x GEMM carries it (an FP8
        checkpoint's wq_a | wkv cannot), run in the indexer's branch; else None."""
        if self.indexer is None or (self.fused_x is not None and len(self.fused_x.sizes) > 2):
            return None
        return linear(self.indexer.weights_proj, x, ops)

    def forward_cached(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       ctx: ForwardContext, cache: LayerCache) -> torch.Tensor:
        """Serving path over the paged pools. Writes this step's KV, compressor state and entries
        first (a query sees itself and the entry it completes), then attends. The projections
        that read one input run as one GEMM each where the layer is fused (`fused_x`, `fused_q`,
        `fused_compress`), their outputs then column slices of it (row stride: the group's width),
        which the ops read in place.

        With `ctx.side_stream` the compressors (they read x only; and the indexer's
        weights_proj where no fused GEMM carries it) and then the indexer (after q_lat; unfused,
        its query projection too, beside wq_b) run on the side stream while the query and
        window-KV path runs on the main one; joined before the attention (`model/streams.py`)."""
        T, x = x.shape[1], x[0]                                               # x: [T, d]
        stream = ctx.side_stream if self.compressor is not None else None
        with side(stream):
            plan = self._compress(x, ctx, cache)
            index_w = self._index_weights_alone(x, ctx.ops)
        q_a, kv, fused_w = self._x_projections(x, ctx.ops)
        index_w = fused_w if index_w is None else index_w
        q_lat = self.q_norm(q_a, ctx)                                         # [T, q_lora]
        q_raw = index_q = None
        if self.fused_q is not None:
            q_raw, index_q = self.fused_q(q_lat, self.fused_q.gemm(ctx.ops))
        with side(stream):
            if index_q is None and self.indexer is not None:
                index_q = linear(self.indexer.wq_b, q_lat, ctx.ops)
            compressed = self._compressed_source(index_q, index_w, cos, sin, ctx, plan, cache)
        if q_raw is None:
            q_raw = linear(self.wq_b, q_lat, ctx.ops)
        # q normed and rotated; the window kv normed, rotated, straight to its slot: one op
        q = ctx.ops.qkv_norm_rope(q_raw.view(T, self.n_heads, self.head_dim), self.eps, kv,
                                  self.kv_norm.weight, self.kv_norm.eps, cos, sin, cache.swa,
                                  ctx.swa_write)
        join(stream)
        sources = [(cache.swa, ctx.window)] + compressed
        o = ctx.ops.sparse_attention(q, sources, self.attn_sink, self.scale,
                                     inverse_rope=(cos, sin))
        return self.output(o.view(1, T, self.n_heads, -1), None, None, ops=ctx.ops)

    def _compress(self, x: torch.Tensor, ctx: ForwardContext,
                  cache: LayerCache) -> CompressPlan | None:
        """This step's compressor work from x [T, d]: the projections (`_compress_projections`),
        then both compressors of a CSA layer in one op, or the one of an HCA layer; their plan
        (None without a compressor)."""
        if self.compressor is None:
            return None
        assert cache.state is not None
        plan = ctx.plans[self.compressor.ratio]
        projected = self._compress_projections(x, ctx)
        if self.indexer is not None:
            self._compress_pair(projected, ctx, plan, cache)
        else:
            assert cache.entries is not None
            self.compressor.forward_cached(projected[0], ctx, plan, cache.state, cache.entries)
        return plan

    def _compressed_source(self, index_q: torch.Tensor | None, index_w: torch.Tensor | None,
                           cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext,
                           plan: CompressPlan | None,
                           cache: LayerCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The compressed entries the queries attend to, as (pool, slots [T, width]): the
        indexer's picks (from its projections `index_q`, `index_w`) in a CSA layer, every visible
        entry in an HCA layer; none without a compressor."""
        if plan is None:
            return []
        if self.indexer is not None:
            assert index_q is not None and index_w is not None
            picks = self.indexer.forward_cached(index_q, index_w, cos, sin, ctx, plan, cache)
            if ctx.captured is not None or ctx.fixed_widths:
                # padded to index_topk: every step stacks alike, rows have one width
                picks = pad_columns(picks, self.indexer.topk)
            cand = plan.candidates
            if cand.shape[1] == 0:   # no entry yet (every query before the first block ends)
                cand = cand.new_full((cand.shape[0], 1), -1)
            ids, slots = ctx.ops.pick_slots(picks, cand)
            if ctx.captured is not None:
                ctx.captured.setdefault("indexer", []).append(ids)
            pool, slots = self._c4_reads(ids, slots, ctx, cache)
        else:
            assert cache.entries is not None
            pool, slots = cache.entries, plan.candidates
        if ctx.fixed_widths:
            slots = pad_columns(slots, self.entry_width)
        return [(pool, slots)]
