"""KVPools: the device tensors of the cache, one `LayerCache` per attention layer.

Every buffer has one extra trailing "trash" row: writes that must not land anywhere (a token that
completes no compressed entry, a ring slot that is not kept) are pointed at it, so writes stay
branch-free index copies. Nothing ever reads the trash row as valid data.

With HiSparse (`cache/hisparse.py`) a C4 layer has no device `entries` pool: its `hot` view of
the engine's HotSet takes the entries (host mirror) and serves attention's reads (hot rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.cache.hisparse import HotSet
from dsv4.cache.layout import CacheLayout
from dsv4.config.model import ModelConfig


@dataclass
class RingState:
    """Compressor partial state: fp32 projected kv and raw gate scores (the compress ops add `ape`
    per slot as they pool) of recent tokens."""

    kv: torch.Tensor       # [num_swa_pages * ring + 1, c * Dc]
    score: torch.Tensor    # [num_swa_pages * ring + 1, c * Dc]
    ring: int

    @property
    def trash(self) -> int:
        return self.kv.shape[0] - 1


@dataclass(frozen=True)
class HotLayer:
    """One C4 layer's view of the engine's HotSet: where its entries go and are read from."""

    hot: HotSet
    layer: int             # the layer's index among the model's C4 (CSA) layers

    @property
    def pool(self) -> torch.Tensor:
        """[R * E + 1, D] the layer's hot rows (what `select`'s rows index)."""
        return self.hot.device_pool[self.layer]

    def write(self, slot_ids: torch.Tensor, entry_ids: torch.Tensor, values: torch.Tensor,
              hot: bool, one_row: bool = False) -> None:
        """`HotSet.write_entries` of this layer. Tokens that complete no entry pass the pad slot
        (entry 0): their value lands on the null page's host row and in no hot set."""
        self.hot.write_entries(self.layer, slot_ids, entry_ids, values, hot, one_row)

    def select(self, slot_ids: torch.Tensor, topk: torch.Tensor,
               one_row: bool = False) -> torch.Tensor:
        """`HotSet.select` of this layer: rows [T, k] of `pool`."""
        return self.hot.select(self.layer, slot_ids, topk, one_row)

    def stage(self, slot_ids: torch.Tensor,
              topk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`HotSet.stage` of this layer: (buffer [n, D], rows [T, k] into it)."""
        return self.hot.stage(self.layer, slot_ids, topk)


@dataclass
class LayerCache:
    attn_type: str
    swa: torch.Tensor                      # [num_swa_slots + 1, D] roped, kv-normed raw KV
    # [num_full_slots // ratio + 1, D] compressed entries (CSA / HCA)
    entries: torch.Tensor | None = None
    state: RingState | None = None
    index_keys: torch.Tensor | None = None  # [num_full_slots // csa_ratio + 1, Id] (CSA)
    # with FP8 indexer keys (`index_keys` float8_e4m3fn): a power-of-two scale per key, [rows]
    index_scales: torch.Tensor | None = None
    index_state: RingState | None = None
    hot: HotLayer | None = None             # CSA with HiSparse: in place of `entries`

    @property
    def swa_trash(self) -> int:
        return self.swa.shape[0] - 1

    @property
    def entry_trash(self) -> int:
        """The trash row of the entry coordinates (`entries`, or `index_keys`: same rows)."""
        rows = self.entries if self.entries is not None else self.index_keys
        assert rows is not None, "a layer without compressed entries has no entry trash row"
        return rows.shape[0] - 1


def _ring(layout: CacheLayout, ring: int, width: int, device: torch.device) -> RingState:
    rows = layout.num_swa_pages * ring + 1
    return RingState(torch.zeros(rows, width, device=device),
                     torch.full((rows, width), float("-inf"), device=device), ring)


def _layer(model: ModelConfig, layout: CacheLayout, attn_type: str, dtype: torch.dtype,
           device: torch.device, hot: HotLayer | None, index_fp8: bool) -> LayerCache:
    D, Id = model.head_dim, model.index_head_dim
    cache = LayerCache(attn_type,
                       torch.zeros(layout.num_swa_slots + 1, D, dtype=dtype, device=device))
    if attn_type == "csa":
        n = layout.num_full_slots // model.csa_ratio + 1
        if hot is None:
            cache.entries = torch.zeros(n, D, dtype=dtype, device=device)
        cache.hot = hot
        cache.state = _ring(layout, layout.ring_c4, 2 * D, device)
        cache.index_keys = torch.zeros(n, Id, dtype=torch.float8_e4m3fn if index_fp8 else dtype,
                                       device=device)
        if index_fp8:
            cache.index_scales = torch.zeros(n, device=device)
        cache.index_state = _ring(layout, layout.ring_c4, 2 * Id, device)
    elif attn_type == "hca":
        cache.entries = torch.zeros(layout.num_full_slots // model.hca_ratio + 1, D, dtype=dtype,
                                    device=device)
        cache.state = _ring(layout, layout.ring_c128, D, device)
    return cache


class KVPools:
    """All cache tensors: `layers[i]` for decoder layer i, then the MTP layers. With `hot` (a
    HotSet over the C4 layers, HiSparse), the j-th C4 layer's entries go to its j-th layer. With
    `index_fp8` the indexer keys are FP8 codes with a scale per key (`kernels/ref/index_keys.py`,
    `EngineConfig.index_cache_dtype`)."""

    def __init__(self, model: ModelConfig, layout: CacheLayout, dtype: torch.dtype,
                 device: torch.device, hot: HotSet | None = None,
                 index_fp8: bool = False) -> None:
        self.layout, self.hot = layout, hot
        types = list(model.attn_types) + ["swa"] * model.num_mtp_layers
        self.layers = [_layer(model, layout, t, dtype, device,
                              HotLayer(hot, types[:i].count("csa"))
                              if hot is not None and t == "csa" else None, index_fp8)
                       for i, t in enumerate(types)]

    def nbytes(self) -> int:
        """Device bytes of the pools (with HiSparse: the hot sets and their maps included, the
        host mirror not)."""
        total = 0 if self.hot is None else self.hot.layout.pool_bytes(self.hot.device_pool.dtype)[0]
        for c in self.layers:
            for t in (c.swa, c.entries, c.index_keys, c.index_scales):
                total += 0 if t is None else t.numel() * t.element_size()
            for s in (c.state, c.index_state):
                total += 0 if s is None else 2 * s.kv.numel() * s.kv.element_size()
        return total
