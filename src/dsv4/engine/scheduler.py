"""Scheduler: continuous batching with chunked prefill, page admission and recompute preemption.

Each step (FCFS):
  1. every running request that is decoding gets its one pending token;
  2. running requests still prefilling get a chunk, then waiting requests are admitted, while the
     step's token budget (`chunked_prefill_size`), the request limit and the free pages allow;
  3. when a running request cannot get the pages for its next token, the most recently admitted
     other running request is preempted (all its pages freed; it re-queues at the front and later
     re-prefills its prompt + output so far). Nothing ever crashes for lack of pages.
Pages are reserved here (`RequestTable.reserve`) before the step runs; the scheduler never looks
at device tensors.

In-batch prefix sharing: a waiting request whose first page equals that of a request prefilling
in the same step, not yet cached, waits one step (`_wait_for_shared_prefix`), so N copies of one
prompt arriving together compute it once.

Speculative decoding (`speculative_num_steps = N > 0`, engine/spec_decode.py): a decoding request
with drafts feeds its pending token and the drafts (1 + N tokens, all with logits) when the budget
and the pools allow them, else its pending token alone (the stale drafts are dropped). A request
that samples in the step also drafts for the next one when the pages for the draft chain's
positions (N - 1 past the step's last) can be had without preempting anyone. After the step a
request's cached length grows by the tokens it fed whose KV is valid: the fed tokens before its
logit rows, then one per emitted token (`after_step(step, emitted)`).

Overlap scheduling (`overlap_schedule`, engine/engine.py): a step may be scheduled while the
step before it still runs. A request that sampled in that step has its token in flight
(`Request.num_inflight`): it is pending like any other token, and the step feeds it as a
placeholder listed in `ScheduledStep.ahead`, which the runner fills on the device from the step
before's sampled tokens. A request whose in-flight tokens reach its max_tokens is not scheduled
again (every step yields at least one token per request in it, so that step ends it, whatever it
samples: a row for it in the next step would be computed and dropped). A preempted request whose
token is still in flight is not re-admitted before the token is on the host (its re-prefill
feeds that token).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from dsv4.cache.prefix_cache import PrefixCache
from dsv4.cache.req_table import RequestTable
from dsv4.config.engine import EngineConfig
from dsv4.engine.metadata import StepShape
from dsv4.engine.request import ReqStatus, Request
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)

PLACEHOLDER_ID = 0
"""The host's stand-in for a fed token still on the device (overwritten before the forward)."""


@dataclass
class ScheduledStep:
    requests: list[Request]
    shape: StepShape
    input_ids: list[int]
    admitted: list[bool]        # per request: it got its request slot in this step (an admission)
    # per request: it drafts the next step's tokens at the end of this one (speculative decoding)
    drafting: list[bool] = field(default_factory=list)
    # overlap scheduling: (index into input_ids, request) of each fed token still on the device;
    # the engine sets `source` to the step before's sampled tokens and `source_rows` to each
    # such request's row there (the runner gathers them into the inputs on the device)
    ahead: list[tuple[int, Request]] = field(default_factory=list)
    source: torch.Tensor | None = None
    source_rows: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


