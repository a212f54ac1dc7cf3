"""`DataParallelEngine`: rank 0's surface of data-parallel attention (`engine/parallel.py`'s
module docstring: request assignment by `RankSpec.load_balance_method` (`engine/dp_router.py`),
one forward per rank per step, mirrors of remote requests updated from each step's
`RequestDelta`s)."""

from __future__ import annotations

import dataclasses
import itertools
import random
import time
from typing import Any

import torch.distributed as dist

from dsv4.engine.dp_router import PrefixRouter, shortest_queue
from dsv4.engine.engine import FINISH_REASONS
from dsv4.engine.parallel import DEATH_GRACE_S, ParallelEngine
from dsv4.engine.parallel_ranks import RankSpec, compile_grammar
from dsv4.engine.request import ReqStatus, Request
from dsv4.engine.sampling_params import SamplingParams


class DataParallelEngine(ParallelEngine):
    """Data-parallel attention over `spec.world` ranks (module docstring): rank 0 assigns each
    request to one rank, every step runs on all, and remote requests are mirrored on rank 0."""

    def __init__(self, spec: RankSpec) -> None:
        assert spec.data_parallel, "DataParallelEngine needs RankSpec.data_parallel"
        super().__init__(spec)
        self._owner: dict[str, int] = {}             # request id -> its rank
        self._mirrors: dict[str, Request] = {}       # rank 0's copies of remote requests
        # ids and seeds drawn as `LLMEngine.add_request` draws them in one process
        self._ids = itertools.count()
        self._seeds = random.Random(spec.config.seed)
        layout = self.engine.runner.layout          # every rank's pools: the same config
        self.router = (PrefixRouter(spec.world, layout.page_size, layout.num_full_pages)
                       if spec.load_balance_method == "cache_aware" else None)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished() or any(not r.is_finished
                                                   for r in self._mirrors.values())

    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    rid: str | None = None) -> Request:
        self.validate(prompt_ids, params)
        compile_grammar(self.engine, params)     # a spec no rank can compile fails here, not there
        rid = rid if rid is not None else str(next(self._ids))
        if rid in self._owner:
            raise ValueError(f"request_id={rid!r} is already in use")
        seed = params.seed if params.seed is not None else self._seeds.randrange(2**62)
        params = dataclasses.replace(params, seed=seed)
        load = self._loads()
        rank = (self.router.pick(prompt_ids, load) if self.router is not None
                else shortest_queue(load))
        self._owner[rid] = rank
        if rank == 0:
            return self.engine.add_request(prompt_ids, params, rid)
        req = self._mirrors[rid] = Request(rid=rid, prompt_ids=list(prompt_ids), params=params,
                                           seed=seed)
        self._pending.append(("at", rank, ("add", list(prompt_ids), params, rid, seed)))
        return req

    def _loads(self) -> list[int]:
        """Each rank's unfinished requests."""
        load = [0] * self.spec.world
        for rid, rank in self._owner.items():
            req = self._mirrors[rid] if rank else self.engine.requests[rid]
            load[rank] += not req.is_finished
        return load

    def finish(self, rid: str, reason: str = "abort") -> None:
        rank = self._owner.get(rid, 0)
        if rank == 0:
            self.engine.finish(rid, reason)
            return
        if reason not in FINISH_REASONS:
            raise ValueError(f"reason={reason!r} is invalid; allowed: {list(FINISH_REASONS)}")
        req = self._mirrors[rid]
        if not req.is_finished:
            req.status, req.finish_reason = ReqStatus.FINISHED, reason
        self._pending.append(("at", rank, ("finish", rid, reason)))

    def abort(self, rid: str) -> None:
        self.finish(rid, "abort")

    def pop(self, rid: str) -> Request:
        rank = self._owner.pop(rid)
        if rank == 0:
            return self.engine.pop(rid)
        self._pending.append(("at", rank, ("pop", rid)))
        return self._mirrors.pop(rid)

    def step(self) -> list[Request]:
        """One step on every rank; returns the requests that got tokens (rank 0's, then the other
        ranks' mirrors in rank order)."""
        self._flush_pending(("dp_step",))
        try:
            updated = self.engine.step_or_idle()
            return updated + self._receive()
        except RuntimeError as e:       # a rank that died inside the step's collectives
            for w in self.workers:
                w.join(timeout=DEATH_GRACE_S)
            self._raise_if_dead(e)
            raise

    def _receive(self) -> list[Request]:
        """The other ranks' `RequestDelta`s of this step (`Outbox.send`), applied to the
        mirrors."""
        box: list[Any] = [None] * self.spec.world
        dist.gather_object([], box, dst=0, group=self.control)
        now = time.perf_counter()
        return [d.apply_to(self._mirrors[d.rid], now) for deltas in box[1:] for d in deltas]
