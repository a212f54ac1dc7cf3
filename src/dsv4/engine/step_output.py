"""The host side of a launched step: its device results, their host copies in flight, and the
per-request split once they arrive.

`StepOutput` holds a step's sampled tokens (and, under speculative decoding, the accepted counts
and next drafts; with `prompt_logprobs`, the prompt rows' log-probs) on the device together with
their pinned host copies and the event that marks them done. `resolve()` is the step's one host
sync: it returns a `StepResult` (per sampling request its `RequestTokens`, plus the prompt
log-probs) and stores captured routing per request. The device tensors stay valid after the next
step is launched (they are not graph outputs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dsv4.engine.cuda_graph import Captured
from dsv4.engine.request import Request
from dsv4.engine.sampler import SampleOutput, raw_logprobs
from dsv4.engine.scheduler import ScheduledStep
from dsv4.engine.spec_decode import Drafts
from dsv4.utils.device import to_device


@dataclass
class RequestTokens:
    """The tokens one request got in a step (in order), with their log-probs and top log-probs;
    under speculative decoding also the drafts it fed that were verified (`num_drafts`) and the
    drafts for its next step."""

    token_ids: list[int]
    # one per token when the request asked for log-probs (`params.logprobs`), else empty
    logprobs: list[float]
    # one dict per token ({} when the request asked for none)
    top_logprobs: list[dict[int, float]]
    num_drafts: int = 0
    next_drafts: list[int] = field(default_factory=list)


@dataclass
class StepResult:
    """Host-side results for the requests of a step that sampled (in step order), and the prompt
    log-probs it computed: (request, prompt position, log-prob of its token, top-k)."""

    requests: list[Request]
    outputs: list[RequestTokens]
    prompt: list[tuple[Request, int, float, dict[int, float]]] = field(default_factory=list)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """Start a device -> host copy into pinned memory (no wait); a CPU tensor is returned as it
    is."""
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


@dataclass(frozen=True)
class PromptRows:
    """Prompt log-probs of a step's prompt rows, on the device: `meta` (request, position) per
    row; `logprobs` [P]; `top_ids` / `top_logprobs` [P, k] (None when no request asks for any)."""

    meta: list[tuple[Request, int]]
    logprobs: torch.Tensor
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None

    @staticmethod
    def compute(logits: torch.Tensor, rows: list[tuple[Request, int, int]],
                device: torch.device) -> PromptRows:
        """Raw log-probs (the sampler's convention) of each row's next prompt token."""
        idx = to_device(torch.tensor([[r, req.all_ids[p]] for req, r, p in rows],
                                     dtype=torch.int64), device)
        k = max(req.params.prompt_logprobs or 0 for req, _, _ in rows)
        lp, top_lp, top_ids = raw_logprobs(logits[idx[:, 0]], idx[:, 1], k)
        return PromptRows([(req, p) for req, _, p in rows], lp, top_ids, top_lp)


class StepOutput:
    """A step's sampled tokens on the device and their host copies in flight.

    `rows[i]` logit rows of the step belong to `requests[i]` (consecutive, in step order). Holding
    one does not block; `resolve()` waits for the copies (the step's one host sync) and returns the
    host lists. The device tensors stay valid until the next step's sampling: a greedy step's token
    ids may be a decode graph's static output (`DecodeGraphs.argmax_last`), which the next replay
    of that argmax graph overwrites, stream-ordered after the next step has read them (its
    in-flight inputs, `ScheduledStep.source`)."""

    def __init__(self, step: ScheduledStep, requests: list[Request], rows: list[int],
                 sampled: SampleOutput | None, captured: Captured | None,
                 device: torch.device, drafts: Drafts | None = None,
                 prompt: PromptRows | None = None) -> None:
        self.step, self.requests, self.rows, self.sampled = step, requests, rows, sampled
        self._prompt = None if prompt is None else (prompt.meta, [
            _to_host(t) for t in (prompt.logprobs, prompt.top_ids, prompt.top_logprobs)
            if t is not None])
        # (token ids, [log-probs, top ids, top log-probs] as far as computed)
        self._host = None if sampled is None else (_to_host(sampled.token_ids), [
            _to_host(t) for t in (sampled.logprobs, sampled.top_ids, sampled.top_logprobs)
            if t is not None])
        self._drafts = None if drafts is None else (
            _to_host(drafts.accepted), _to_host(drafts.next), drafts.requests)
        self._routing = None if captured is None else {
            key: _to_host(torch.stack(per_layer, dim=1)) for key, per_layer in captured.items()}
        self._done: torch.cuda.Event | None = None
        if device.type == "cuda":
            self._done = torch.cuda.Event()
            self._done.record()
        self._result: StepResult | None = None

    def resolve(self) -> StepResult:
        """Wait for the host copies and split them per request (sync point: the step's tokens).
        The request-side effects (captured routing stored per request) happen once, on the first
        call."""
        if self._result is None:
            if self._done is not None:
                self._done.synchronize()
            self._result = self._split()
            if self._routing is not None:
                _store_routing(self.step, self._routing, self.kept())
        return self._result

    def kept(self) -> list[int]:
        """Per request of the step, its fed tokens whose KV is valid after the step: all of
        them, but under speculation only those before its first rejected draft."""
        assert self._result is not None
        emitted = {id(r): len(o.token_ids) for r, o in zip(self._result.requests,
                                                           self._result.outputs, strict=True)}
        return [n - k + emitted[id(r)] if id(r) in emitted else n
                for r, n, k in zip(self.step.requests, self.step.shape.lens,
                                   self.step.shape.num_logits, strict=True)]

    def _split(self) -> StepResult:
        prompt = self._split_prompt()
        if self._host is None:
            return StepResult([], [], prompt)
        token_ids: list[int] = self._host[0].tolist()
        logprobs: list[float] = []
        top: list[Any] = []           # [top ids, top log-probs] when log-probs were computed
        if self._host[1]:
            logprobs, *top = (t.tolist() for t in self._host[1])
        accepted: list[int] = [n - 1 for n in self.rows]
        nxt: dict[int, list[int]] = {}
        if self._drafts is not None:
            accepted = self._drafts[0].tolist()
            nxt = dict(zip(self._drafts[2], self._drafts[1].tolist(), strict=True))
        outputs, row = [], 0
        for i, (req, n) in enumerate(zip(self.requests, self.rows, strict=True)):
            k, m = req.params.logprobs or 0, accepted[i] + 1
            asked = req.params.logprobs is not None
            assert logprobs or not asked, "a request asked for log-probs the step did not compute"
            tops = [dict(zip(top[0][r][:k], top[1][r][:k], strict=True)) if top else {}
                    for r in range(row, row + m)]
            outputs.append(RequestTokens(token_ids[row:row + m],
                                         logprobs[row:row + m] if asked else [], tops,
                                         num_drafts=n - 1, next_drafts=nxt.get(i, [])))
            row += n
        return StepResult(self.requests, outputs, prompt)

    def _split_prompt(self) -> list[tuple[Request, int, float, dict[int, float]]]:
        if self._prompt is None:
            return []
        meta, (logprobs, *top) = self._prompt[0], (t.tolist() for t in self._prompt[1])
        out = []
        for r, (req, position) in enumerate(meta):
            k = req.params.prompt_logprobs or 0
            tops = dict(zip(top[0][r][:k], top[1][r][:k], strict=True)) if top else {}
            out.append((req, position, logprobs[r], tops))
        return out


def _store_routing(step: ScheduledStep, routing: dict[str, torch.Tensor], kept: list[int]) -> None:
    """Split the step's captured routing per request: experts [n, layers, k], indexer
    [n, csa_layers, k]; only the first `kept[i]` fed tokens of request i (rejected drafts'
    routing is dropped)."""
    lens = step.shape.lens
    for key, stacked in routing.items():                            # [T, layers, k] on the host
        for req, start, part, keep in zip(step.requests, step.shape.starts, stacked.split(lens),
                                          kept, strict=True):
            if req.is_finished:      # finished while the step ran (overlap): its token is dropped
                continue
            part = part[:keep]
            history = req.routing.setdefault(key, [])
            total = sum(t.shape[0] for t in history)
            # re-prefill after preemption: the recomputed routing replaces the old
            if start < total:
                req.routing[key] = history = [torch.cat(history)[:start]]
            history.append(part)