class Scheduler:
    def __init__(self, config: EngineConfig, table: RequestTable, cache: PrefixCache) -> None:
        self.config, self.table, self.cache = config, table, cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prompt_tokens = 0          # prompt tokens admitted (first admission of each request)
        self.cached_prompt_tokens = 0   # of which served from the prefix cache

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep | None:
        budget = self.config.chunked_prefill_size
        chosen: list[tuple[Request, int]] = []
        for req in self._by_decode_first():
            if req.status is not ReqStatus.RUNNING or budget == 0 or _ends_in_flight(req):
                continue
            n = self._with_drafts(req, budget)
            if not self._reserve_or_preempt(req, n, chosen):
                continue
            chosen.append((req, n))
            budget -= n
        num_running = len(chosen)
        budget = self._admit(chosen, budget)
        if not chosen:
            return None
        return self._step(chosen, num_running)

    def _with_drafts(self, req: Request, budget: int) -> int:
        """Tokens `req` feeds this step: its pending token and its drafts when they fit the budget
        and the pools (no preemption for drafts), else what plain scheduling gives (the drafts are
        dropped: they were made for the positions after its pending token)."""
        assert req.slot is not None
        drafts = req.draft_ids
        n = 1 + len(drafts)
        if (drafts and req.num_pending == 1 and n <= budget
                and self.table.reserve(req.slot, req.num_cached, req.num_cached + n)):
            return n
        req.draft_ids = []
        return min(req.num_pending, budget)

    def _drafts_next(self, req: Request, n: int) -> bool:
        """Whether `req`, feeding n tokens now, drafts at the end of the step: it samples, and the
        draft chain's positions (up to N - 1 past the step's last) fit its page table and get
        their pages without preempting anyone."""
        assert req.slot is not None
        N = self.config.speculative_num_steps
        end = req.num_cached + n
        if N == 0 or end < len(req.all_ids):
            return False
        last = end + N - 1
        return (last <= self.table.max_pages * self.table.P
                and self.table.reserve(req.slot, end, last))

    def _by_decode_first(self) -> list[Request]:
        return sorted(self.running, key=lambda r: r.num_pending > 1)

    def _reserve_or_preempt(self, req: Request, n: int, chosen: list[tuple[Request, int]]) -> bool:
        """Reserve pages for req's next n tokens, preempting later-admitted requests if needed."""
        assert req.slot is not None
        while not self.table.reserve(req.slot, req.num_cached, req.num_cached + n):
            victims = [r for r in reversed(self.running)
                       if r is not req and all(r is not c for c, _ in chosen)]
            if not victims:
                self.preempt(req)
                return False
            self.preempt(victims[0])
        return True

    def _admit(self, chosen: list[tuple[Request, int]], budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running_requests:
            req = self.waiting[0]
            if (self.table.num_free_slots == 0 or req.num_inflight
                    or self._wait_for_shared_prefix(req, chosen)):
                break
            slot = self._open(req)
            n = min(req.num_pending, budget)
            if not self.table.reserve(slot, req.num_cached, req.num_cached + n):
                self._close(req, slot)
                break
            self.waiting.popleft()
            self._count_admission(req)
            req.slot, req.status = slot, ReqStatus.RUNNING
            self.running.append(req)
            chosen.append((req, n))
            budget -= n
        return budget

    def _wait_for_shared_prefix(self, req: Request, chosen: list[tuple[Request, int]]) -> bool:
        """In-batch prefix sharing: `req` waits a step when a request prefilling in this step
        starts with the same first page and that page is not cached yet (after the step it is,
        and `req` matches it instead of computing it again). FCFS: admission stops here."""
        P = self.config.page_size
        if not self.cache.enabled or len(req.all_ids) <= P:
            return False
        head = req.all_ids[:P]
        if not any(c.num_cached < P and c.all_ids[:P] == head for c, _ in chosen):
            return False
        return self.cache.match(req.all_ids).length < P

    def _open(self, req: Request) -> int:
        """A request slot for `req`, starting after its longest SWA-safe cached prefix (locked);
        a request still owing its prompt log-probs computes its whole prompt."""
        match = self.cache.match(req.all_ids[:1] if req.wants_prompt_logprobs else req.all_ids)
        req.cache_lock = self.cache.lock(match.node, match.length)
        req.num_cached = match.length
        return self.table.open(match.pages)

    def _close(self, req: Request, slot: int) -> None:
        """Undo `_open` for a request that could not be admitted after all."""
        self.table.free(slot)
        if req.cache_lock is not None:
            self.cache.unlock(req.cache_lock)
        req.cache_lock, req.num_cached = None, 0

    def _count_admission(self, req: Request) -> None:
        cached = min(req.num_cached, len(req.prompt_ids))
        # first admission (re-admissions after preemption are not prompts)
        if not req.output_ids:
            req.cached_tokens = cached
            self.prompt_tokens += len(req.prompt_ids)
            self.cached_prompt_tokens += cached

    def _cache_insert(self, req: Request) -> None:
        """Hand the request's complete pages to the prefix cache and move its lock to the new path
        end."""
        assert req.slot is not None
        # (after a verify step the cached length runs ahead of the tokens until the emitted
        # tokens are appended; such steps insert nothing: `_update_cache`)
        assert req.num_cached <= len(req.all_ids), "cached positions without their tokens"
        pages = req.num_cached // self.table.P
        if pages == 0:
            return
        finished = req.status is not ReqStatus.RUNNING
        # where a repeat of this prompt would match: its last full page before the last token
        repeat = (len(req.prompt_ids) - 1) // self.table.P
        node = self.cache.insert(req.all_ids[:pages * self.table.P],
                                 self.table.full_pages[req.slot][:pages], finished,
                                 anchor=repeat if repeat <= pages else None)
        lock = self.cache.lock(node, pages * self.table.P)
        if req.cache_lock is not None:
            self.cache.unlock(req.cache_lock)
        req.cache_lock = lock

    def _step(self, chosen: list[tuple[Request, int]], num_running: int) -> ScheduledStep:
        """The step of `chosen` (request, new tokens); from index `num_running` on: admitted now."""
        input_ids: list[int] = []
        slots, starts, lens, num_logits, drafting = [], [], [], [], []
        ahead: list[tuple[int, Request]] = []
        for req, n in chosen:
            assert req.slot is not None
            input_ids.extend(req.all_ids[req.num_cached:req.num_cached + n])
            if req.num_cached + n - len(req.draft_ids) > len(req.all_ids):   # (still on the device)
                assert req.num_inflight == 1 and n == 1 and not req.draft_ids, \
                    "only a decoding request's one pending token can be in flight"
                ahead.append((len(input_ids), req))
                input_ids.append(PLACEHOLDER_ID)
            input_ids.extend(req.draft_ids)          # [] unless it feeds drafts
            slots.append(req.slot)
            starts.append(req.num_cached)
            lens.append(n)
            # the last token samples; with drafts, or owing prompt log-probs, every fed token has
            # logits
            samples = req.num_cached + n >= len(req.all_ids) + req.num_inflight
            num_logits.append(n if req.wants_prompt_logprobs else
                              (1 + len(req.draft_ids)) if samples else 0)
            drafting.append(self._drafts_next(req, n))
        return ScheduledStep([r for r, _ in chosen], StepShape(slots, starts, lens, num_logits),
                             input_ids, [i >= num_running for i in range(len(chosen))], drafting,
                             ahead)

    def after_step(self, step: ScheduledStep, kept: list[int] | None = None) -> None:
        """Advance the cached length of every request in the step and release out-of-window SWA
        pages. `kept` (speculative decoding, `StepOutput.kept`): per request, its fed tokens
        whose KV is valid (those before its first rejected draft); None: all it fed."""
        shape = step.shape
        for req, n, fed, k in zip(step.requests, kept or shape.lens, shape.lens, shape.num_logits,
                                  strict=True):
            if req.status is not ReqStatus.RUNNING:
                continue
            before = req.num_cached
            req.num_cached += n
            assert req.slot is not None
            self._update_cache(req, before, prefill=k < fed)
            self.table.release_swa(req.slot, req.num_cached)

    def _update_cache(self, req: Request, before: int, prefill: bool) -> None:
        """Insert completed prefill pages (a prefill chunk only: decode and verify steps leave the
        insertion to the request's end, so their host work stays O(batch)); drop the SWA lock
        once the request is a horizon past its path."""
        P = self.table.P
        if prefill and req.num_cached - before > 1 and req.num_cached // P > before // P:
            self._cache_insert(req)
        lock = req.cache_lock
        if (lock is not None and lock.swa_held
                and req.num_cached - lock.length >= self.cache.horizon):
            self.cache.release_swa(lock)

    def preempt(self, req: Request) -> None:
        self.num_preemptions += 1
        logger.debug("preempting %s (%d cached tokens)", req.rid, req.num_cached)
        self._release(req)
        req.status, req.num_cached, req.draft_ids = ReqStatus.WAITING, 0, []
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        """Mark finished (stop / length / abort) and return every page it held."""
        if req.status is ReqStatus.WAITING:
            self.waiting.remove(req)
        elif req.status is ReqStatus.RUNNING:
            self._release(req)
        req.status, req.finish_reason = ReqStatus.FINISHED, reason

    def _release(self, req: Request) -> None:
        if req.slot is not None:
            # the pages stop being written: tombstone recovery allowed
            req.status = ReqStatus.FINISHED
            self._cache_insert(req)
            # private pages first: the lock still pins the shared ones
            self.table.free(req.slot)
            if req.cache_lock is not None:
                self.cache.unlock(req.cache_lock)
            req.cache_lock = None
            req.slot = None
        if req in self.running:
            self.running.remove(req)


def _ends_in_flight(req: Request) -> bool:
    """Whether the steps `req` is in flight in surely finish it by length: each yields at least
    one token for it, and its output then reaches max_tokens (module docstring, overlap)."""
    return req.num_inflight > 0 and len(req.output_ids) + req.num_inflight >= req.params.max_tokens
