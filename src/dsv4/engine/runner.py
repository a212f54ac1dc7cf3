"""ModelRunner: owns the model, the KV pools, the request table and the per-request sampler state.

`run(step)` builds the device metadata, runs the model's serving path and samples; decode steps replay
CUDA graphs when `graphs` is set (engine/cuda_graph.py). The one host sync of a step is the `.tolist()`
that returns the sampled token ids (plus their log-probs and, when captured, the routing) — the engine
needs them to decide what to feed next.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.cache.layout import plan_cache
from dsv4.cache.pools import KVPools
from dsv4.cache.req_table import RequestTable
from dsv4.config.engine import EngineConfig
from dsv4.engine.cuda_graph import DecodeGraphs
from dsv4.engine.metadata import build_context
from dsv4.engine.request import Request
from dsv4.engine.sampler import SamplingBatch, sample
from dsv4.engine.scheduler import ScheduledStep
from dsv4.kernels.registry import create_kernels
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)


@dataclass
class StepResult:
    """Host-side results for the requests of a step that sampled (in step order)."""

    requests: list[Request]
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]


class ModelRunner:
    def __init__(self, model: DeepSeekV4ForCausalLM, config: EngineConfig, context_length: int) -> None:
        self.model, self.config = model, config
        self.ops = create_kernels(config.kernel_backend)
        self.device = next(model.parameters()).device
        dtype = model.embed.weight.dtype
        mc = model.config
        self.layout = plan_cache(mc, config, dtype)
        self.pools = KVPools(mc, self.layout, dtype, self.device)
        self.table = RequestTable(self.layout, config.max_running_requests, context_length, self.device)
        # penalty state per request slot: output-token counts and prompt-or-output membership
        self.token_counts = torch.zeros(config.max_running_requests, mc.vocab_size, dtype=torch.int32,
                                        device=self.device)
        self.seen = torch.zeros(config.max_running_requests, mc.vocab_size, dtype=torch.bool, device=self.device)
        logger.info("KV cache: %d full pages, %d SWA pages of %d tokens (%.1f MB)", self.layout.num_full_pages - 1,
                    self.layout.num_swa_pages - 1, self.layout.page_size, self.pools.nbytes() / 1e6)
        self.graphs = self._decode_graphs()

    def _decode_graphs(self) -> DecodeGraphs | None:
        c = self.config
        why_not = ("disable_cuda_graph" if c.disable_cuda_graph else
                   f"device {self.device.type}" if self.device.type != "cuda" else
                   "kernel_backend=ref (host syncs in its MoE)" if c.kernel_backend != "triton" else None)
        if why_not is not None:
            logger.info("CUDA graphs: off (%s); every step runs eagerly", why_not)
            return None
        max_batch = min(c.cuda_graph_max_bs, c.max_running_requests)
        logger.info("CUDA graphs: decode steps of up to %d requests, captured on first use", max_batch)
        return DecodeGraphs(self.model, self.table, self.pools, self.ops, max_batch)

    @torch.no_grad()
    def run(self, step: ScheduledStep) -> StepResult:
        self._reset_penalty_rows(step)
        if self.graphs is not None and self.graphs.fits(step.shape):
            logits, captured = self.graphs.run(step.input_ids, step.shape, self.config.capture_routing)
        else:
            logits, captured = self._forward_eager(step)
        sampled = [r for r, s in zip(step.requests, step.shape.sample, strict=True) if s]
        result = StepResult(sampled, [], [], [])
        if sampled:
            self._sample(logits, sampled, result)
        if captured is not None:
            self._store_routing(step, captured)
        return result

    def _forward_eager(self, step: ScheduledStep) -> tuple[torch.Tensor, dict[str, list[torch.Tensor]] | None]:
        """Logits [R, V] fp32 of the sampling requests (and the routing when captured), without graphs."""
        ctx = build_context(step.shape, self.table, self.pools, self.model.config, self.device)
        ctx.ops = self.ops
        if self.config.capture_routing:
            ctx.captured = {}
        ids = torch.tensor(step.input_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        return self.model.forward_batch(ids, ctx), ctx.captured

    def _sample(self, logits: torch.Tensor, reqs: list[Request], result: StepResult) -> None:
        slots = torch.tensor([r.slot for r in reqs], dtype=torch.int64).to(self.device, non_blocking=True)
        batch = SamplingBatch.build([r.params for r in reqs], [len(r.output_ids) for r in reqs],
                                    [r.seed for r in reqs], self.device, vocab_size=logits.shape[-1])
        counts = self.token_counts[slots] if batch.do_penalties else None
        seen = self.seen[slots] if batch.do_penalties else None
        out = sample(logits, batch, counts, seen)
        self.token_counts[slots, out.token_ids] += 1
        self.seen[slots, out.token_ids] = True
        # sync point: the sampled tokens (and their log-probs) go back to the scheduler
        result.token_ids = out.token_ids.tolist()
        result.logprobs = out.logprobs.tolist()
        if out.top_ids is not None and out.top_logprobs is not None:
            top_ids, top_lp = out.top_ids.tolist(), out.top_logprobs.tolist()
            for i, r in enumerate(reqs):
                n = r.params.logprobs or 0
                result.top_logprobs.append(dict(zip(top_ids[i][:n], top_lp[i][:n], strict=True)))
        else:
            result.top_logprobs = [{} for _ in reqs]

    def _reset_penalty_rows(self, step: ScheduledStep) -> None:
        """A request starting from position 0 (new or re-admitted) gets fresh penalty rows."""
        for req, start in zip(step.requests, step.shape.starts, strict=True):
            if start == 0 and req.slot is not None:
                self.token_counts[req.slot] = 0
                self.seen[req.slot] = False
                self.seen[req.slot, torch.tensor(req.all_ids, device=self.device)] = True
                if req.output_ids:
                    out = torch.tensor(req.output_ids, device=self.device)
                    self.token_counts[req.slot].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))

    def _store_routing(self, step: ScheduledStep, captured: dict[str, list[torch.Tensor]]) -> None:
        """Split the step's captured routing per request: experts [n, layers, k], indexer [n, csa_layers, k]."""
        lens = step.shape.lens
        for key, per_layer in captured.items():
            stacked = torch.stack(per_layer, dim=1).cpu()                     # [T, layers, k]
            for req, start, part in zip(step.requests, step.shape.starts, stacked.split(lens), strict=True):
                history = req.routing.setdefault(key, [])
                total = sum(t.shape[0] for t in history)
                if start < total:  # re-prefill after preemption: the recomputed routing replaces the old
                    req.routing[key] = history = [torch.cat(history)[:start]]
                history.append(part)
