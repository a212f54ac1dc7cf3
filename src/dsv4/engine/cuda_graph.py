"""DecodeGraphs: decode steps (metadata + forward) as CUDA graphs, captured lazily per bucket.

Run eagerly, steady-state decode is host-bound: a flash-4l step launches hundreds of small kernels
whose host cost exceeds the GPU work (benchmarks/results/kernels_ii_h200_202611.md). A step's
metadata is computed on the device from small per-request rows (engine/metadata.py::device_context),
so the whole step is capturable: a replay copies each request's n token ids, its slot and its first
position into a static [B, n + 2] buffer (one copy) and launches one graph. Sampling stays outside
(its batch changes with the requests' parameters).

Steps served: every request feeds the same number n of tokens (1 for plain decode; up to
`max_tokens`, e.g. a verify pass of speculative decoding) and wants the logits of its last k
positions (1 <= k <= n).

Buckets. A graph is keyed by (batch bucket, n, k, context bucket, routing capture):
- batch: 1, 2, 4, 8, then multiples of 8 up to `max_batch`. Rows past the real batch are padding
  rows on the request table's `pad_slot`: its pages are all the null page, so they write only
  null-page slots and trash rows, nothing reads those, and their logits and routing are dropped;
- context: the step's largest end position (start + n) rounded up to a power of two (at least
  `MIN_CONTEXT`, at most the request table's span). It sizes the compressed-candidate lists, whose
  columns past a query's visible count are -1 in every form of the metadata: a larger bucket adds
  masked columns (at most 2x), never changes which entries a query sees.
PDL: the graphs of batch buckets up to `pdl_early_max_batch` are captured (with their warm-up
launches) inside `pdl_scope(EARLY)` (`graph_pdl_mode`), the others in DSV4_PDL's mode.
Graphs share one memory pool and are replayed one at a time on the current stream. With
`capture=False` (CPU, tests) the same static-buffer step runs eagerly: that path is what the CPU
equivalence tests check against the plain eager step, and the GPU tests check graph replay against
it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from dsv4.cache.pools import KVPools
from dsv4.cache.req_table import RequestTable
from dsv4.engine.metadata import StepBounds, StepShape, device_context
from dsv4.kernels.registry import KernelOps
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.utils.device import copy_from_host, to_device
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)

MIN_CONTEXT = 4096
Captured = dict[str, list[torch.Tensor]]


@dataclass(frozen=True)
class Ahead:
    """Overlap scheduling's in-flight inputs of a step: the fed tokens at `positions` (indices
    into the step's input ids) are `source[rows]`, tokens the step before sampled, still on the
    device. The indices travel to the device in the same host copy as the step's other inputs."""

    positions: list[int]
    source: torch.Tensor
    rows: list[int]


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to max_batch (which is always the last bucket)."""
    small = [b for b in (1, 2, 4) if b < max_batch]
    return small + list(range(8, max_batch, 8)) + [max_batch]


def context_bucket(max_end: int, span: int) -> int:
    """The power of two >= max(max_end, MIN_CONTEXT), capped at the request table's span
    (>= max_end)."""
    assert 1 <= max_end <= span, f"end position {max_end} outside the request table's span {span}"
    return min(1 << (max(max_end, MIN_CONTEXT) - 1).bit_length(), span)


def graph_pdl_mode(batch: int, early_max_batch: int) -> int | None:
    """The PDL mode a decode graph of batch bucket `batch` is captured in: EARLY up to
    `early_max_batch` (`EngineConfig.pdl_early_max_batch`), else None (DSV4_PDL's). Imported
    lazily: importing the engine loads no `dsv4.kernels.triton` module (`kernels/registry.py`)."""
    from dsv4.kernels.triton.pdl import EARLY

    return EARLY if batch <= early_max_batch else None


def _pdl_scope(batch: int, early_max_batch: int) -> contextlib.AbstractContextManager[None]:
    """`pdl_scope` of a capture of batch bucket `batch` and its warm-up (`graph_pdl_mode`;
    imported lazily)."""
    from dsv4.kernels.triton.pdl import pdl_scope

    return pdl_scope(graph_pdl_mode(batch, early_max_batch))


def uniform_shape(shape: StepShape) -> tuple[int, int] | None:
    """(n, k) when every request feeds n tokens and wants the logits of its last k (1 <= k <= n),
    else None."""
    n, k = shape.lens[0], shape.num_logits[0]
    if any(x != n for x in shape.lens) or any(x != k for x in shape.num_logits) or not 1 <= k <= n:
        return None
    return n, k


@dataclass(frozen=True)
class GraphKey:
    batch: int            # batch bucket B (rows past the real batch are padding)
    tokens: int           # n tokens fed per request
    logits: int           # k trailing positions with logits per request
    context: int          # context bucket
    capture_routing: bool


@dataclass
class _StepGraph:
    staging: torch.Tensor          # [B (n + 2) + 2 B n] int64: `inputs`, then `Ahead` indices
    inputs: torch.Tensor           # [B, n + 2] view of staging: n token ids, slot, first position
    consts: tuple[torch.Tensor, torch.Tensor]   # (lens [B], logits_index [B k]): fixed per key
    logits: torch.Tensor           # [B * k, V] fp32, written by every replay
    captured: Captured | None      # routing outputs, written by every replay
    graph: torch.cuda.CUDAGraph | None = field(default=None)
    streams: torch.Tensor | None = None   # [B * n, hc, d] with `with_streams`
    draft: _DraftGraph | None = None      # the MTP pass + draft chain after this step
    argmax: _ArgmaxGraph | None = None    # the row argmax of `logits` (`argmax_last`)


@dataclass
class _ArgmaxGraph:
    """`KernelOps.argmax` of a step graph's logits, captured beside it: a step whose rows only take
    the argmax (`sampler.argmax_only`) replays it instead of launching the kernels from Python.
    `tokens` [B * k] int64 is written by every replay."""

    tokens: torch.Tensor
    graph: torch.cuda.CUDAGraph


@dataclass
class _DraftGraph:
    """Speculative decoding's drafting after a step graph (engine/spec_decode.py::draft), on the
    step's static rows and streams: inputs `next_ids` [B * n] (each token's successor) and
    `first` [B] (the token row where each request's new tokens begin); output `drafts` [B, N]."""

    next_ids: torch.Tensor
    first: torch.Tensor
    drafts: torch.Tensor
    graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    def __init__(self, model: DeepSeekV4ForCausalLM, table: RequestTable, pools: KVPools,
                 ops: KernelOps, max_batch: int, capture: bool = True,
                 max_tokens: int = 1, with_streams: bool = False,
                 side_stream: torch.cuda.Stream | None = None,
                 pdl_early_max_batch: int = 0, shared_beside_max_tokens: int = 0) -> None:
        if capture and next(model.parameters()).device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.model, self.table, self.pools, self.ops = model, table, pools, ops
        self.buckets = batch_buckets(max_batch)
        self.span = table.max_pages * table.P
        self.capture, self.max_tokens, self.with_streams = capture, max_tokens, with_streams
        self.side_stream = side_stream     # `EngineConfig.multi_stream`: forked inside the graphs
        # `EngineConfig.shared_expert_beside_max_tokens`
        self.shared_beside_max_tokens = shared_beside_max_tokens
        self.pdl_early_max_batch = pdl_early_max_batch  # `EngineConfig.pdl_early_max_batch`
        self.device = next(model.parameters()).device
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self._graphs: dict[GraphKey, _StepGraph] = {}
        self._last: tuple[_StepGraph, GraphKey, int] | None = None   # the latest run's graph
        self.replays = 0

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def fits(self, shape: StepShape) -> bool:
        nk = uniform_shape(shape)
        return nk is not None and nk[0] <= self.max_tokens and len(shape.lens) <= self.max_batch

    def run(self, input_ids: list[int], shape: StepShape, capture_routing: bool,
            fill: Ahead | None = None) -> tuple[torch.Tensor, Captured | None]:
        """Logits [b * k, V] of a step of b requests (and its routing when asked), by graph replay.
        `fill`: inputs that come from the step before's sampled tokens on the device (overlap
        scheduling).

        The returned tensors are views of the graph's static outputs: consume them before the next
        call."""
        logits, captured, _ = self.run_streams(input_ids, shape, capture_routing, fill)
        return logits, captured

    def run_streams(self, input_ids: list[int], shape: StepShape, capture_routing: bool,
                    fill: Ahead | None = None
                    ) -> tuple[torch.Tensor, Captured | None, torch.Tensor | None]:
        """`run`, plus the streams after the last block of the b * n tokens (`with_streams`;
        else None): the MTP block's input under speculative decoding."""
        nk = uniform_shape(shape)
        assert nk is not None and self.fits(shape), "not a step that a graph serves"
        n, k = nk
        b = len(shape.lens)
        B = next(x for x in self.buckets if x >= b)
        key = GraphKey(B, n, k, context_bucket(max(shape.starts) + n, self.span), capture_routing)
        step = self._graphs.get(key)
        if step is None:
            step = self._graphs[key] = self._build(key)
        flat = [v for r, (slot, start) in enumerate(zip(shape.slots, shape.starts, strict=True))
                for v in (*input_ids[r * n:(r + 1) * n], slot, start)]
        flat += ([0] * n + [self.table.pad_slot, 0]) * (B - b)
        if fill is not None:         # token i of the step is inputs[i // n, i % n]
            flat += [i // n * (n + 2) + i % n for i in fill.positions] + fill.rows
        copy_from_host(step.staging[:len(flat)], torch.tensor(flat, dtype=torch.int64))
        if fill is not None:
            at = step.staging[B * (n + 2):len(flat)].view(2, -1)
            step.inputs.view(-1).index_copy_(0, at[0], fill.source.index_select(0, at[1]))
        self.replays += 1
        if step.graph is not None:
            step.graph.replay()
        else:
            step.logits, step.captured, step.streams = self._forward(step.inputs, step.consts,
                                                                     key)
        captured = None if step.captured is None else {
            name: [t[:b * n] for t in v] for name, v in step.captured.items()}
        streams = None if step.streams is None else step.streams[:b * n]
        self._last = (step, key, b)
        return step.logits[:b * k], captured, streams

    def argmax_last(self, rows: int) -> torch.Tensor:
        """[rows] int64: the row argmax (`KernelOps.argmax`) of the latest `run`'s first `rows`
        logit rows, by replay of the argmax graph captured with its step graph (without capture:
        the op itself). Equal to `ops.argmax(logits[:rows])`, since a row's argmax never depends
        on the other rows. A view of a static output: read it (stream-ordered) before the next
        step's argmax."""
        assert self._last is not None, "argmax_last() needs run()"
        step = self._last[0]
        if step.argmax is None:
            return self.ops.argmax(step.logits[:rows])
        step.argmax.graph.replay()
        return step.argmax.tokens[:rows]

    def prepare(self, batch: int, tokens: int, context: int, capture_routing: bool,
                draft_steps: int = 0) -> int:
        """Capture the graph of a step of `batch` requests feeding `tokens` tokens each, with
        logits at each of them (a plain decode step: 1; a verify pass: 1 + drafts), whose
        largest end position lies in context bucket `context`, and its drafting graph when
        `draft_steps`; returns how many graphs this captured (0: all there). Capture needs no
        request: it runs on padding rows (`_build`), so warmup can reach any context bucket
        without prefilling a request that long."""
        B = next(x for x in self.buckets if x >= batch)
        key = GraphKey(B, tokens, tokens, context_bucket(context, self.span), capture_routing)
        built = 0
        step = self._graphs.get(key)
        if step is None:
            step = self._graphs[key] = self._build(key)
            built += 1
        if draft_steps and step.draft is None:
            step.draft = self._build_draft(step, key, draft_steps)
            built += 1
        return built

    def draft_after(self, next_ids: torch.Tensor, first: torch.Tensor,
                    num_steps: int) -> torch.Tensor:
        """The drafts [b, num_steps] of the b requests of the latest `run_streams` step, by replay
        of its drafting graph (captured on first use): `next_ids` [b * n], `first` [b] as in
        `spec_decode.draft`. Padding rows draft too; their drafts are dropped."""
        assert self._last is not None and self.with_streams, "draft_after() needs run_streams()"
        step, key, b = self._last
        n = key.tokens
        if step.draft is None:
            step.draft = self._build_draft(step, key, num_steps)
        d = step.draft
        d.next_ids[:b * n].copy_(next_ids)
        d.first[:b].copy_(first)
        if d.graph is not None:
            d.graph.replay()
        else:
            d.drafts = self._draft_forward(step, key, d.next_ids, d.first, num_steps)
        return d.drafts[:b]

    def _draft_forward(self, step: _StepGraph, key: GraphKey, next_ids: torch.Tensor,
                       first: torch.Tensor, num_steps: int) -> torch.Tensor:
        from dsv4.engine.spec_decode import draft

        B, n = key.batch, key.tokens
        slots, starts = step.inputs[:, n], step.inputs[:, n + 1]
        ctx = device_context(slots, starts, torch.full_like(slots, n), first,
                             StepBounds(B * n, key.context, n), self.table, self.pools,
                             self.model.config, self.ops)
        assert step.streams is not None
        return draft(self.model, ctx, step.streams, next_ids, first, slots, self.table,
                     self.pools, num_steps)

    def _build_draft(self, step: _StepGraph, key: GraphKey, num_steps: int) -> _DraftGraph:
        B, n = key.batch, key.tokens
        # padding rows: token 0, first row = the request's first token (pad slot: null page)
        next_ids = torch.zeros(B * n, dtype=torch.int64, device=self.device)
        first = torch.arange(B, device=self.device) * n
        if not self.capture:
            return _DraftGraph(next_ids, first, torch.empty(0, device=self.device))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with _pdl_scope(B, self.pdl_early_max_batch):
            with torch.cuda.stream(side):
                self._draft_forward(step, key, next_ids, first, num_steps)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                drafts = self._draft_forward(step, key, next_ids, first, num_steps)
        return _DraftGraph(next_ids, first, drafts, graph)

    def _consts(self, key: GraphKey) -> tuple[torch.Tensor, torch.Tensor]:
        """(lens [B], logits_index [B k]) of a graph's steps: fixed by its key, so built once
        outside the capture instead of by kernels inside every replay."""
        B, n, k = key.batch, key.tokens, key.logits
        lens = torch.full((B,), n, dtype=torch.int64)
        last = torch.arange(B)[:, None] * n + (n - k)
        index = (last + torch.arange(k)).reshape(-1)
        return to_device(lens, self.device), to_device(index, self.device)

    def _forward(self, inputs: torch.Tensor, consts: tuple[torch.Tensor, torch.Tensor],
                 key: GraphKey) -> tuple[torch.Tensor, Captured | None, torch.Tensor | None]:
        """The step from the static rows: device metadata, then the model's serving path."""
        n = key.tokens
        ids, slots, starts = inputs[:, :n].reshape(-1), inputs[:, n], inputs[:, n + 1]
        lens, logits_index = consts
        B = key.batch
        ctx = device_context(slots, starts, lens, logits_index, StepBounds(B * n, key.context, n),
                             self.table, self.pools, self.model.config, self.ops,
                             logits_all=key.logits == n)
        ctx.captured = {} if key.capture_routing else None
        ctx.side_stream = self.side_stream
        ctx.shared_beside_max_tokens = self.shared_beside_max_tokens
        logits, streams = self.model.forward_batch_streams(ids, ctx)
        return logits, ctx.captured, streams if self.with_streams else None

    def _build(self, key: GraphKey) -> _StepGraph:
        # padding rows only (null-page writes) while warming up and capturing
        B, n = key.batch, key.tokens
        row = [0] * n + [self.table.pad_slot, 0]
        host = torch.tensor(row * B + [0] * (2 * B * n), dtype=torch.int64)
        staging = host.to(self.device)
        inputs = staging[:B * (n + 2)].view(B, n + 2)
        consts = self._consts(key)
        if not self.capture:   # eager replays fill the outputs
            return _StepGraph(staging, inputs, consts, torch.empty(0, device=self.device), None)
        logger.info("capturing the decode graph for batch %d, %d token(s) per request, "
                    "context bucket %d%s", B, n, key.context,
                    " with routing capture" if key.capture_routing else "")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with _pdl_scope(B, self.pdl_early_max_batch):
            with torch.cuda.stream(side):  # warm-up off the capture: compiles, allocator settles
                self._forward(inputs, consts, key)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits, captured, streams = self._forward(inputs, consts, key)
            self.ops.argmax(logits)            # compiled and warm before its capture
            argmax = torch.cuda.CUDAGraph()
            with torch.cuda.graph(argmax, pool=self.pool):
                tokens = self.ops.argmax(logits)
        return _StepGraph(staging, inputs, consts, logits, captured, graph, streams,
                          argmax=_ArgmaxGraph(tokens, argmax))

    def num_graphs(self) -> int:
        return len(self._graphs)
