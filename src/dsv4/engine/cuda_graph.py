"""DecodeGraphs: the decode step (metadata + forward) as CUDA graphs, captured lazily per bucket.

Run eagerly, steady-state decode is host-bound: on flash-4l ~830 kernel launches per step cost ~31 ms of host
time against ~2.5 ms of GPU work (benchmarks/results/kernels_ii_h200_202611.md). A step's metadata is computed
on the device from three small rows (engine/metadata.py::device_context), so the whole step is capturable: a
replay copies the token ids, request slots and positions into a static [3, B] buffer (one copy) and launches
one graph. Sampling stays outside (its batch changes with the requests' parameters).

Buckets. A graph is keyed by (batch bucket, context bucket, routing capture):
- batch: 1, 2, 4, 8, then multiples of 8 up to `max_batch`. Rows past the real batch are padding rows on the
  request table's `pad_slot`: its pages are all the null page, so they write only null-page slots and trash
  rows, nothing reads those, and their logits and routing are dropped;
- context: the step's largest end position rounded up to a power of two (at least `MIN_CONTEXT`, at most the
  request table's span). It sizes the compressed-candidate lists, whose columns past a query's visible count
  are -1 in every form of the metadata: a larger bucket adds masked columns (at most 2x), never changes which
  entries a query sees.
Graphs share one memory pool and are replayed one at a time on the current stream. With `capture=False` (CPU,
tests) the same static-buffer step runs eagerly: that path is what the CPU equivalence tests check against the
plain eager step, and the GPU tests check graph replay against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv4.cache.pools import KVPools
from dsv4.cache.req_table import RequestTable
from dsv4.engine.metadata import StepBounds, StepShape, device_context
from dsv4.kernels.registry import KernelOps
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)

MIN_CONTEXT = 4096
Captured = dict[str, list[torch.Tensor]]


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to max_batch (which is always the last bucket)."""
    small = [b for b in (1, 2, 4) if b < max_batch]
    return small + list(range(8, max_batch, 8)) + [max_batch]


def context_bucket(max_end: int, span: int) -> int:
    """The power of two >= max(max_end, MIN_CONTEXT), capped at the request table's span (>= max_end)."""
    assert 1 <= max_end <= span, f"end position {max_end} outside the request table's span {span}"
    return min(1 << (max(max_end, MIN_CONTEXT) - 1).bit_length(), span)


def is_decode(shape: StepShape) -> bool:
    """Every request feeds exactly one token and samples from it (the steps graphs serve)."""
    return all(n == 1 for n in shape.lens) and all(shape.sample)


@dataclass
class _StepGraph:
    inputs: torch.Tensor                   # [3, B] int64: token ids, request slots, positions
    logits: torch.Tensor                   # [B, V] fp32, written by every replay
    captured: Captured | None              # routing outputs, written by every replay
    graph: torch.cuda.CUDAGraph | None = field(default=None)


class DecodeGraphs:
    def __init__(self, model: DeepSeekV4ForCausalLM, table: RequestTable, pools: KVPools, ops: KernelOps,
                 max_batch: int, capture: bool = True) -> None:
        if capture and next(model.parameters()).device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.model, self.table, self.pools, self.ops = model, table, pools, ops
        self.buckets = batch_buckets(max_batch)
        self.span = table.max_pages * table.P
        self.capture = capture
        self.device = next(model.parameters()).device
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self._graphs: dict[tuple[int, int, bool], _StepGraph] = {}
        self.replays = 0

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def fits(self, shape: StepShape) -> bool:
        return is_decode(shape) and len(shape.lens) <= self.max_batch

    def run(self, input_ids: list[int], shape: StepShape, capture_routing: bool) -> tuple[torch.Tensor,
                                                                                        Captured | None]:
        """Logits [b, V] of a decode step of b requests (and its routing when asked), by graph replay.

        The returned tensors are views of the graph's static outputs: consume them before the next call."""
        assert self.fits(shape), "not a decode step that a graph serves"
        b = len(shape.lens)
        B = next(x for x in self.buckets if x >= b)
        key = (B, context_bucket(max(shape.starts) + 1, self.span), capture_routing)
        step = self._graphs.get(key)
        if step is None:
            step = self._graphs[key] = self._build(*key)
        pad = B - b
        rows = torch.tensor([input_ids + [0] * pad, shape.slots + [self.table.pad_slot] * pad,
                             shape.starts + [0] * pad], dtype=torch.int64)
        step.inputs.copy_(rows, non_blocking=True)
        self.replays += 1
        if step.graph is not None:
            step.graph.replay()
        else:
            step.logits, step.captured = self._forward(step.inputs, key[1], capture_routing)
        captured = None if step.captured is None else {k: [t[:b] for t in v] for k, v in step.captured.items()}
        return step.logits[:b], captured

    def _forward(self, inputs: torch.Tensor, context: int, capture_routing: bool) -> tuple[torch.Tensor,
                                                                                         Captured | None]:
        """The step from the static rows: device metadata, then the model's serving path."""
        ids, slots, starts = inputs.unbind(0)
        B = ids.shape[0]
        lens = torch.ones_like(ids)
        logits_index = torch.arange(B, device=ids.device)
        ctx = device_context(slots, starts, lens, logits_index, StepBounds(B, context, 1), self.table, self.pools,
                             self.model.config)
        ctx.ops = self.ops
        ctx.captured = {} if capture_routing else None
        return self.model.forward_batch(ids, ctx), ctx.captured

    def _build(self, B: int, context: int, capture_routing: bool) -> _StepGraph:
        # padding rows only (null-page writes) while warming up and capturing
        inputs = torch.tensor([[0] * B, [self.table.pad_slot] * B, [0] * B], dtype=torch.int64, device=self.device)
        if not self.capture:   # eager replays fill the outputs
            return _StepGraph(inputs, torch.empty(0, device=self.device), None)
        logger.info("capturing the decode graph for batch %d, context bucket %d%s", B, context,
                    " with routing capture" if capture_routing else "")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):   # warm-up off the capture: Triton compiles, allocator settles
            self._forward(inputs, context, capture_routing)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits, captured = self._forward(inputs, context, capture_routing)
        return _StepGraph(inputs, logits, captured, graph)

    def num_graphs(self) -> int:
        return len(self._graphs)
