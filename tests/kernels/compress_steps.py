"""Test helper (not a test module): the engine's own compressor plans for scripted serving steps.

A micro model's pools and request table at a page size; `plan` reserves each request's new tokens
and builds the step's metadata with `engine/metadata.py::build_context`, as the scheduler would.
Shared by the compressor parity tests (test_compressor_triton.py, test_compressor_pair.py).
"""

from __future__ import annotations

import torch

from dsv4.cache.layout import plan_cache
from dsv4.cache.pools import KVPools, LayerCache
from dsv4.cache.req_table import RequestTable
from dsv4.config.engine import EngineConfig
from dsv4.config.model import ModelConfig
from dsv4.engine.metadata import StepShape, build_context
from dsv4.kernels.registry import REF
from dsv4.model.forward_context import CompressPlan


class EngineSteps:
    def __init__(self, model: ModelConfig, page_size: int, device: torch.device,
                 ring_multiplier: int = 1) -> None:
        self.model, self.device = model, device
        engine = EngineConfig(page_size=page_size, max_running_requests=64,
                              max_total_tokens=1 << 17, ring_multiplier=ring_multiplier)
        layout = plan_cache(model, engine, torch.float32)
        self.pools = KVPools(model, layout, torch.float32, torch.device("meta"))
        self.table = RequestTable(layout, 64, 1 << 16, device)
        self.slots: dict[int, int] = {}
        self.lens: dict[int, int] = {}

    def cache(self, attn_type: str) -> LayerCache:
        """The first layer cache of `attn_type` (its ring and entry row counts size the test's
        tensors)."""
        return next(c for c in self.pools.layers if c.attn_type == attn_type)

    def plan(self, work: list[tuple[int, int]], ratio: int) -> CompressPlan:
        """One step: request id -> number of new tokens (opened on first sight); the compressor plan
        of `ratio`."""
        slots, starts = [], []
        for rid, n in work:
            if rid not in self.slots:
                self.slots[rid], self.lens[rid] = self.table.open(), 0
            start = self.lens[rid]
            assert self.table.reserve(self.slots[rid], start, start + n), "test cache too small"
            slots.append(self.slots[rid])
            starts.append(start)
            self.lens[rid] = start + n
        shape = StepShape(slots, starts, [n for _, n in work], [1] * len(work))
        return build_context(shape, self.table, self.pools, self.model, self.device,
                             REF).plans[ratio]

    def positions(self, work: list[tuple[int, int]]) -> torch.Tensor:
        """The positions of the tokens of the step `plan` just planned for `work`, in its order."""
        return torch.cat([torch.arange(self.lens[rid] - n, self.lens[rid], device=self.device)
                          for rid, n in work])

    def release(self, work: list[tuple[int, int]]) -> None:
        """As the scheduler does after a step: SWA pages (and their ring rows) behind the horizon go
        back."""
        for rid, _ in work:
            self.table.release_swa(self.slots[rid], self.lens[rid])

    def finish(self, rid: int) -> None:
        self.table.free(self.slots.pop(rid))


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (at least 1e-6) in fp32, over blocks of rows: the entry pools
    are large, and whole-pool temporaries cost more than the kernels under the interpreter."""
    diff = torch.zeros((), device=ref.device)
    top = torch.zeros((), device=ref.device)
    for o, r in zip(out.split(1024), ref.split(1024), strict=True):
        r = r.float()
        lo, hi = torch.aminmax(r)
        diff = torch.maximum(diff, (o.float() - r).abs().max())
        top = torch.maximum(top, torch.maximum(hi, -lo))
    return (diff / top.clamp(min=1e-6)).item()
