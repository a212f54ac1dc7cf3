"""CacheLayout: page size, pool sizes and ring sizes of the KV cache, derived once from the
configs.

Coordinates (DESIGN decision 4): a request's tokens live in virtual full-token slots allocated by
pages of P tokens; there is no raw full KV buffer. Sliding-window (SWA) KV has its own pages,
reached through a full->SWA page table. C4 entries, C4 indexer keys and C128 entries sit at
`full_slot // ratio`. Compressor partial state lives in rings addressed from the SWA page:
`swa_page * ring + pos % ring` (ring 2*m for C4, m' for C128).

A running request keeps the SWA pages of its last `swa_horizon` positions: the window W and the
compressor's look-back (2*m for C4, m' for C128) both reach at most that far back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dsv4.config.engine import EngineConfig
from dsv4.config.model import ModelConfig


@dataclass(frozen=True)
class CacheLayout:
    page_size: int
    num_full_pages: int      # including the null page 0
    num_swa_pages: int       # including the null page 0
    ring_c4: int
    ring_c128: int
    swa_horizon: int

    @property
    def num_full_slots(self) -> int:
        return self.num_full_pages * self.page_size

    @property
    def num_swa_slots(self) -> int:
        return self.num_swa_pages * self.page_size

    @property
    def max_total_tokens(self) -> int:
        return (self.num_full_pages - 1) * self.page_size


def full_bytes_per_token(model: ModelConfig, dtype: torch.dtype, hisparse: bool = False,
                         index_fp8: bool = False) -> float:
    """Bytes of compressed-cache growth per token on the device (C4 entries + indexer keys + C128
    entries; with `hisparse` the C4 entries live in the host mirror and do not count; with
    `index_fp8` an indexer key takes Id one-byte codes and a 4-byte scale)."""
    elt = torch.finfo(dtype).bits // 8
    csa = sum(t == "csa" for t in model.attn_types)
    hca = sum(t == "hca" for t in model.attn_types)
    key = model.index_head_dim + 4 if index_fp8 else model.index_head_dim * elt
    c4 = key + (0 if hisparse else model.head_dim * elt)
    return csa * c4 / model.csa_ratio + elt * hca * model.head_dim / model.hca_ratio


def swa_bytes_per_page(model: ModelConfig, dtype: torch.dtype, page_size: int) -> int:
    """SWA KV of every layer plus the fp32 compressor rings hanging off one SWA page."""
    elt = torch.finfo(dtype).bits // 8
    layers = model.num_layers + model.num_mtp_layers
    csa = sum(t == "csa" for t in model.attn_types)
    hca = sum(t == "hca" for t in model.attn_types)
    ring = 4 * (csa * 2 * model.csa_ratio * 2 * 2 * (model.head_dim + model.index_head_dim)
                + hca * model.hca_ratio * 2 * model.head_dim)
    return layers * page_size * model.head_dim * elt + ring


def plan_cache(model: ModelConfig, engine: EngineConfig, dtype: torch.dtype,
               reserved_bytes: int = 0) -> CacheLayout:
    """Page counts of the pools. Explicit sizes (`max_total_tokens`, `swa_tokens`) win. Otherwise
    the KV budget is split: SWA pages get every running request's horizon plus one step's chunk
    and, with the prefix cache on and a `swa_memory_fraction` > 0 (None counts as 0: the engine
    resolves it per device), at least that share of the budget; full pages get the rest, up to
    what `max_running_requests` requests of `context_length` could use; then budget the full
    pool cannot use goes to SWA pages too, so cached prefixes are not evicted for want of window
    pages while memory sits idle; never more SWA pages than full pages (each shadows one) beyond
    the running requests' need. `reserved_bytes` (HiSparse's hot sets) come out of the KV budget
    first; with `enable_hisparse` a full page costs no C4 entries on the device."""
    P = engine.page_size
    for name, ratio in (("csa_ratio", model.csa_ratio), ("hca_ratio", model.hca_ratio)):
        if P % ratio:
            raise ValueError(f"page_size={P} is invalid; "
                             f"allowed: a multiple of the model's {name}={ratio}")
    horizon = max(model.window, 2 * model.csa_ratio, model.hca_ratio)
    if engine.swa_tokens is not None:
        swa_pages = math.ceil(engine.swa_tokens / P) + 1
    else:  # every running request's horizon plus one step's chunk, with page rounding
        per_request = math.ceil(horizon / P) + 2
        swa_pages = (engine.max_running_requests * per_request
                     + math.ceil(engine.chunked_prefill_size / P) + 1)
    if engine.max_total_tokens is not None:
        full_pages = math.ceil(engine.max_total_tokens / P) + 1
    else:
        full_pages, swa_pages = _split_budget(model, engine, dtype, swa_pages, reserved_bytes)
    return CacheLayout(page_size=P, num_full_pages=max(full_pages, 2),
                       num_swa_pages=max(swa_pages, 2),
                       ring_c4=2 * model.csa_ratio * engine.rings,
                       ring_c128=model.hca_ratio * engine.rings, swa_horizon=horizon)


def _split_budget(model: ModelConfig, engine: EngineConfig, dtype: torch.dtype,
                  swa_pages: int, reserved_bytes: int) -> tuple[int, int]:
    """(full pages, SWA pages) of the KV budget less `reserved_bytes`, SWA pages at least
    `swa_pages` (plan_cache)."""
    assert engine.kv_cache_memory_gb is not None, "the runner resolves the KV budget"
    P = engine.page_size
    total = engine.kv_cache_memory_gb * (1 << 30) - reserved_bytes
    if total <= 0:
        raise ValueError(f"kv_cache_memory_gb={engine.kv_cache_memory_gb} is too small for the "
                         f"HiSparse hot sets ({reserved_bytes / 2**30:.2f} GB); allowed: a larger "
                         "budget, or smaller hisparse_device_entries / max_running_requests")
    swa_page = swa_bytes_per_page(model, dtype, P)
    full_page = max(1.0, full_bytes_per_token(model, dtype, engine.enable_hisparse,
                                              engine.index_cache_dtype == "fp8") * P)
    fraction = engine.swa_memory_fraction or 0.0
    grow_swa = engine.swa_tokens is None and not engine.disable_prefix_cache and fraction > 0
    running = swa_pages
    if grow_swa:
        swa_pages = max(swa_pages, int(total * fraction // swa_page))
    budget = total - swa_pages * swa_page
    if budget <= 0:
        raise ValueError(f"kv_cache_memory_gb={engine.kv_cache_memory_gb} is too small for the "
                         f"SWA pools ({swa_pages} pages); allowed: a larger budget or smaller "
                         "max_running_requests")
    full_pages = int(budget // full_page) + 1
    context = engine.context_length or model.max_position_embeddings
    cap = engine.max_running_requests * math.ceil(context / P) + 1          # no use for more
    if full_pages > cap:
        if grow_swa:
            swa_pages += int((full_pages - cap) * full_page // swa_page)
        full_pages = cap
    if grow_swa:       # an SWA page shadows a full page: more could never be used
        swa_pages = min(swa_pages, max(full_pages, running))
    return full_pages, swa_pages
