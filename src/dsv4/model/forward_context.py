"""ForwardContext: what the model's serving path needs for one step (batch metadata + cache).

A layer given one runs the serving path over the paged pools; a full-sequence forward passes a
`ForwardMode` instead (`model/forward_mode.py`). The engine flattens the new tokens of every
request into one row of T tokens; all index tensors below are device tensors built by index
arithmetic (`engine/metadata.py`), so a step has no per-request Python work inside the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv4.cache.pools import LayerCache
from dsv4.kernels.ref.compressor import CompressIndex
from dsv4.kernels.registry import REF, KernelOps


@dataclass
class CompressPlan:
    """Per compress ratio m: how each new token feeds the compressor and what it may attend to.

    A token at position p pools the S = 2m (overlap, C4) or m (C128) source positions
    p-S+1 .. p; only tokens with (p+1) % m == 0 write their pooled entry (the others write trash).
    """

    ratio: int
    overlap: bool
    src_new: torch.Tensor      # [T, S] index of the source position among this step's tokens
    src_ring: torch.Tensor     # [T, S] ring row of the source position (trash if not from the ring)
    from_new: torch.Tensor     # [T, S] bool: source was computed in this step
    src_valid: torch.Tensor    # [T, S] bool: source position >= 0
    # [T] entry slot written by this token (trash when it completes no window)
    write_slot: torch.Tensor
    entry_pos: torch.Tensor    # [T] RoPE position of that entry (first token of its window)
    ring_write: torch.Tensor   # [T] ring row keeping this token's projection (trash when not kept)
    # [T, V] entry slots visible to the query, ordered by entry id; -1 = none
    candidates: torch.Tensor
    # [T] number of visible entries, (p+1) // m (the valid prefix of `candidates`)
    visible: torch.Tensor
    entry_cos: torch.Tensor | None = None   # [T, rd/2] RoPE of entry_pos (filled by the model)
    entry_sin: torch.Tensor | None = None
    # no ring row read in this step is written in it (see `CompressIndex`)
    ring_reads_disjoint: bool = False

    @property
    def index(self) -> CompressIndex:
        """The gather / scatter rows the `compress` kernel op takes."""
        return CompressIndex(self.src_new, self.src_ring, self.from_new, self.src_valid,
                             self.write_slot, self.ring_write, self.ring_reads_disjoint)


@dataclass
class HiSparseStep:
    """What a C4 layer with a HotSet (`LayerCache.hot`) needs of one step (HiSparse).

    The C4 compressor writes its T entries to a scratch [T + 1, D] (row `scratch_rows[t]`), then
    they go to the host mirror (and hot copies) as entry `write_entries[t]` of request slot
    `write_slots[t]`; a token that completes no entry writes scratch row T and the pad slot.
    """

    token_slots: torch.Tensor     # [T] request slot of each token
    scratch_rows: torch.Tensor    # [T] t if the token completes a C4 entry, else T
    write_slots: torch.Tensor     # [T] its request slot if it completes one, else the pad slot
    write_entries: torch.Tensor   # [T] the entry id it completes (position // ratio), else 0
    # every request feeds at most hot entries // index_topk tokens: its picks fit its hot set
    # (`select`); else the step's picks are staged from the host mirror (`stage`)
    use_hot: bool
    # every request feeds one token (a plain decode step): the HotSet's one-launch plan may run
    one_row: bool = False


@dataclass
class ForwardContext:
    positions: torch.Tensor            # [T] absolute position of each new token
    swa_write: torch.Tensor            # [T] SWA slot of each new token
    window: torch.Tensor               # [T, W] SWA slots of positions p-W+1 .. p, -1 before 0
    plans: dict[int, CompressPlan]     # by compress ratio
    caches: list[LayerCache]           # per layer (decoder layers, then MTP layers)
    logits_index: torch.Tensor         # [R] tokens whose logits are returned
    # host-known: logits_index is arange(T) (every new token, in order: a plain decode step), so
    # the model takes the logits rows as they are instead of gathering them
    logits_all: bool = False
    ops: KernelOps = REF                # the kernel backend chosen at start-up
    # routing replay capture
    captured: dict[str, list[torch.Tensor]] | None = field(default=None)
    # index rows of one width per layer (the engine's batch-invariant mode, see ForwardMode)
    fixed_widths: bool = False
    hisparse: HiSparseStep | None = None   # with a HotSet (engine `enable_hisparse`)
    # a second stream for independent branches (engine `multi_stream`; `model/streams.py`)
    side_stream: torch.cuda.Stream | None = None
    # with a side stream: MoE layers of forwards of up to this many tokens run the shared expert
    # beside the routed experts, not beside the gate (engine `shared_expert_beside_max_tokens`;
    # `model/moe.py`)
    shared_beside_max_tokens: int = 0
