"""KVPools: the device tensors of the cache, one `LayerCache` per attention layer.

Every buffer has one extra trailing "trash" row: writes that must not land anywhere (a token that
completes no compressed entry, a ring slot that is not kept) are pointed at it, so writes stay
branch-free index copies. Nothing ever reads the trash row as valid data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.cache.layout import CacheLayout
from dsv4.config.model import ModelConfig


@dataclass
class RingState:
    """Compressor partial state: fp32 projected kv and gate scores (with `ape`) of recent tokens."""

    kv: torch.Tensor       # [num_swa_pages * ring + 1, c * Dc]
    score: torch.Tensor    # [num_swa_pages * ring + 1, c * Dc]
    ring: int

    @property
    def trash(self) -> int:
        return self.kv.shape[0] - 1


@dataclass
class LayerCache:
    attn_type: str
    swa: torch.Tensor                      # [num_swa_slots + 1, D] roped, kv-normed raw KV
    # [num_full_slots // ratio + 1, D] compressed entries (CSA / HCA)
    entries: torch.Tensor | None = None
    state: RingState | None = None
    index_keys: torch.Tensor | None = None  # [num_full_slots // csa_ratio + 1, Id] (CSA)
    index_state: RingState | None = None

    @property
    def swa_trash(self) -> int:
        return self.swa.shape[0] - 1

    @property
    def entry_trash(self) -> int:
        assert self.entries is not None
        return self.entries.shape[0] - 1


def _ring(layout: CacheLayout, ring: int, width: int, device: torch.device) -> RingState:
    rows = layout.num_swa_pages * ring + 1
    return RingState(torch.zeros(rows, width, device=device),
                     torch.full((rows, width), float("-inf"), device=device), ring)


def _layer(model: ModelConfig, layout: CacheLayout, attn_type: str, dtype: torch.dtype,
           device: torch.device) -> LayerCache:
    D, Id = model.head_dim, model.index_head_dim
    cache = LayerCache(attn_type,
                       torch.zeros(layout.num_swa_slots + 1, D, dtype=dtype, device=device))
    if attn_type == "csa":
        n = layout.num_full_slots // model.csa_ratio + 1
        cache.entries = torch.zeros(n, D, dtype=dtype, device=device)
        cache.state = _ring(layout, layout.ring_c4, 2 * D, device)
        cache.index_keys = torch.zeros(n, Id, dtype=dtype, device=device)
        cache.index_state = _ring(layout, layout.ring_c4, 2 * Id, device)
    elif attn_type == "hca":
        cache.entries = torch.zeros(layout.num_full_slots // model.hca_ratio + 1, D, dtype=dtype,
                                    device=device)
        cache.state = _ring(layout, layout.ring_c128, D, device)
    return cache


class KVPools:
    """All cache tensors: `layers[i]` for decoder layer i, then the MTP layers."""

    def __init__(self, model: ModelConfig, layout: CacheLayout, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.layout = layout
        types = list(model.attn_types) + ["swa"] * model.num_mtp_layers
        self.layers = [_layer(model, layout, t, dtype, device) for t in types]

    def nbytes(self) -> int:
        total = 0
        for c in self.layers:
            for t in (c.swa, c.entries, c.index_keys):
                total += 0 if t is None else t.numel() * t.element_size()
            for s in (c.state, c.index_state):
                total += 0 if s is None else 2 * s.kv.numel() * s.kv.element_size()
        return total
