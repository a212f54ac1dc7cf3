"""LLMEngine: token ids in, token ids out. Ties the scheduler, the prefix cache and the model
runner.

`add_request` validates at the edge (empty prompt, too long, unknown token ids, a request that
can never fit the cache) and raises ValueError naming the field; a bad request never reaches the
scheduler, so the running ones keep going. `step()` runs one scheduled batch, appends each request's
new tokens (a step may yield several per request) and applies the token-level stop rules (eos unless
ignore_eos, stop token ids, max_tokens, context length). Text and stop strings are the caller's
(engine/stop.py::OutputText): a caller that sees a stop string calls `finish(rid, "stop")`.

Overlap scheduling (`EngineConfig.overlap_schedule`): `step()` schedules and launches step N + 1
before it resolves step N (the step's one host sync), so the host's scheduling and processing
hide behind the device's work. The rule: step N + 1 is launched ahead of N's resolve unless a
request of N has a grammar or asks for prompt log-probs (its next step needs N's results on the
host); then N is resolved first. A decoding request's input token in N + 1 is gathered on the
device from N's sampled tokens; one whose N token reaches max_tokens is not in N + 1. A request
that N finishes otherwise (stop token, context length) or its caller finishes (abort, stop
string) while it is in N + 1 frees its slot and pages at once, the KV of the extra position
outside the prefix cache (past its cached length); the device reuses them only in later steps
(one stream), and its N + 1 token is dropped when N + 1 resolves.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Mapping
from concurrent import futures
from pathlib import Path
from typing import Any

import torch

from dsv4.cache.prefix_cache import create_prefix_cache
from dsv4.config.engine import EngineConfig
from dsv4.engine.engine_state import EngineState
from dsv4.engine.grammar import Grammars, advance_grammar, new_matcher
from dsv4.engine.request import ReqStatus, Request
from dsv4.engine.runner import ModelRunner
from dsv4.engine.sampling_params import SamplingParams
from dsv4.engine.scheduler import ScheduledStep, Scheduler
from dsv4.engine.step_output import StepOutput, StepResult
from dsv4.engine.weight_sync import read_checkpoint_dir, update_weights
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)

FINISH_REASONS = ("stop", "length", "abort")
COMPILE_WAIT_S = 0.05
"""With only compiling requests left, how long a step waits for a grammar before returning."""


class LLMEngine:
    def __init__(self, model: DeepSeekV4ForCausalLM, config: EngineConfig,
                 grammars: Grammars | None = None) -> None:
        """`grammars`: structured output for this model's tokenizer (`engine/grammar.py`); None
        refuses requests with `params.structured`."""
        mc = model.config
        self.grammars = grammars
        self.config, self.vocab_size = config, mc.vocab_size
        self.eos_token_id = mc.eos_token_id
        self.context_length = config.context_length or mc.max_position_embeddings
        self.runner = ModelRunner(model, config, self.context_length)
        self.overlap = bool(self.runner.config.overlap_schedule)     # resolved for the device
        self.max_total_tokens = self.runner.layout.max_total_tokens
        self.cache = create_prefix_cache(self.runner.table, self.runner.layout.swa_horizon,
                                         enabled=not config.disable_prefix_cache)
        self.scheduler = Scheduler(config, self.runner.table, self.cache)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._seeds = random.Random(config.seed)
        self.steps = self.prefill_tokens = self.decode_tokens = 0
        self.weight_version = 0     # weight updates applied since load
        self.spec_steps = config.speculative_num_steps
        # speculative decoding: verify passes by accepted drafts (0..N), drafts fed and accepted
        self.spec_accept_hist = [0] * (self.spec_steps + 1)
        self.spec_draft_tokens = self.spec_accepted_tokens = 0
        # structured requests whose grammar is still compiling: (request, future), not scheduled
        self._compiling: dict[str, tuple[Request, futures.Future[Any]]] = {}
        # overlap scheduling: the launched step not resolved yet, and the requests that got tokens
        # from a step resolved outside `step()` (reported by the next `step()`)
        self._inflight: tuple[ScheduledStep, StepOutput] | None = None
        self._drained: list[Request] = []

    # ---- edge -------------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("prompt is empty; allowed: at least one token")
        if len(prompt_ids) >= self.context_length:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; allowed: fewer than the "
                             f"context length {self.context_length}")
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids contains unknown token ids {bad[:5]}; "
                             f"allowed: 0..{self.vocab_size - 1}")
        if params.prompt_logprobs is not None and self.spec_steps:
            raise ValueError("prompt_logprobs is not supported with speculative decoding; "
                             "allowed: None, or an engine with speculative_num_steps=0")
        if params.structured is not None and self.grammars is None:
            raise ValueError("structured output needs an engine with a tokenizer; "
                             "allowed: structured=None here")
        bad_bias = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        if bad_bias:
            raise ValueError(f"logit_bias has unknown token ids {bad_bias[:5]}; "
                             f"allowed: 0..{self.vocab_size - 1}")
        need = min(len(prompt_ids) + params.max_tokens, self.context_length)
        if need > self.runner.rope_positions:      # the serving path reads RoPE rows unchecked
            raise ValueError(f"prompt + max_tokens = {need} tokens reach past the RoPE cache "
                             f"(positions 0..{self.runner.rope_positions - 1})")
        if need > self.max_total_tokens:
            raise ValueError(f"prompt + max_tokens = {need} tokens cannot fit the KV cache "
                             f"({self.max_total_tokens} tokens); "
                             "allowed: a smaller max_tokens or prompt")

    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    rid: str | None = None) -> Request:
        self.validate(prompt_ids, params)
        rid = rid if rid is not None else str(next(self._ids))
        if rid in self.requests:
            raise ValueError(f"request_id={rid!r} is already in use")
        seed = params.seed if params.seed is not None else self._seeds.randrange(2**62)
        compiling = None
        if params.structured is not None:
            assert self.grammars is not None              # validate() refused it otherwise
            compiling = self.grammars.prepare(params.structured)    # ValueError: a bad spec
        req = Request(rid=rid, prompt_ids=list(prompt_ids), params=params, seed=seed)
        self.requests[rid] = req
        if compiling is None:
            self.scheduler.add(req)
        else:   # scheduled once its grammar is compiled (engine/grammar.py)
            self._compiling[rid] = (req, compiling)
            self._admit_compiled()
        return req

    def _admit_compiled(self, wait_s: float = 0.0) -> None:
        """Requests whose grammar is compiled go to the scheduler with a fresh matcher; with
        nothing else to run, wait up to `wait_s` for one."""
        if not self._compiling:
            return
        if wait_s > 0:
            futures.wait([f for _, f in self._compiling.values()], timeout=wait_s,
                         return_when=futures.FIRST_COMPLETED)
        for rid, (req, compiling) in list(self._compiling.items()):
            if compiling.done():
                del self._compiling[rid]
                req.grammar = new_matcher(compiling.result())
                self.scheduler.add(req)

    def finish(self, rid: str, reason: str = "abort") -> None:
        """End a request now (its pages are freed): "abort", or "stop" when its caller saw a stop
        string."""
        if reason not in FINISH_REASONS:
            raise ValueError(f"reason={reason!r} is invalid; allowed: {list(FINISH_REASONS)}")
        req = self.requests.get(rid)
        if rid in self._compiling:                       # never scheduled: nothing to free
            del self._compiling[rid]
            assert req is not None
            req.status, req.finish_reason = ReqStatus.FINISHED, reason
        elif req is not None and not req.is_finished:
            self.scheduler.finish(req, reason)

    def abort(self, rid: str) -> None:
        self.finish(rid, "abort")

    def has_unfinished(self) -> bool:
        """Requests queued, running or compiling, or a launched step still to resolve."""
        return self.scheduler.has_work or bool(self._compiling) or self._inflight is not None

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- loop -------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one batch; returns the requests that got tokens in it (finished ones included), in
        step order. Under `overlap_schedule` those are the tokens of the step the call before
        launched (this call launches the next step first)."""
        self._admit_compiled(wait_s=0.0 if self.scheduler.has_work else COMPILE_WAIT_S)
        if self.overlap:
            return self._step_overlap()
        return self.step_sync()[1]

    def step_sync(self) -> tuple[ScheduledStep | None, list[Request]]:
        """Schedule, run and resolve one step now, whatever `overlap_schedule` says: (the step,
        None when nothing was scheduled; the requests that got tokens)."""
        step = self.scheduler.schedule()
        if step is None:
            if self.scheduler.has_work:
                raise RuntimeError("no request can be scheduled: "
                                   "the KV cache is too small for a single request")
            return None, []
        out = self.runner.run(step)
        result = out.resolve()
        self.scheduler.after_step(step, out.kept() if self.spec_steps else None)
        self._count(step)
        return step, self._process(result)

    def step_or_idle(self) -> list[Request]:
        """`step_sync`, or with nothing to schedule one forward on a padding row
        (`ModelRunner.run_idle`): exactly one forward per call, for data-parallel attention,
        whose MoE layers are collectives that every rank joins each step (`engine/parallel.py`).
        Returns the requests that got tokens."""
        assert not self.overlap and not self.spec_steps, \
            "step_or_idle() runs one plain forward: no overlap scheduling or speculation"
        step, updated = self.step_sync()
        if step is None:
            self.runner.run_idle()
        return updated

    def _count(self, step: ScheduledStep) -> None:
        self.steps += 1
        # decode: every fed token has logits (one token, or a verify pass of N + 1)
        decode = sum(n for n, k in zip(step.shape.lens, step.shape.num_logits, strict=True)
                     if k == n)
        self.decode_tokens += decode
        self.prefill_tokens += step.num_tokens - decode

    def _step_overlap(self) -> list[Request]:
        """Schedule and launch the next step while the one the call before launched still runs,
        then resolve that one and process its tokens (module docstring: the rule and late
        finishes). Its sampled tokens reach the new step on the device (`ScheduledStep.ahead`)."""
        updated, self._drained = self._drained, []
        prev, self._inflight = self._inflight, None
        if prev is not None and not self._can_overlap(prev[0]):
            updated += self._resolve(prev)
            prev = None
        step = self.scheduler.schedule()
        out = None
        if step is not None:
            if step.ahead:
                assert prev is not None, "a token in flight without a launched step"
                self._feed_ahead(step, prev[1])
            out = self.runner.run(step)
            for req in out.requests:
                req.num_inflight += 1
        elif prev is None and self.scheduler.has_work:
            raise RuntimeError("no request can be scheduled: "
                               "the KV cache is too small for a single request")
        if prev is not None:
            updated += self._resolve(prev)
        if step is not None:
            assert out is not None
            # after N's tokens are appended: a request N finished is skipped
            self.scheduler.after_step(step)
            self._count(step)
            self._inflight = (step, out)
        return updated

    @staticmethod
    def _can_overlap(step: ScheduledStep) -> bool:
        """Whether the next step may be scheduled before `step` resolves: none of its requests
        needs `step`'s results on the host first (a grammar's next mask; prompt log-probs)."""
        return all(r.grammar is None and r.params.prompt_logprobs is None for r in step.requests)

    @staticmethod
    def _feed_ahead(step: ScheduledStep, prev: StepOutput) -> None:
        """Point the step's in-flight inputs at their rows of `prev`'s sampled tokens (one row
        per request without speculation)."""
        assert prev.sampled is not None
        rows = {id(r): i for i, r in enumerate(prev.requests)}
        step.source = prev.sampled.token_ids
        step.source_rows = [rows[id(req)] for _, req in step.ahead]

    def _resolve(self, launched: tuple[ScheduledStep, StepOutput]) -> list[Request]:
        """Wait for a launched step's tokens (the host sync) and process them."""
        out = launched[1]
        result = out.resolve()
        for req in out.requests:
            req.num_inflight -= 1
        return self._process(result)

    def _drain(self) -> None:
        """Resolve the launched step now (its requests are reported by the next `step()`)."""
        if self._inflight is not None:
            launched, self._inflight = self._inflight, None
            self._drained += self._resolve(launched)

    def _process(self, result: StepResult) -> list[Request]:
        """Append each request's tokens up to the first that finishes it (the rest are dropped)."""
        now, updated = time.perf_counter(), []
        for req, position, logprob, top in result.prompt:
            req.add_prompt_logprob(position, logprob, top)
        for req, out in zip(result.requests, result.outputs, strict=True):
            # a request preempted while its token was in flight (overlap) still gets the token
            if req.status is ReqStatus.FINISHED:
                continue
            req.draft_ids = out.next_drafts
            appended = 0
            for i, tok in enumerate(out.token_ids):
                appended += 1
                asked = req.params.logprobs is not None
                req.append_token(tok, out.logprobs[i] if asked else None,
                                 out.top_logprobs[i] if asked else None, now)
                reason = self._finish_reason(req, tok)
                if req.grammar is not None and reason is None:
                    # under speculation each emitted token in turn (the runner's walk along the
                    # drafts was rolled back), none after the one that finishes
                    reason = advance_grammar(req.grammar, tok, req.rid)
                if reason is not None:
                    # tokens after this one are dropped, and with them their KV
                    req.num_cached = min(req.num_cached, len(req.all_ids) - 1)
                    self.scheduler.finish(req, reason)
                    break
            # accepted drafts that made it into the output (none past a stop or max_tokens)
            self._count_drafts(req, out.num_drafts, min(len(out.token_ids) - 1, appended))
            updated.append(req)
        return updated

    def _count_drafts(self, req: Request, drafts: int, accepted: int) -> None:
        if drafts == 0:
            return
        req.spec_draft_tokens += drafts
        req.spec_accepted_tokens += accepted
        self.spec_draft_tokens += drafts
        self.spec_accepted_tokens += accepted
        self.spec_accept_hist[accepted] += 1

    def mean_acceptance_length(self) -> float | None:
        """Tokens per verify pass (accepted drafts + 1) over the engine's life; None before any
        verify pass."""
        passes = sum(self.spec_accept_hist)
        return 1 + self.spec_accepted_tokens / passes if passes else None

    def _finish_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        if (tok == self.eos_token_id and not p.ignore_eos) or tok in p.stop_token_ids:
            return "stop"
        if len(req.output_ids) >= p.max_tokens or len(req.all_ids) >= self.context_length:
            return "length"
        return None

    def pop(self, rid: str) -> Request:
        """Forget a finished request and return it."""
        return self.requests.pop(rid)

    def flush_cache(self) -> None:
        """Drop every prefix-cache entry that no running request uses."""
        self.cache.flush()

    def update_weights(self, named: Mapping[str, torch.Tensor]) -> int:
        """Copy new weights into the served model between steps (`weight_sync.update_weights`:
        in place, atomic, partial updates allowed); returns the number of tensors updated and
        bumps `weight_version`. A ValueError leaves the weights and every request as they were.

        KV computed with the old weights is never used again: running requests are retracted
        (recompute preemption: they re-prefill prompt + output so far with the new weights, then
        continue) and the prefix cache, no longer used by any request, is flushed empty.
        """
        self._drain()
        num = update_weights(self.runner.model, named)
        self.retract_running()
        self.flush_cache()
        self.weight_version += 1
        logger.info("weights updated: %d tensors, weight version %d", num, self.weight_version)
        return num

    def retract_running(self) -> int:
        """Preempt every running request (recompute: its KV is freed, and it re-prefills prompt +
        output so far when scheduled again, in its running order); returns how many."""
        self._drain()
        running = list(reversed(self.scheduler.running))   # appendleft keeps the running order
        for req in running:
            self.scheduler.preempt(req)
        return len(running)

    def load_weights_from_dir(self, path: str | Path) -> int:
        """`update_weights` with every tensor of the official-layout checkpoint at `path`
        (`weight_sync.read_checkpoint_dir`: ValueError for another architecture or a missing,
        corrupt or incomplete checkpoint)."""
        return self.update_weights(read_checkpoint_dir(path, self.runner.model))

    def release_memory(self) -> int:
        """Free the KV pools and CUDA graphs between batches of work (a colocated RL trainer
        steps meanwhile); returns the bytes freed. Refused while requests are queued or running:
        their KV would be lost. The prefix cache is flushed first (its pages would come back
        zeroed)."""
        if self.has_unfinished():
            raise RuntimeError("release_memory() with requests in flight; allowed: an idle engine")
        self.flush_cache()
        return self.runner.release_memory()

    def resume_memory(self) -> None:
        """Undo `release_memory` (pools zeroed, graphs re-captured on first use)."""
        self.runner.resume_memory()

    def prefix_hit_rate(self) -> float:
        s = self.scheduler
        return s.cached_prompt_tokens / s.prompt_tokens if s.prompt_tokens else 0.0

    def snapshot(self) -> EngineState:
        table, sched = self.runner.table, self.scheduler
        return EngineState(
            num_running=self.num_running, num_waiting=self.num_waiting,
            num_requests=len(self.requests), full_free=table.full.num_free,
            full_usable=table.full.num_usable, full_cached=len(table.shared),
            swa_free=table.swa.num_free, swa_usable=table.swa.num_usable,
            swa_cached=sum(1 for p in table.shared if p in table.swa_of),
            free_slots=table.num_free_slots, num_slots=self.config.max_running_requests,
            steps=self.steps, prefill_tokens=self.prefill_tokens,
            decode_tokens=self.decode_tokens, num_preemptions=sched.num_preemptions,
            spec_num_steps=self.spec_steps, spec_accept_hist=tuple(self.spec_accept_hist),
            spec_draft_tokens=self.spec_draft_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens)

    def check_integrity(self) -> None:
        self.runner.table.check_integrity()
        self.cache.check_integrity()
        if self.runner.pools.hot is not None:
            self.runner.pools.hot.check_integrity()
        inflight = set() if self._inflight is None else {id(r) for r in self._inflight[1].requests}
        for req in self.requests.values():
            req.check_integrity()
            assert req.num_inflight == (id(req) in inflight), \
                f"request {req.rid}: in-flight count does not match the launched step"
