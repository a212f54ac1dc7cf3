"""What a data-parallel attention rank reports to rank 0 after each step (`engine/parallel.py`):
per updated request, only what the step added (`RequestDelta`), sent through the control group's
`gather_object` (`Outbox`); rank 0 applies the deltas to its mirror `Request`s
(`engine/data_parallel.py`)."""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from dsv4.engine.request import ReqStatus, Request


@dataclasses.dataclass(frozen=True)
class RequestDelta:
    """What one step gave a request on a data-parallel rank: its new output tokens (with
    log-probs and top log-probs when asked, else both empty), new prompt log-probs, and its state
    after it."""

    rid: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    prompt_logprobs: list[float | None]
    prompt_top_logprobs: list[dict[int, float]]
    status: ReqStatus
    finish_reason: str | None
    cached_tokens: int

    def apply_to(self, req: Request, now: float) -> Request:
        """Bring rank 0's mirror `req` up to date (token times: `now`, rank 0's clock)."""
        asked = req.params.logprobs is not None
        for i, tok in enumerate(self.token_ids):
            req.append_token(tok, self.logprobs[i] if asked else None,
                             self.top_logprobs[i] if asked else None, now)
        for plp, top in zip(self.prompt_logprobs, self.prompt_top_logprobs, strict=True):
            assert plp is not None, "only position 0 has no prompt log-prob (never sent)"
            req.add_prompt_logprob(len(req.prompt_logprobs), plp, top)
        req.status, req.finish_reason = self.status, self.finish_reason
        req.cached_tokens = self.cached_tokens
        return req


class Outbox:
    """A data-parallel rank's reports to rank 0: per request, how many output tokens and prompt
    log-probs it has sent, so each `RequestDelta` carries only what is new."""

    def __init__(self, rank: int, control: dist.ProcessGroup) -> None:
        self.rank, self.control = rank, control
        self._sent: dict[str, tuple[int, int]] = {}

    def send(self, updated: list[Request]) -> None:
        """Rank 0's side is `DataParallelEngine._receive` (the same gather)."""
        dist.gather_object([self._delta(r) for r in updated], None, dst=0, group=self.control)

    def forget(self, rid: str) -> None:
        self._sent.pop(rid, None)

    def _delta(self, req: Request) -> RequestDelta:
        start = 1 if req.params.prompt_logprobs is not None else 0   # position 0 has none
        out, prompt = self._sent.get(req.rid, (0, start))
        self._sent[req.rid] = (len(req.output_ids), len(req.prompt_logprobs))
        return RequestDelta(req.rid, req.output_ids[out:], req.logprobs[out:],
                            req.top_logprobs[out:], req.prompt_logprobs[prompt:],
                            req.prompt_top_logprobs[prompt:], req.status, req.finish_reason,
                            req.cached_tokens)
