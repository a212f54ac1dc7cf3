"""LLMEngine: requests in, tokens out. Ties the scheduler, the model runner and the detokenizer.

`add_request` validates at the edge (empty prompt, too long, unknown token ids, a request that
can never fit the cache) and raises ValueError naming the field; a bad request never reaches the
scheduler, so the running ones keep going. `step()` runs one scheduled batch and applies the stop
rules (eos unless ignore_eos, stop token ids, stop strings on the detokenized text — excluded from
the text —, max_tokens, context length).
"""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass

from tokenizers import Tokenizer

from dsv4.cache.radix import RadixPrefixCache
from dsv4.config.engine import EngineConfig
from dsv4.engine.request import ReqStatus, Request
from dsv4.engine.runner import ModelRunner, StepResult
from dsv4.engine.sampling_params import SamplingParams
from dsv4.engine.scheduler import Scheduler
from dsv4.engine.stop import IncrementalDetokenizer, StopChecker
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)


@dataclass
class _TextState:
    detok: IncrementalDetokenizer
    stop: StopChecker


@dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0


class LLMEngine:
    def __init__(self, model: DeepSeekV4ForCausalLM, config: EngineConfig, tokenizer: Tokenizer | None = None) -> None:
        mc = model.config
        self.config, self.tokenizer, self.vocab_size = config, tokenizer, mc.vocab_size
        self.eos_token_id = mc.eos_token_id
        self.context_length = config.context_length or mc.max_position_embeddings
        self.runner = ModelRunner(model, config, self.context_length)
        self.cache = None if config.disable_prefix_cache else RadixPrefixCache(self.runner.table,
                                                                                self.runner.layout.swa_horizon)
        self.scheduler = Scheduler(config, self.runner.table, self.cache)
        self.requests: dict[str, Request] = {}
        self._text: dict[str, _TextState] = {}
        self._ids = itertools.count()
        self._seeds = random.Random(config.seed)
        self.stats = EngineStats()

    # ---- edge -------------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("prompt is empty; allowed: at least one token")
        if len(prompt_ids) >= self.context_length:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; allowed: fewer than the context length "
                             f"{self.context_length}")
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids contains unknown token ids {bad[:5]}; "
                             f"allowed: 0..{self.vocab_size - 1}")
        need = min(len(prompt_ids) + params.max_tokens, self.context_length)
        if need > self.runner.layout.max_total_tokens:
            raise ValueError(f"prompt + max_tokens = {need} tokens cannot fit the KV cache "
                             f"({self.runner.layout.max_total_tokens} tokens); allowed: a smaller max_tokens or prompt")

    def add_request(self, prompt_ids: list[int], params: SamplingParams, rid: str | None = None) -> Request:
        self.validate(prompt_ids, params)
        rid = rid if rid is not None else str(next(self._ids))
        if rid in self.requests:
            raise ValueError(f"request_id={rid!r} is already in use")
        seed = params.seed if params.seed is not None else self._seeds.randrange(2**62)
        req = Request(rid=rid, prompt_ids=list(prompt_ids), params=params, seed=seed)
        self.requests[rid] = req
        if self.tokenizer is not None:
            self._text[rid] = _TextState(IncrementalDetokenizer(self.tokenizer,
                                                                skip_special_tokens=params.skip_special_tokens),
                                         StopChecker(params.stop))
        self.scheduler.add(req)
        return req

    def abort(self, rid: str) -> None:
        req = self.requests.get(rid)
        if req is not None and not req.is_finished:
            self.scheduler.finish(req, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # ---- loop -------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one batch; returns the requests that finished in it."""
        step = self.scheduler.schedule()
        if step is None:
            if self.scheduler.has_work:
                raise RuntimeError("no request can be scheduled: the KV cache is too small for a single request")
            return []
        result = self.runner.run(step)
        self.scheduler.after_step(step)
        self.stats.steps += 1
        decode = sum(1 for n in step.shape.lens if n == 1)
        self.stats.decode_tokens += decode
        self.stats.prefill_tokens += step.num_tokens - decode
        return self._process(result)

    def _process(self, result: StepResult) -> list[Request]:
        now, finished = time.perf_counter(), []
        for req, tok, lp, top in zip(result.requests, result.token_ids, result.logprobs, result.top_logprobs,
                                     strict=True):
            if req.status is not ReqStatus.RUNNING:
                continue
            req.output_ids.append(tok)
            req.logprobs.append(lp)
            if req.params.logprobs is not None:
                req.top_logprobs.append(top)
            req.token_times.append(now)
            reason = self._finish_reason(req, tok)
            if reason is not None:
                self.scheduler.finish(req, reason)
                finished.append(req)
        return finished

    def _finish_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        stopped_by_text = self._update_text(req, tok)
        if stopped_by_text:
            return "stop"
        if (tok == self.eos_token_id and not p.ignore_eos) or tok in p.stop_token_ids:
            self._final_text(req)
            return "stop"
        if len(req.output_ids) >= p.max_tokens or len(req.prompt_ids) + len(req.output_ids) >= self.context_length:
            self._final_text(req)
            return "length"
        return None

    def _update_text(self, req: Request, tok: int) -> bool:
        state = self._text.get(req.rid)
        if state is None:
            return False
        state.detok.add(tok)
        req.text, stopped = state.stop.feed(state.detok.text)
        return stopped

    def _final_text(self, req: Request) -> None:
        state = self._text.get(req.rid)
        if state is not None:
            state.detok.flush()
            req.text, _ = state.stop.feed(state.detok.text, is_final=True)

    def pop(self, rid: str) -> Request:
        """Forget a finished request and return it."""
        self._text.pop(rid, None)
        return self.requests.pop(rid)

    def flush_cache(self) -> None:
        """Drop every prefix-cache entry that no running request uses."""
        if self.cache is not None:
            self.cache.flush()

    def prefix_hit_rate(self) -> float:
        s = self.scheduler
        return s.cached_prompt_tokens / s.prompt_tokens if s.prompt_tokens else 0.0

    def check_integrity(self) -> None:
        self.runner.table.check_integrity()
        if self.cache is not None:
            self.cache.check_integrity()
