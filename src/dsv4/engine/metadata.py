"""Batch metadata by index arithmetic on the device (DESIGN decision 5).

Input: per request its slot in the request table, the first new position `start` and the number
of new tokens `n`; three small host lists, copied once. Everything else — token positions, SWA
window slots, compressed-entry write slots and visibility, compressor source rows — is computed
from the device page tables by the kernel op `step_metadata` (`KernelOps`; its specification is
`kernels/ref/metadata.py`, the triton backend runs it in one launch), so no per-request Python
runs per step and the step's index rows cost one launch.

        request r:  positions [start_r, start_r + n_r)  ->  tokens t in [off_r, off_r + n_r)
        full slot of position p  = page_table[r, p // P] * P + p % P
        SWA slot of position p   = full_to_swa[page_table[r, p // P]] * P + p % P
        entry i (ratio m)        = full slot of position i*m, divided by m
        ring row of position p   = full_to_swa[page_table[r, p // P]] * ring + p % ring
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.cache.pools import KVPools
from dsv4.cache.req_table import RequestTable
from dsv4.config.model import ModelConfig
from dsv4.kernels.ops import CompressRows, CompressSpec
from dsv4.kernels.registry import KernelOps
from dsv4.model.forward_context import CompressPlan, ForwardContext, HiSparseStep
from dsv4.utils.device import to_device


@dataclass(frozen=True)
class StepShape:
    """Host-side description of one step (the scheduler's output)."""

    slots: list[int]
    starts: list[int]
    lens: list[int]
    # per request, how many of its last new tokens produce logits (0 <= k <= n)
    num_logits: list[int]

    def logits_index(self) -> list[int]:
        """Rows (among the step's T tokens) whose logits are computed, request by request."""
        rows: list[int] = []
        end = 0
        for n, k in zip(self.lens, self.num_logits, strict=True):
            assert 0 <= k <= n, f"num_logits {k} outside [0, {n}]"
            end += n
            rows.extend(range(end - k, end))
        return rows


def compress_specs(pools: KVPools, model: ModelConfig, max_end: int) -> list[CompressSpec]:
    """One `CompressSpec` per compress ratio with a compressor, in layer order."""
    specs: dict[int, CompressSpec] = {}
    for cache in pools.layers:
        if cache.attn_type == "swa" or cache.state is None:
            continue
        overlap = cache.attn_type == "csa"
        ratio = model.csa_ratio if overlap else model.hca_ratio
        if ratio not in specs:
            ring = pools.layout.ring_c4 if overlap else pools.layout.ring_c128
            specs[ratio] = CompressSpec(ratio, overlap, ring, cache.state.trash,
                                        cache.entry_trash, max_end // ratio)
    return list(specs.values())


def _plan(spec: CompressSpec, rows: CompressRows, max_len: int) -> CompressPlan:
    S = 2 * spec.ratio if spec.overlap else spec.ratio
    # NOTE: a ring row written in this step (new position p) and one read from the ring
    # (old p' >= start - S + 1) coincide only if p - p' is a positive multiple of `ring`, which
    # needs some request with n >= ring - S + 2 new tokens; below that (decode), a kernel may read
    # and write the ring in one pass.
    return CompressPlan(ratio=spec.ratio, overlap=spec.overlap, **rows._asdict(),
                        ring_reads_disjoint=max_len <= spec.ring - S + 1)


def build_context(shape: StepShape, table: RequestTable, pools: KVPools, model: ModelConfig,
                  device: torch.device, ops: KernelOps) -> ForwardContext:
    """The ForwardContext of one step; `table.reserve` must already cover every new position."""
    host = torch.tensor([shape.slots, shape.starts, shape.lens], dtype=torch.int64)
    slots, starts, lens = to_device(host, device).unbind(0)
    total = sum(shape.lens)
    logits_index = to_device(torch.tensor(shape.logits_index(), dtype=torch.int64), device)
    max_end = max(s + n for s, n in zip(shape.starts, shape.lens, strict=True))
    return device_context(slots, starts, lens, logits_index,
                          StepBounds(total, max_end, max(shape.lens)), table, pools, model, ops,
                          logits_all=shape.num_logits == shape.lens)


@dataclass(frozen=True)
class StepBounds:
    """The host integers that size a step's metadata tensors (the only host input besides the
    device rows).

    `num_tokens`: T = sum of lens. `max_end`: sizes the compressed-candidate lists (entries visible
    to any query are < max_end // ratio; a larger value only adds -1 columns). `max_len`: the
    longest request's new tokens (decides whether compressor ring reads and writes can overlap)."""

    num_tokens: int
    max_end: int
    max_len: int


def device_context(slots: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
                   logits_index: torch.Tensor, bounds: StepBounds, table: RequestTable,
                   pools: KVPools, model: ModelConfig, ops: KernelOps, *,
                   logits_all: bool = False) -> ForwardContext:
    """The ForwardContext from device rows only: `slots`, `starts`, `lens` [B] int64 and
    `logits_index` [R]; its index rows come from `ops.step_metadata`, and it carries `ops`.
    `logits_all`: the caller knows `logits_index` is arange(sum(lens)) (`ForwardContext`).

    Device work with shapes from `bounds` only: no host sync and no host-to-device copy, so it can
    run inside CUDA-graph capture (engine/cuda_graph.py) as well as eagerly."""
    specs = compress_specs(pools, model, bounds.max_end)
    rows = ops.step_metadata(slots, starts, lens, table.page_table, table.full_to_swa, table.P,
                             bounds.num_tokens, model.window, specs)
    plans = {spec.ratio: _plan(spec, plan, bounds.max_len)
             for spec, plan in zip(specs, rows.plans, strict=True)}
    hisparse = None
    if pools.hot is not None:
        T = bounds.num_tokens
        tok_req = torch.repeat_interleave(torch.arange(slots.shape[0], device=slots.device), lens,
                                          output_size=T)
        hisparse = _hisparse_step(rows.positions, slots[tok_req], bounds, table.pad_slot,
                                  pools.hot.layout.device_entries, model)
    return ForwardContext(positions=rows.positions, swa_write=rows.swa_write, window=rows.window,
                          plans=plans, caches=pools.layers, logits_index=logits_index, ops=ops,
                          hisparse=hisparse, logits_all=logits_all)


def _hisparse_step(pos: torch.Tensor, token_slots: torch.Tensor, bounds: StepBounds,
                   pad_slot: int, hot_entries: int, model: ModelConfig) -> HiSparseStep:
    """The step's HiSparse rows (`HiSparseStep`). The picks of one request fit its hot set when it
    feeds at most hot_entries // index_topk tokens or sees at most hot_entries entries."""
    T, m = pos.shape[0], model.csa_ratio
    emits = (pos + 1) % m == 0
    rows = torch.arange(T, device=pos.device)
    fits = (bounds.max_len * model.index_topk <= hot_entries
            or bounds.max_end // m <= hot_entries)
    return HiSparseStep(token_slots=token_slots, scratch_rows=torch.where(emits, rows, T),
                        write_slots=torch.where(emits, token_slots, pad_slot),
                        write_entries=torch.where(emits, pos // m, 0), use_hot=fits,
                        one_row=bounds.max_len == 1)
