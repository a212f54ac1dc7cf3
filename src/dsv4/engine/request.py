"""Request: one generation request inside the engine, and what it returns.

Length invariant: `num_cached <= len(all_ids)`; positions [0, num_cached) are in the KV cache and
`all_ids[num_cached:]` are the tokens the next steps must feed (the rest of the prompt while
prefilling, the last sampled token while decoding). A preempted request drops its cache
(`num_cached = 0`) and later re-prefills prompt + output so far (recompute preemption).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dsv4.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from dsv4.cache.radix import LockHandle


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
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    slot: int | None = None
    num_cached: int = 0
    cached_tokens: int = 0          # prompt tokens served from the prefix cache at (last) admission
    finish_reason: str | None = None
    text: str = ""
    arrival_time: float = field(default_factory=time.perf_counter)
    token_times: list[float] = field(default_factory=list)
    routing: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    cache_lock: LockHandle | None = None     # this request's lock on its prefix-cache path

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the cache (fed by the next steps)."""
        return len(self.prompt_ids) + len(self.output_ids) - self.num_cached

    @property
    def is_finished(self) -> bool:
        return self.status is ReqStatus.FINISHED


@dataclass
class RequestOutput:
    """What `LLM.generate` returns per request (token ids, text, log-probs, finish reason, timing)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    finish_reason: str | None
    ttft: float | None                  # seconds from arrival to the first output token
    token_latencies: list[float]        # seconds between consecutive output tokens
    cached_tokens: int = 0              # prompt tokens that came from the prefix cache
    routing: dict[str, torch.Tensor] | None = None   # per-token captured routing (capture_routing=True)

    @staticmethod
    def from_request(req: Request) -> RequestOutput:
        times = [req.arrival_time, *req.token_times]
        routing = {k: torch.cat(v) for k, v in req.routing.items()} if req.routing else None
        return RequestOutput(request_id=req.rid, prompt_token_ids=req.prompt_ids, token_ids=list(req.output_ids),
                             text=req.text, logprobs=list(req.logprobs), top_logprobs=list(req.top_logprobs),
                             finish_reason=req.finish_reason,
                             ttft=(req.token_times[0] - req.arrival_time) if req.token_times else None,
                             token_latencies=[b - a for a, b in zip(times[1:], times[2:], strict=False)],
                             cached_tokens=req.cached_tokens, routing=routing)
