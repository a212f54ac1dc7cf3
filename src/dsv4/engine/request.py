"""Request: one generation request inside the engine, and what it returns.

Length invariant: `num_cached <= len(all_ids)`; positions [0, num_cached) are in the KV cache and
`all_ids[num_cached:]` are the tokens the next steps must feed (the rest of the prompt while
prefilling, the tokens sampled last while decoding). Under overlap scheduling a launched step's
sampled token is not on the host yet: `num_inflight` (0 or 1 between steps) counts it as pending,
and the next step feeds it from the device. A preempted request drops its cache
(`num_cached = 0`) and later re-prefills prompt + output so far (recompute preemption).

`all_ids` is kept incrementally (prompt, then every output token as `append_token` adds it), so
reading it costs nothing at any context length; `append_token` and `overwrite_output` (teacher
forcing) are the only writers of the outputs.
The engine deals in token ids only: text, and stop strings, are the caller's (engine/stop.py).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from dsv4.cache.radix import LockHandle
from dsv4.engine.sampling_params import SamplingParams


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    output_ids: list[int] = field(default_factory=list)
    # params.logprobs is not None: per output token its log-prob and top-k; else both stay empty
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    slot: int | None = None
    num_cached: int = 0
    cached_tokens: int = 0          # prompt tokens served from the prefix cache at (last) admission
    finish_reason: str | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    token_times: list[float] = field(default_factory=list)
    routing: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    cache_lock: LockHandle | None = None     # this request's lock on its prefix-cache path
    # speculative decoding: drafts for the positions after the pending token, and the totals of
    # drafts fed for verification and of drafts accepted
    draft_ids: list[int] = field(default_factory=list)
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # params.prompt_logprobs: per prompt position its token's log-prob (None at 0) and top-k
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    # params.structured: the request's xgrammar GrammarMatcher (engine/grammar.py), advanced
    # by the engine with every appended token
    grammar: Any = None
    # overlap scheduling: tokens sampled by launched steps that are not appended yet
    num_inflight: int = 0
    all_ids: list[int] = field(init=False)    # prompt_ids + output_ids, kept by append_token

    def __post_init__(self) -> None:
        assert not self.output_ids, "a request starts without output (append_token adds it)"
        self.all_ids = list(self.prompt_ids)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_top_logprobs = [None], [{}]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """It asked for prompt log-probs and they are still to be computed (the first
        prefill)."""
        return (self.params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < len(self.prompt_ids))

    def add_prompt_logprob(self, position: int, logprob: float, top: dict[int, float]) -> None:
        """The log-prob of prompt token `position`; a position already recorded (a prefill
        repeated after preemption) is ignored."""
        if position == len(self.prompt_logprobs):
            self.prompt_logprobs.append(logprob)
            self.prompt_top_logprobs.append(top)

    def append_token(self, token_id: int, logprob: float | None, top: dict[int, float] | None,
                     now: float) -> None:
        """Add one sampled token and its arrival time, and when the request asked for log-probs
        (`params.logprobs` is not None) its log-prob and top log-probs (`top`: None = {}).

        A request that did not ask keeps no log-probs, whatever it is given: the sampler computes
        them for a whole batch when any row asks, so storing them would make a request's output
        depend on its batch."""
        self.output_ids.append(token_id)
        self.all_ids.append(token_id)
        if self.params.logprobs is not None:
            assert logprob is not None, "a request that asked for log-probs got none"
            self.logprobs.append(logprob)
            self.top_logprobs.append({} if top is None else top)
        self.token_times.append(now)

    def overwrite_output(self, index: int, token_id: int) -> None:
        """Replace output token `index` before it is fed (teacher forcing); its position is not
        cached yet."""
        position = len(self.prompt_ids) + index
        assert position >= self.num_cached, f"output token {index} is already in the KV cache"
        self.output_ids[index] = token_id
        self.all_ids[position] = token_id

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the cache (fed by the next steps), the in-flight one included."""
        return len(self.all_ids) + self.num_inflight - self.num_cached

    def check_integrity(self) -> None:
        assert len(self.all_ids) == len(self.prompt_ids) + len(self.output_ids), \
            "all_ids out of step"
        assert self.all_ids[len(self.prompt_ids):] == self.output_ids, \
            "all_ids does not end in the output"
        assert 0 <= self.num_cached <= len(self.all_ids), "num_cached outside [0, len(all_ids)]"
        assert self.num_inflight in (0, 1), "more than one step's token in flight"

    @property
    def is_finished(self) -> bool:
        return self.status is ReqStatus.FINISHED


@dataclass
class RequestOutput:
    """What `LLM.generate` returns per request (token ids, text, log-probs, finish reason,
    timing)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    # per output token when SamplingParams.logprobs is not None; else both empty
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    finish_reason: str | None
    ttft: float | None                  # seconds from arrival to the first output token
    token_latencies: list[float]        # seconds between consecutive output tokens
    cached_tokens: int = 0              # prompt tokens that came from the prefix cache
    # per-token captured routing (capture_routing=True)
    routing: dict[str, torch.Tensor] | None = None
    # speculative decoding: drafts verified and drafts accepted over the request
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # SamplingParams.prompt_logprobs: per prompt token (None for the first) and its top-k
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float]] | None = None

    @staticmethod
    def from_request(req: Request, text: str = "", num_tokens: int | None = None,
                     finish_reason: str | None = None) -> RequestOutput:
        """The output of a finished request: its first `num_tokens` output tokens (all by default;
        fewer when a stop string ended it inside a step's tokens), the caller's `text` and
        `finish_reason` (default: the engine's)."""
        n = len(req.output_ids) if num_tokens is None else num_tokens
        times = [req.arrival_time, *req.token_times[:n]]
        routing = {k: torch.cat(v) for k, v in req.routing.items()} if req.routing else None
        return RequestOutput(request_id=req.rid, prompt_token_ids=req.prompt_ids,
                             token_ids=req.output_ids[:n], text=text, logprobs=req.logprobs[:n],
                             top_logprobs=req.top_logprobs[:n],
                             finish_reason=finish_reason or req.finish_reason,
                             ttft=((req.token_times[0] - req.arrival_time) if req.token_times
                                   else None),
                             token_latencies=[b - a for a, b in zip(times[1:], times[2:],
                                                                    strict=False)],
                             cached_tokens=req.cached_tokens, routing=routing,
                             spec_draft_tokens=req.spec_draft_tokens,
                             spec_accepted_tokens=req.spec_accepted_tokens,
                             prompt_logprobs=(req.prompt_logprobs
                                              if req.params.prompt_logprobs is not None else None),
                             prompt_top_logprobs=(req.prompt_top_logprobs
                                                  if req.params.prompt_logprobs is not None
                                                  else None))
