"""DeepSeekV4ForCausalLM: embed -> n streams -> blocks (mHC) -> hc_head -> norm -> head (spec §4).

One model, two paths (DESIGN decision 1): this file is the full-sequence path (autograd, used by
training and as the oracle of the serving engine). Parameter names follow the official DeepSeek
checkpoint (embed, layers.L.attn.wq_a, ..., head) except that the hyper-connection parameters
live in submodules (`hc_attn.fn` for the checkpoint's `hc_attn_fn`) and routed experts are
stacked.
"""

from __future__ import annotations

import contextlib
import re
from typing import cast

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dsv4.config.model import ModelConfig
from dsv4.kernels.ref.batch_invariant import batch_invariant
from dsv4.kernels.ref.batch_invariant import is_active as batch_invariant_active
from dsv4.model.block import Block
from dsv4.model.forward_context import ForwardContext
from dsv4.model.forward_mode import INFERENCE, ForwardMode, Replay
from dsv4.model.hyper_connection import HyperHead
from dsv4.model.indexer import Indexer
from dsv4.model.layers.norm import RMSNorm
from dsv4.model.layers.rope import RotaryEmbedding, lookup_rows
from dsv4.model.mtp import MTPBlock
from dsv4.model.quant_linear import QuantLinear

# Parameters kept in fp32 whatever the model dtype (the reference's precision choices, spec
# §11/§12).
_COMPRESSOR_PROJ_NAME = r"compressor\.(wkv|wgate)\.weight"
_FP32_PARAMS = re.compile(
    r"(norm\.weight|hc_\w+\.(fn|base|scale)|hc_head\.(fn|base|scale)|attn_sink|\.ape|gate\.bias"
    rf"|{_COMPRESSOR_PROJ_NAME})$")
# kept bf16 in checkpoint precision, as stored (`cast_`)
_COMPRESSOR_PROJ = re.compile(rf"{_COMPRESSOR_PROJ_NAME}$")


def keeps_fp32(name: str) -> bool:
    """True for parameters that stay fp32 in a bf16 model.

    These are norms, mHC, sinks, ape, gate bias and the compressor projections.
    """
    return bool(_FP32_PARAMS.search(name))


def _param_dtype(name: str, dtype: torch.dtype, checkpoint_precision: bool) -> torch.dtype:
    """The dtype `cast_` gives parameter `name` of a `dtype` model."""
    if checkpoint_precision and _COMPRESSOR_PROJ.search(name):
        return torch.bfloat16
    return torch.float32 if keeps_fp32(name) else dtype


