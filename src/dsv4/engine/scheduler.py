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
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from dsv4.cache.req_table import RequestTable
from dsv4.config.engine import EngineConfig
from dsv4.engine.metadata import StepShape
from dsv4.engine.request import ReqStatus, Request
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)


@dataclass
class ScheduledStep:
    requests: list[Request]
    shape: StepShape
    input_ids: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


class Scheduler:
    def __init__(self, config: EngineConfig, table: RequestTable) -> None:
        self.config, self.table = config, table
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep | None:
        budget = self.config.chunked_prefill_size
        chosen: list[tuple[Request, int]] = []
        for req in self._by_decode_first():
            if req.status is not ReqStatus.RUNNING or budget == 0:
                continue
            n = min(req.num_pending, budget)
            if not self._reserve_or_preempt(req, n, chosen):
                continue
            chosen.append((req, n))
            budget -= n
        budget = self._admit(chosen, budget)
        if not chosen:
            return None
        return self._step(chosen)

    def _by_decode_first(self) -> list[Request]:
        return sorted(self.running, key=lambda r: r.num_pending > 1)

    def _reserve_or_preempt(self, req: Request, n: int, chosen: list[tuple[Request, int]]) -> bool:
        """Reserve pages for req's next n tokens, preempting later-admitted requests if needed."""
        assert req.slot is not None
        while not self.table.reserve(req.slot, req.num_cached, req.num_cached + n):
            victims = [r for r in reversed(self.running) if r is not req and all(r is not c for c, _ in chosen)]
            if not victims:
                self.preempt(req)
                return False
            self.preempt(victims[0])
        return True

    def _admit(self, chosen: list[tuple[Request, int]], budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running_requests:
            req = self.waiting[0]
            if self.table.num_free_slots == 0:
                break
            n = min(req.num_pending, budget)
            slot = self.table.open()
            if not self.table.reserve(slot, 0, n):
                self.table.free(slot)
                break
            self.waiting.popleft()
            req.slot, req.status = slot, ReqStatus.RUNNING
            self.running.append(req)
            chosen.append((req, n))
            budget -= n
        return budget

    def _step(self, chosen: list[tuple[Request, int]]) -> ScheduledStep:
        input_ids: list[int] = []
        slots, starts, lens, sample = [], [], [], []
        for req, n in chosen:
            assert req.slot is not None
            input_ids.extend(req.all_ids[req.num_cached:req.num_cached + n])
            slots.append(req.slot)
            starts.append(req.num_cached)
            lens.append(n)
            sample.append(req.num_cached + n == len(req.prompt_ids) + len(req.output_ids))
        return ScheduledStep([r for r, _ in chosen], StepShape(slots, starts, lens, sample), input_ids)

    def after_step(self, step: ScheduledStep) -> None:
        """Advance the cached length of every request in the step and release out-of-window SWA pages."""
        for req, n in zip(step.requests, step.shape.lens, strict=True):
            if req.status is not ReqStatus.RUNNING:
                continue
            req.num_cached += n
            assert req.slot is not None
            self.table.release_swa(req.slot, req.num_cached)

    def preempt(self, req: Request) -> None:
        self.num_preemptions += 1
        logger.debug("preempting %s (%d cached tokens)", req.rid, req.num_cached)
        self._release(req)
        req.status, req.num_cached = ReqStatus.WAITING, 0
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
            self.table.free(req.slot)
            req.slot = None
        if req in self.running:
            self.running.remove(req)
