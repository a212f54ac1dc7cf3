"""ModelRunner: owns the model, the KV pools, the request table and the per-request sampler
state.

`run(step)` builds the device metadata, runs the model's serving path (replaying CUDA graphs when
`graphs` serve the step's shape, engine/cuda_graph.py) and samples every logit row, then starts the
copy of the results to the host and returns at once: a `StepOutput` holds the device tensors, their
host copies in flight and the event that marks them done. `StepOutput.resolve()` is a step's one
host sync (the `.tolist()` of the sampled tokens, their log-probs and, when captured, the routing);
the engine calls it when it needs the tokens: at once, or one step later under overlap scheduling,
where a step's fed tokens still on the device (`ScheduledStep.ahead`) are gathered from the step
before's sampled tokens into the inputs, on the device.
The host-side step types live in engine/step_output.py.
What the runner settles before it allocates (the config resolved for the device, HiSparse's hot
entries, the projection fusion) is in engine/runner_setup.py.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from dsv4.cache.hisparse import HiSparseLayout, HotSet
from dsv4.cache.layout import plan_cache
from dsv4.cache.pools import KVPools
from dsv4.cache.req_table import RequestTable
from dsv4.config.engine import EngineConfig
from dsv4.engine.cuda_graph import Ahead, Captured, DecodeGraphs
from dsv4.engine.grammar import draft_token_bitmask, token_bitmask
from dsv4.engine.metadata import StepShape, build_context
from dsv4.engine.penalty_state import PenaltyState
from dsv4.engine.request import Request
from dsv4.engine.runner_setup import check_host_memory, fuse_for_serving, hot_entries, resolve
from dsv4.engine.sampler import SampleOutput, SamplingBatch, argmax_only, sample
from dsv4.engine.scheduler import ScheduledStep
from dsv4.engine.spec_decode import Drafts, Segments, draft, successors, verify
from dsv4.engine.step_output import PromptRows, StepOutput
from dsv4.kernels.ref.batch_invariant import batch_invariant
from dsv4.kernels.registry import create_kernels
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.model.forward_context import ForwardContext
from dsv4.utils.device import to_device
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)


class ModelRunner:
    def __init__(self, model: DeepSeekV4ForCausalLM, config: EngineConfig,
                 context_length: int) -> None:
        self.device = next(model.parameters()).device
        # before the KV budget is sized: fusing re-allocates the grouped weights
        self.fused_groups = fuse_for_serving(model, config)
        # the RoPE rows of every position a request can reach (its page table's span, drafts
        # included), before the KV budget is sized so that it sees them
        self.rope_positions = math.ceil(context_length / config.page_size) * config.page_size
        self.rope_cache_bytes = model.build_rope_cache(self.rope_positions)
        logger.info("RoPE cache: positions 0..%d, both tables (%.1f MB)", self.rope_positions - 1,
                    self.rope_cache_bytes / 1e6)
        config = resolve(config, self.device, model)
        self.model, self.config = model, config
        assert config.index_cache_dtype is not None
        # the full-sequence indexer rounds as the serving path's pools do
        model.set_index_cache_dtype(config.index_cache_dtype)
        assert config.kernel_backend is not None
        self.ops = create_kernels(config.kernel_backend, config.invariant_plans)
        dtype = model.embed.weight.dtype
        mc = model.config
        self.dtype, self.context_length = dtype, context_length
        self.hot_entries = hot_entries(config, mc)
        reserved = 0 if self.hot_entries is None else HiSparseLayout.device_bytes(
            mc, config.max_running_requests, context_length, self.hot_entries, dtype)
        self.layout = plan_cache(mc, config, dtype, reserved)
        self.table = RequestTable(self.layout, config.max_running_requests, context_length,
                                  self.device)
        assert self.table.max_pages * self.table.P == self.rope_positions, "RoPE cache != span"
        self.pools = self._new_pools()
        self.penalties = PenaltyState(config.max_running_requests, mc.vocab_size, self.device)
        logger.info("KV cache: %d full pages, %d SWA pages of %d tokens (%.1f MB)",
                    self.layout.num_full_pages - 1, self.layout.num_swa_pages - 1,
                    self.layout.page_size, self.pools.nbytes() / 1e6)
        # the second stream of `multi_stream` (model/streams.py); one per engine
        self.side_stream = torch.cuda.Stream(self.device) if config.multi_stream else None
        assert config.shared_expert_beside_max_tokens is not None, "resolved by runner_setup"
        self.shared_beside_max_tokens = config.shared_expert_beside_max_tokens
        logger.info("multi-stream branches: %s", "on" if config.multi_stream else "off")
        self.graphs = self._decode_graphs()
        self.spec_steps = config.speculative_num_steps
        if self.spec_steps and not model.mtp:
            raise ValueError(f"speculative_num_steps={self.spec_steps} needs a checkpoint with an "
                             "MTP block; this one has none (allowed: 0)")

    def _new_pools(self) -> KVPools:
        """Zeroed KV pools and, with HiSparse, their HotSet, which the request table's slots then
        drive (admit / truncate / release)."""
        hot = None
        if self.hot_entries is not None:
            layout = HiSparseLayout.from_configs(self.model.config, self.layout,
                                                 self.config.max_running_requests,
                                                 self.context_length, self.hot_entries)
            check_host_memory(layout, self.dtype)
            hot = HotSet(layout, self.table.page_table, self.dtype, self.device,
                         swap_in=self.ops.swap_in, write_rows=self.ops.write_rows,
                         plan=self.ops.hot_plan, write=self.ops.hot_write)
            device_bytes, host_bytes = layout.pool_bytes(self.dtype)
            logger.info("HiSparse: %d hot entries per request and C4 layer (%.1f MB on the "
                        "device), host mirror %.1f MB", self.hot_entries, device_bytes / 1e6,
                        host_bytes / 1e6)
        self.table.hot = hot
        return KVPools(self.model.config, self.layout, self.dtype, self.device, hot,
                       index_fp8=self.config.index_cache_dtype == "fp8")

    def release_memory(self) -> int:
        """Free the KV pools and the CUDA graphs (which hold their addresses) while no request
        runs, e.g. while a colocated trainer steps; returns the bytes released. `resume_memory`
        allocates them again (empty: the prefix cache must be empty too)."""
        freed = self.pools.nbytes()
        self.pools.layers.clear()
        self.pools.hot = self.table.hot = None
        self.graphs = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        logger.info("KV pools and CUDA graphs released (%.1f MB)", freed / 1e6)
        return freed

    def resume_memory(self) -> None:
        """Allocate the KV pools again (zeroed) and a fresh graph set, captured on first use."""
        self.pools = self._new_pools()
        self.graphs = self._decode_graphs()

    @property
    def memory_released(self) -> bool:
        return not self.pools.layers

    def _decode_graphs(self) -> DecodeGraphs | None:
        c = self.config
        why_not = ("disable_cuda_graph" if c.disable_cuda_graph else
                   f"device {self.device.type}" if self.device.type != "cuda" else
                   "kernel_backend=ref (host syncs in its MoE)" if c.kernel_backend != "triton" else
                   None)
        if why_not is not None:
            logger.info("CUDA graphs: off (%s); every step runs eagerly", why_not)
            return None
        spec = c.speculative_num_steps
        top_k = self.model.config.index_topk
        if self.hot_entries is not None and self.hot_entries < (spec + 1) * top_k:
            raise ValueError(
                f"hisparse_device_entries={self.hot_entries} is too few for CUDA graphs with "
                f"speculative_num_steps={spec}: a captured verify pass of {spec + 1} tokens must "
                f"attend through the hot sets; allowed: hisparse_device_entries >= "
                f"{(spec + 1) * top_k} (speculative_num_steps + 1 times index_topk), or "
                "disable_cuda_graph=True")
        max_batch = min(c.cuda_graph_max_bs, c.max_running_requests)
        logger.info("CUDA graphs: decode steps of up to %d requests, captured on first use",
                    max_batch)
        assert c.pdl_early_max_batch is not None, "resolved by runner_setup.resolve"
        # speculative decoding: verify steps of N + 1 tokens, returning the MTP block's input
        return DecodeGraphs(self.model, self.table, self.pools, self.ops, max_batch,
                            max_tokens=1 + spec, with_streams=spec > 0,
                            side_stream=self.side_stream,
                            shared_beside_max_tokens=self.shared_beside_max_tokens,
                            pdl_early_max_batch=c.pdl_early_max_batch)

    @torch.no_grad()
    def run(self, step: ScheduledStep) -> StepOutput:
        """Launch the step (forward, sampling, host copies); nothing here waits for the device."""
        if self.config.batch_invariant:
            with batch_invariant():
                return self._run(step)
        return self._run(step)

    @torch.no_grad()
    def run_idle(self) -> None:
        """One forward of a 1-token decode step on the request table's `pad_slot` (its writes
        reach only the null page; its logits are dropped), the way `DecodeGraphs` runs padding
        rows: for a rank that has nothing scheduled but must join a step's collectives
        (data-parallel attention's MoE layers, `distributed/dp.py`)."""
        assert not self.memory_released, "run_idle() after release_memory(): call resume_memory()"
        pad = DecodeGraphs(self.model, self.table, self.pools, self.ops, 1, capture=False)
        pad.run([0], StepShape([self.table.pad_slot], [0], [1], [1]), False)

    def _run(self, step: ScheduledStep) -> StepOutput:
        assert not self.memory_released, "run() after release_memory(): call resume_memory()"
        for req, admitted in zip(step.requests, step.admitted, strict=True):
            if admitted and req.slot is not None and req.params.uses_penalties:
                self.penalties.admit(req)
        if self.spec_steps:
            return self._run_spec(step)
        fill = self._ahead_tokens(step)
        graphs = self.graphs if self.graphs is not None and self.graphs.fits(step.shape) else None
        if graphs is not None:
            logits, captured = graphs.run(step.input_ids, step.shape,
                                          self.config.capture_routing, fill)
        else:
            logits, captured = self._forward_eager(step, fill)
        sample_rows, prompt = self._split_rows(step)
        requests = [r for r, _ in sample_rows]
        sampled = None
        if requests:
            rows = self._rows(logits, [i for _, i in sample_rows])
            # every logit row samples, in order (`_rows` took no gather): the graph's own argmax
            graph_argmax = (functools.partial(graphs.argmax_last, rows.shape[0])
                            if graphs is not None and rows is logits else None)
            # a token in flight counts: it is the output token before this step's
            sampled = self._sample(rows, requests,
                                   [len(r.output_ids) + r.num_inflight for r in requests],
                                   graph_argmax=graph_argmax)
        prompt_rows = None
        if prompt:
            prompt_rows = PromptRows.compute(logits, prompt, self.device)
        return StepOutput(step, requests, [1] * len(requests), sampled, captured, self.device,
                          prompt=prompt_rows)

    @staticmethod
    def _ahead_tokens(step: ScheduledStep) -> Ahead | None:
        """Overlap scheduling: the fed tokens the step before sampled (their indices into the
        step's input ids and their rows of its sampled tokens, still on the device; no host
        sync); None when every fed token is on the host."""
        if not step.ahead:
            return None
        assert step.source is not None and len(step.source_rows) == len(step.ahead)
        return Ahead([i for i, _ in step.ahead], step.source, list(step.source_rows))

    @staticmethod
    def _split_rows(step: ScheduledStep) -> tuple[list[tuple[Request, int]],
                                                  list[tuple[Request, int, int]]]:
        """The step's logit rows: (request, row) of each sampling row (a request's last row when
        its chunk reaches its end), and (request, row, position of the next prompt token) of each
        prompt log-prob row."""
        sample_rows, prompt = [], []
        row = 0
        for req, start, n, k in zip(step.requests, step.shape.starts, step.shape.lens,
                                    step.shape.num_logits, strict=True):
            samples = start + n >= len(req.all_ids) + req.num_inflight
            for j in range(k):
                position = start + n - k + j + 1            # of the token this row predicts
                if samples and j == k - 1:
                    sample_rows.append((req, row))
                else:
                    prompt.append((req, row, position))
                row += 1
        return sample_rows, prompt

    def _context(self, step: ScheduledStep) -> ForwardContext:
        ctx = build_context(step.shape, self.table, self.pools, self.model.config, self.device,
                            self.ops)
        # the ref ops' softmax / P.V depend on the row width; the triton kernels' do not (trailing
        # -1 columns are exact no-ops: benchmarks/kernel_invariance.py)
        ctx.fixed_widths = self.config.batch_invariant and self.ops.name == "ref"
        ctx.side_stream = self.side_stream
        ctx.shared_beside_max_tokens = self.shared_beside_max_tokens
        if self.config.capture_routing:
            ctx.captured = {}
        return ctx

    def _forward_eager(self, step: ScheduledStep,
                       fill: Ahead | None = None) -> tuple[torch.Tensor, Captured | None]:
        """Logits [R, V] fp32 of the step's logit rows (and the routing when captured), without
        graphs; `fill` (`_ahead_tokens`) overwrites placeholder inputs on the device."""
        ctx = self._context(step)
        T = len(step.input_ids)
        extra = [] if fill is None else fill.positions + fill.rows
        host = to_device(torch.tensor(step.input_ids + extra, dtype=torch.int64), self.device)
        ids = host[:T]
        if fill is not None:
            at = host[T:].view(2, -1)
            ids.index_copy_(0, at[0], fill.source.index_select(0, at[1]))
        return self.model.forward_batch(ids, ctx), ctx.captured

    def _run_spec(self, step: ScheduledStep) -> StepOutput:
        """A step of a speculative engine (engine/spec_decode.py): the target's forward (with its
        streams), verification of every sampling request's drafts, then the MTP pass over the
        step's tokens and the draft chain of the requests that draft."""
        ids = to_device(torch.tensor(step.input_ids, dtype=torch.int64), self.device)
        graphs = self.graphs if self.graphs is not None and self.graphs.fits(step.shape) else None
        if graphs is not None:       # every request samples: the drafting graph follows
            ctx = None
            logits, captured, _ = graphs.run_streams(step.input_ids, step.shape,
                                                     self.config.capture_routing)
            logits_index = to_device(torch.tensor(step.shape.logits_index(), dtype=torch.int64),
                                     self.device)
        else:
            ctx = self._context(step)
            logits, streams = self.model.forward_batch_streams(ids, ctx)
            captured, logits_index = ctx.captured, ctx.logits_index
        index = [i for i, k in enumerate(step.shape.num_logits) if k > 0]
        requests = [step.requests[i] for i in index]
        rows = [step.shape.num_logits[i] for i in index]
        next_ids = to_device(torch.tensor(successors(step), dtype=torch.int64), self.device)
        if not index:       # a prefill-only step: the MTP pass fills the block's cache
            assert ctx is not None
            draft(self.model, ctx, streams, next_ids, next_ids[:0], next_ids[:0], self.table,
                  self.pools, 0)
            return StepOutput(step, [], [], None, captured, self.device)
        segs = Segments.build(rows, ids[logits_index])
        constrained = any(r.grammar is not None for r in requests)
        sampled, accepted = self._verify(logits, segs, requests, rows,
                                         self._fed_drafts(step, index) if constrained else None)
        at = segs.first + accepted                # logit row of each segment's first new token
        first_rows = logits_index[at]
        next_ids[first_rows] = sampled.token_ids[at]
        drafting = [j for j, i in enumerate(index) if step.drafting[i]]
        sel = to_device(torch.tensor(drafting, dtype=torch.int64), self.device)
        if graphs is not None:
            nxt = graphs.draft_after(next_ids, first_rows, self.spec_steps)[sel]
        else:
            assert ctx is not None
            slots = to_device(torch.tensor([r.slot for r in requests], dtype=torch.int64),
                              self.device)
            nxt = draft(self.model, ctx, streams, next_ids, first_rows[sel], slots[sel],
                        self.table, self.pools, self.spec_steps if drafting else 0)
        return StepOutput(step, requests, rows, sampled, captured, self.device,
                          Drafts(accepted, nxt, drafting))

    @staticmethod
    def _fed_drafts(step: ScheduledStep, index: list[int]) -> list[list[int]]:
        """The drafts fed by each sampling request (`index`: their positions in the step): the
        fed tokens after its first logit row's."""
        offsets = [0]
        for n in step.shape.lens:
            offsets.append(offsets[-1] + n)
        return [step.input_ids[offsets[i + 1] - step.shape.num_logits[i] + 1:offsets[i + 1]]
                for i in index]

    def _verify(self, logits: torch.Tensor, segs: Segments, requests: list[Request],
                rows: list[int], drafts: list[list[int]] | None
                ) -> tuple[SampleOutput, torch.Tensor]:
        """`spec_decode.verify` over the step's logit rows with each request's sampling state
        and, for structured requests, each row's grammar mask along the request's `drafts`
        (None: no request is constrained);
        counts the emitted tokens in the penalty state. -> (emitted tokens per row (-1 after a
        segment's last), accepted drafts per segment)."""
        row_reqs = [r for r, k in zip(requests, rows, strict=True) for _ in range(k)]
        steps = [len(r.output_ids) + j for r, k in zip(requests, rows, strict=True)
                 for j in range(k)]
        batch = SamplingBatch.build([r.params for r in row_reqs], steps,
                                    [r.seed for r in row_reqs], self.device,
                                    vocab_size=logits.shape[-1])
        slots = counts = seen = None
        if batch.do_penalties:
            slots, counts, seen = self.penalties.read(row_reqs)
        bits = (None if drafts is None else
                draft_token_bitmask([r.grammar for r in requests], drafts, logits.shape[-1]))
        allowed = to_device(bits, self.device) if bits is not None else None
        out = verify(logits, segs, batch, counts, seen, allowed, self.ops.argmax)
        if slots is not None:
            valid = out.tokens >= 0
            tok = out.tokens.clamp(min=0)
            # a row past its segment's last emitted token re-marks the segment's first one
            # (always emitted), so the scatter writes True only: no -1 row can land a False last
            self.penalties.record(slots, tok, valid.to(torch.int32),
                                  torch.where(valid, tok, tok[segs.first[segs.seg]]))
        return (SampleOutput(out.tokens, out.logprobs, out.top_logprobs, out.top_ids),
                out.accepted)

    def _rows(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """logits[rows]; `logits` itself (no copy, no gather) when the rows are all of them in
        order, as in a decode step where every request samples its one row."""
        if rows == list(range(logits.shape[0])):
            return logits
        return logits[to_device(torch.tensor(rows, dtype=torch.int64), self.device)]

    def _sample(self, logits: torch.Tensor, reqs: list[Request], steps: list[int],
                graph_argmax: Callable[[], torch.Tensor] | None = None) -> SampleOutput:
        """Sample every logit row (row i belongs to `reqs[i]`, its output index `steps[i]`) and,
        when a row uses penalties, count the tokens in the penalty state (`PenaltyState`). Rows
        of one request sample from the request's state at the step's start. Rows that only take
        the argmax (`argmax_only`, no grammar) skip the sampling batch: the same ids, from
        `graph_argmax` (the decode graph's replay of the op on these rows) when given."""
        if argmax_only([r.params for r in reqs]) and all(r.grammar is None for r in reqs):
            ids = graph_argmax() if graph_argmax is not None else self.ops.argmax(logits)
            return SampleOutput(token_ids=ids)
        batch = SamplingBatch.build([r.params for r in reqs], steps, [r.seed for r in reqs],
                                    self.device, vocab_size=logits.shape[-1])
        slots = counts = seen = None
        if batch.do_penalties:      # the penalty state is kept for such requests only
            slots, counts, seen = self.penalties.read(reqs)
        bits = token_bitmask([r.grammar for r in reqs], logits.shape[-1])
        allowed = to_device(bits, self.device) if bits is not None else None
        out = sample(logits, batch, counts, seen, allowed, self.ops.argmax)
        if slots is not None:
            self.penalties.record(slots, out.token_ids,
                                  torch.ones_like(out.token_ids, dtype=torch.int32),
                                  out.token_ids)
        return out
