"""Per-rank memory plan of a serving layout (issue 22), from the checkpoint's config alone.

`plan_memory` builds what each rank allocates on the meta device, with the code that allocates
it for real: the model shard (`empty_model` + `shard_model`, or `enable_dp_attention` for
data-parallel attention: parameters and buffers), the KV pools
(`KVPools`: SWA KV, compressed entries, indexer keys, compressor rings; with HiSparse the hot sets
instead of the C4 entries, whose host mirror is counted apart), and the per-request state
(request table, penalty counts) with the RoPE cache of every position. So the plan equals the
allocation (tested on CPU against a loaded engine) and costs no memory. Not included:
activations, the CUDA graphs' private pools and the CUDA context (measure those on the GPU: the
margin `mem_fraction_static` leaves).
`dsv4 serve --dry-run` prints it.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch

from dsv4.cache.hisparse import HiSparseLayout, HotSet
from dsv4.cache.layout import plan_cache
from dsv4.cache.pools import KVPools
from dsv4.cache.req_table import RequestTable
from dsv4.config.engine import EngineConfig, WeightFormat
from dsv4.config.engine_defaults import resolve_hisparse_entries
from dsv4.config.model import ModelConfig
from dsv4.distributed.dp import DPGroup, enable_dp_attention
from dsv4.distributed.tp import TPGroup, shard_model
from dsv4.model.layers.rope import rope_cache_bytes
from dsv4.model.loader import empty_model

META = torch.device("meta")


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank allocates: `weights` (parameters and buffers of its shard), `kv` (the KV
    pools), `state` (request table, per-slot penalty state, RoPE cache); the pools' pages for
    reference; `host`: host memory (HiSparse's mirror of the C4 entries; not in `total`)."""

    rank: int
    weights: int
    kv: int
    state: int
    full_pages: int
    swa_pages: int
    host: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.state


def plan_memory(model: ModelConfig, engine: EngineConfig, dtype: torch.dtype, tp_size: int = 1,
                expert_parallel: bool = False, weight_format: WeightFormat = "bf16",
                dp_size: int = 1) -> list[RankMemory]:
    """One `RankMemory` per rank: `tp_size` tensor-parallel ranks, or (`dp_size` > 1, with
    `tp_size` 1) data-parallel-attention ranks, each with its own KV pools. `engine` needs a
    resolved KV size (`max_total_tokens` or `kv_cache_memory_gb`); raises ValueError otherwise,
    and as `shard_model` / `enable_dp_attention` do for a layout whose sizes do not divide."""
    if dp_size > 1 and tp_size > 1:
        raise ValueError(f"tp_size={tp_size} with dp_size={dp_size} is not supported; allowed: "
                         "tp_size 1 with data-parallel attention")
    if engine.max_total_tokens is None and engine.kv_cache_memory_gb is None:
        raise ValueError("max_total_tokens and kv_cache_memory_gb are both None; allowed: one of "
                         "them set (the plan needs the KV size)")
    context = engine.context_length or model.max_position_embeddings
    entries = (resolve_hisparse_entries(engine, model.index_topk) if engine.enable_hisparse
               else None)
    reserved = 0 if entries is None else HiSparseLayout.device_bytes(
        model, engine.max_running_requests, context, entries, dtype)
    layout = plan_cache(model, engine, dtype, reserved)
    table = RequestTable(layout, engine.max_running_requests, context, META)
    hot, host = None, 0
    if entries is not None:
        hot_layout = HiSparseLayout.from_configs(model, layout, engine.max_running_requests,
                                                 context, entries)
        hot = HotSet(hot_layout, table.page_table, dtype, META, host_device=META)
        host = hot_layout.pool_bytes(dtype)[1]
    kv = KVPools(model, layout, dtype, META, hot,
                 index_fp8=engine.index_cache_dtype == "fp8").nbytes()
    state = sum(_nbytes(t) for t in vars(table).values() if isinstance(t, torch.Tensor))
    state += engine.max_running_requests * model.vocab_size * (4 + 1)   # counts int32, seen bool
    state += rope_cache_bytes(model, table.max_pages * table.P)       # cos / sin of every position
    plans = []
    for rank in range(max(tp_size, dp_size)):
        full = empty_model(model, dtype, META, weight_format)
        shard = (enable_dp_attention(full, DPGroup(rank, dp_size), expert_parallel)
                 if dp_size > 1 else shard_model(full, TPGroup(rank, tp_size), expert_parallel))
        weights = sum(_nbytes(t) for t in chain(shard.parameters(), shard.buffers()))
        plans.append(RankMemory(rank, weights, kv, state, layout.num_full_pages - 1,
                                layout.num_swa_pages - 1, host))
    return plans


def format_plan(plans: list[RankMemory]) -> str:
    """A table (GB, and the pools' pages) of `plan_memory`'s result."""
    rows = [f"{'rank':>4} {'weights GB':>11} {'KV GB':>8} {'state GB':>9} {'total GB':>9} "
            f"{'full pages':>11} {'SWA pages':>10} {'host GB':>8}"]
    for p in plans:
        rows.append(f"{p.rank:>4} {p.weights / 1e9:11.3f} {p.kv / 1e9:8.3f} {p.state / 1e9:9.3f} "
                    f"{p.total / 1e9:9.3f} {p.full_pages:>11} {p.swa_pages:>10} "
                    f"{p.host / 1e9:8.3f}")
    return "\n".join(rows)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