class DeepSeekV4ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = self.config = config
        # uninitialised like every other weight (loaded, or `train/init.py`); nn.Embedding's own
        # normal_ init would cost a vocab x hidden fill, and on the meta device it imports
        # torch._dynamo (over a second of every process start)
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size,
                                  _weight=torch.empty(c.vocab_size, c.hidden_size))
        self.layers = nn.ModuleList(Block(c, a, m, i) for i, (a, m)
                                    in enumerate(zip(c.attn_types, c.moe_types, strict=True)))
        self.hc_head = HyperHead(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTPBlock(c, c.num_layers + i) for i in range(c.num_mtp_layers))
        self.rope_main = RotaryEmbedding(c, compressed=False)
        self.rope_compress = RotaryEmbedding(c, compressed=True)

    def cast_(self, dtype: torch.dtype,
              checkpoint_precision: bool = False) -> DeepSeekV4ForCausalLM:
        """Cast floating parameters to `dtype`, keeping the fp32 set (see `keeps_fp32`) in fp32.

        `checkpoint_precision` (a `weight_format="checkpoint"` model): the compressor projections
        instead stay bf16, as the checkpoint stores them (spec §12): the same values, half the
        bytes; they still run in fp32 (the `project` op widens them as it reads them)."""
        for name, p in self.named_parameters():
            if p.is_floating_point():
                p.data = p.data.to(_param_dtype(name, dtype, checkpoint_precision))
        return self

    def set_index_cache_dtype(self, index_cache_dtype: str) -> None:
        """The indexer keys' format (`EngineConfig.index_cache_dtype`): "model" or "fp8". With
        "fp8" every indexer rounds its keys and queries to FP8 (`kernels/ref/index_keys.py`) in
        the full-sequence forward too, as an engine's FP8 pools and scores do."""
        if index_cache_dtype not in ("model", "fp8"):
            raise ValueError(f"index_cache_dtype={index_cache_dtype!r} is invalid; allowed: "
                             "['model', 'fp8']")
        for module in self.modules():
            if isinstance(module, Indexer):
                module.fp8 = index_cache_dtype == "fp8"

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (RoPE tables; FP8 linears' split-K counters), e.g.
        after `to_empty` from meta."""
        self.rope_main.reset_buffers()
        self.rope_compress.reset_buffers()
        for module in self.modules():
            if isinstance(module, QuantLinear):
                module.reset_buffers()

    def build_rope_cache(self, max_positions: int) -> int:
        """Cache both RoPE tables' (cos, sin) rows of positions 0 .. max_positions-1 for the
        serving path (`RotaryEmbedding.build_cache`: bit-equal to computing them); returns the
        bytes. A serving step's positions must stay below `rope_cache_positions`."""
        return (self.rope_main.build_cache(max_positions)
                + self.rope_compress.build_cache(max_positions))

    @property
    def rope_cache_positions(self) -> int | None:
        """Positions the serving path's RoPE cache covers (0..N-1); None: no cache, every row is
        computed."""
        if self.rope_main.cache is None or self.rope_compress.cache is None:
            return None
        return min(self.rope_main.cached_positions, self.rope_compress.cached_positions)

    def rope_tables(self, seq_len: int,
                    device: torch.device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) [S, rd/2] fp32 per table at positions 0..S-1."""
        pos = torch.arange(seq_len, device=device)
        return {"main": self.rope_main(pos), "compress": self.rope_compress(pos)}

    def forward_streams(self, input_ids: torch.Tensor,
                        mode: ForwardMode = INFERENCE) -> torch.Tensor:
        """input_ids: [B, S] -> the streams after the last block, [B, S, n, d] (MTP's input).

        A mode with a `replay` is checked first (`check_replay`: one host sync)."""
        if mode.replay is not None:
            self.check_replay(input_ids, mode.replay)
        e = self.embed(input_ids)
        x = e.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1)
        tables = self.rope_tables(input_ids.shape[1], input_ids.device)
        for layer in self.layers:
            cos, sin = tables["main" if layer.attn_type == "swa" else "compress"]
            if mode.checkpoint_blocks:      # its activations recomputed in the backward
                x = checkpoint(layer, x, input_ids, cos, sin, mode=mode, use_reentrant=False,
                               context_fn=_recompute_contexts)
            else:
                x = layer(x, input_ids, cos, sin, mode=mode)
        return x

    def check_replay(self, input_ids: torch.Tensor, replay: Replay) -> None:
        """Raise ValueError unless `replay` fits a forward of `input_ids` [B, S]: shapes
        [B, S, num_layers, k] / [B, S, num_csa_layers, index_topk], expert ids in [-1, E),
        entry ids in [-1, S // csa_ratio), and hash layers' recorded ids equal to their table
        (a misaligned layer axis shows up here). The sync point of a replayed forward."""
        c = self.config
        B, S = input_ids.shape
        arrays = (("experts", replay.experts, (B, S, c.num_layers, c.num_experts_per_tok),
                   c.n_routed_experts),
                  ("indexer", replay.indexer, (B, S, c.attn_types.count("csa"), c.index_topk),
                   S // c.csa_ratio))
        for name, ids, shape, limit in arrays:
            if ids is None:
                continue
            if tuple(ids.shape) != shape or ids.is_floating_point():
                raise ValueError(f"replay.{name} has shape {tuple(ids.shape)} ({ids.dtype}); "
                                 f"expected an integer tensor of shape {shape}")
            if ids.numel() and (int(ids.min()) < -1 or int(ids.max()) >= limit):
                raise ValueError(f"replay.{name} holds ids outside [-1, {limit}): "
                                 f"[{int(ids.min())}, {int(ids.max())}]")
        if replay.experts is not None:
            for i, layer in enumerate(self.layers):
                assert isinstance(layer, Block)
                table = layer.ffn.gate.tid2eid
                if table is None:
                    continue
                got = replay.experts[:, :, i]
                want = table[input_ids].to(got.dtype)
                if not bool(((got == want) | (got < 0)).all()):
                    raise ValueError(f"replay.experts layer {i} (hash-routed) differs from the "
                                     "layer's tid2eid table: the layer axis is misaligned")

    def forward_batch(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Serving path: input_ids [T] (new tokens of all requests) -> fp32 logits [R, V].

        The R rows are the tokens of `ctx.logits_index`. RoPE rows come from the tables' caches
        when built (`build_rope_cache`), else are computed: the same bits either way.
        """
        return self.forward_batch_streams(input_ids, ctx)[0]

    def forward_batch_streams(self, input_ids: torch.Tensor,
                              ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward_batch`, also returning the streams after the last block for every new token,
        [T, n, d] (the MTP block's input)."""
        # every RoPE row of the step in one gather (`lookup_rows`: one launch with the caches)
        plans = list(ctx.plans.values())
        rows = lookup_rows([(self.rope_main, ctx.positions), (self.rope_compress, ctx.positions),
                            *((self.rope_compress, plan.entry_pos) for plan in plans)],
                           ctx.ops.rope_rows)
        tables = {"main": rows[0], "compress": rows[1]}
        for plan, (cos, sin) in zip(plans, rows[2:], strict=True):
            plan.entry_cos, plan.entry_sin = cos, sin
        ids = input_ids.unsqueeze(0)                                            # [1, T]
        # the n streams start as copies of the embedding, materialised once here: the first
        # layer's mHC pre and post ops take contiguous streams (an expand is copied by each)
        x = self.embed(ids).unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
        # each block's last post runs fused with the next block's first pre (`Block.serve`)
        blocks = [cast(Block, layer) for layer in self.layers]
        pre = blocks[0].hc_attn.pre(x, ctx) if blocks else None
        for i, block in enumerate(blocks):
            cos, sin = tables["main" if block.attn_type == "swa" else "compress"]
            nxt = blocks[i + 1].hc_attn if i + 1 < len(blocks) else None
            assert pre is not None
            x, pre = block.serve(x, pre, ids, cos, sin, ctx, nxt)
        streams = x[0]
        if not ctx.logits_all:
            x = x[0, ctx.logits_index].unsqueeze(0)                             # [1, R, n, d]
        return self.logits(self.norm(self.hc_head(x, ctx), ctx))[0], streams

    def mtp_forward_batch(self, streams: torch.Tensor, next_ids: torch.Tensor,
                          ctx: ForwardContext, depth: int = 0
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """Serving path of MTP block `depth` over the step of `ctx`: streams [T, n, d] (the main
        streams of the step's tokens, `forward_batch_streams`), next_ids [T] (each token's
        successor) -> (fp32 logits [R, V] of the token after next at `ctx.logits_index`, the
        block's output streams [T, n, d]). The block reads and writes its own SWA cache,
        `ctx.caches[num_layers + depth]`; it never adds to `ctx.captured` (MTP layers are not
        replayed)."""
        if not 0 <= depth < len(self.mtp):
            raise ValueError(f"mtp depth={depth} out of range; "
                             f"the model has {len(self.mtp)} MTP layers")
        mtp: MTPBlock = self.mtp[depth]  # type: ignore[assignment]
        cos, sin = self.rope_main.lookup(ctx.positions)
        ids = next_ids.unsqueeze(0)
        captured, ctx.captured = ctx.captured, None
        try:
            x = mtp.mix_inputs(streams.unsqueeze(0), self.embed(ids), ctx)
            x = Block.forward(mtp, x, ids, cos, sin, ctx)                      # [1, T, n, d]
        finally:
            ctx.captured = captured
        rows = x if ctx.logits_all else x[0, ctx.logits_index].unsqueeze(0)
        return self.logits(mtp.norm(mtp.hc_head(rows, ctx), ctx))[0], x[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [B, S, d] normed final state -> fp32 logits [B, S, V]."""
        return self.head(hidden).float()

    def forward(self, input_ids: torch.Tensor, mode: ForwardMode = INFERENCE) -> torch.Tensor:
        """input_ids: LongTensor [B, S] -> logits FloatTensor [B, S, V] (fp32), computed as `mode`
        says (`model/forward_mode.py`: INFERENCE, or TRAINING for a cheap backward)."""
        v = mode.values
        return self.logits(self.norm(self.hc_head(self.forward_streams(input_ids, mode), None, v),
                                     None, v))

    def mtp_logits(self, streams: torch.Tensor, next_ids: torch.Tensor, depth: int = 0,
                   mode: ForwardMode = INFERENCE) -> torch.Tensor:
        """MTP block `depth`: main streams [B, S, n, d], ids one step ahead [B, S] -> [B, S, V]."""
        if not 0 <= depth < len(self.mtp):
            raise ValueError(f"mtp depth={depth} out of range; "
                             f"the model has {len(self.mtp)} MTP layers")
        cos, sin = self.rope_tables(next_ids.shape[1], next_ids.device)["main"]
        mtp: MTPBlock = self.mtp[depth]  # type: ignore[assignment]
        hidden = mtp.hidden(streams, self.embed(next_ids), next_ids, cos, sin, mode)
        return self.logits(hidden)


def _recompute_contexts() -> tuple[contextlib.AbstractContextManager[None],
                                   contextlib.AbstractContextManager[None]]:
    """A checkpointed block's (forward, recompute) contexts, chosen at its forward: the recompute
    runs under the batch-invariant ops when the forward did (the backward runs outside the
    trainer's `numerics()` context), so it recomputes the forward's bits."""
    recompute = batch_invariant() if batch_invariant_active() else contextlib.nullcontext()
    return contextlib.nullcontext(), recompute


def num_params(config: ModelConfig) -> int:
    """Parameter count of the main model (no MTP), computed from the shapes on the meta device."""
    with torch.device("meta"):
        model = DeepSeekV4ForCausalLM(config)
    return sum(p.numel() for n, p in model.named_parameters() if not n.startswith("mtp."))
