"""EngineClient: the API process's end of the IPC with the engine process.

Owns the two ZMQ sockets (bound here; the engine connects), the routing table engine-request id ->
(the HTTP job's queue, choice index, timing, output text), the readiness state and the engine's
liveness. One reader task receives every engine message and dispatches it: `Accepted`,
`ChoiceDelta`, `RequestError` or `EngineGone` items go into the job's asyncio.Queue as
`(index, item)`; stats and weight-update replies resolve futures.

Text. The engine sends token ids; each route detokenises its request's tokens incrementally and
applies its stop strings (engine/stop.py::OutputText, the object the offline `LLM` uses too). A stop
string ends the choice at the token that completed it (later tokens of the delta are dropped) with
finish_reason "stop", and the engine is told to finish the request (`AbortRequests(reason="stop")`).

Invariants: a rid is in `_routes` from `submit` until its final delta, its error, its abort or the
engine's death — whichever comes first — and afterwards nothing more is queued for it. Every send is
non-blocking (the engine drains its inbox every step); a send that cannot go out means the engine is
gone. When the engine process dies (the sentinel fd becomes readable), every open route gets
`EngineGone`, `/health` turns 503, and `on_failure` (set by launch.py) stops the server with exit 1.

Test: `pytest tests/server` (every test goes through it).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
from tokenizers import Tokenizer

from dsv4.engine.sampling_params import SamplingParams
from dsv4.engine.stop import OutputText
from dsv4.server.errors import APIError, bad_request, unavailable
from dsv4.server.ipc import (
    AbortRequests,
    AddRequest,
    EngineFailed,
    EngineReady,
    EngineSnapshot,
    IpcPaths,
    Message,
    ModelInfo,
    RequestDelta,
    RequestError,
    RequestsAccepted,
    RoutingRows,
    ShutdownEngine,
    StatsQuery,
    StatsReply,
    StepOutputs,
    UpdateWeights,
    UpdateWeightsReply,
    decode_frames,
    encode_frames,
)
from dsv4.server.metrics import RequestTiming, ServerMetrics
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True)
class Accepted:
    """The engine admitted the request to its queue (it passed LLMEngine.validate)."""


@dataclass(frozen=True)
class EngineGone:
    message: str


@dataclass(frozen=True)
class ChoiceDelta:
    """What one choice produced since its previous delta, as the client sees it: the tokens it
    keeps, the new text that may be shown (stop strings excluded), on its last delta why it
    finished, and the routing rows the engine sent (by kind; they may run past the kept tokens:
    the response cuts them). `spec_draft_tokens` / `spec_accepted_tokens`: the request's drafts
    verified and accepted so far (speculative decoding; totals, as the engine counts them)."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    text: str
    finish_reason: str | None
    num_prompt_tokens: int
    cached_tokens: int
    routing: dict[str, RoutingRows] = field(default_factory=dict)
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # SamplingParams.prompt_logprobs: the prompt's log-probs (None for its first token) and
    # top-k, on the request's first delta with tokens
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    # the stop string that ended the choice (finish_reason "stop" by a string), else None
    stop_matched: str | None = None
    # the label of the weights that produced these tokens (StepOutputs.weight_version)
    weight_version: str | None = None


Item = Accepted | ChoiceDelta | RequestError | EngineGone
JobQueue = asyncio.Queue[tuple[int, Item]]


@dataclass
class _Route:
    queue: JobQueue
    index: int
    timing: RequestTiming
    text: OutputText
    num_chars: int = 0          # characters of text already queued


class EngineClient:
    def __init__(self, paths: IpcPaths, metrics: ServerMetrics, max_inflight: int,
                 tokenizer: Tokenizer) -> None:
        self.metrics, self.max_inflight, self.tokenizer = metrics, max_inflight, tokenizer
        self._sync_ctx, self._async_ctx = zmq.Context(), zmq.asyncio.Context()
        self._push = self._sync_ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)            # unbounded: the engine drains every step
        self._push.bind(paths.requests)
        self._pull = self._async_ctx.socket(zmq.PULL)
        self._pull.bind(paths.outputs)
        self._routes: dict[str, _Route] = {}
        self._queries: dict[int, asyncio.Future[EngineSnapshot]] = {}
        self._updates: dict[int, asyncio.Future[UpdateWeightsReply]] = {}
        self._query_ids = itertools.count()
        self.model: ModelInfo | None = None
        self.engine_pid: int | None = None
        self.failure: str | None = None
        self.draining = False
        self.stopping = False             # ShutdownEngine sent: the engine's exit is expected
        self.on_failure: Callable[[], None] | None = None
        self.on_ready: Callable[[], None] | None = None

    # ---- state --------------------------------------------------------------------------------
    @property
    def is_ready(self) -> bool:
        return self.model is not None and self.failure is None

    @property
    def num_inflight(self) -> int:
        return len(self._routes)

    def check_available(self, num_new: int) -> None:
        """Raise 503 unless `num_new` more engine requests may be admitted now."""
        if self.failure is not None:
            raise unavailable(f"the engine process failed: {self.failure}", "engine_failed")
        if self.draining:
            raise unavailable("the server is shutting down", "shutting_down")
        if self.model is None:
            raise unavailable("the model is still loading; retry when GET /health answers 200",
                              "loading")
        if num_new > self.max_inflight:
            raise bad_request(f"n x prompts = {num_new} engine requests can never be admitted; "
                              f"allowed: at most {self.max_inflight} "
                              "(max_running_requests + max_waiting_requests)", "n")
        if len(self._routes) + num_new > self.max_inflight:
            raise unavailable(f"the waiting queue is full ({len(self._routes)} requests in flight, "
                              f"limit {self.max_inflight} = max_running_requests + "
                              "max_waiting_requests); retry later", "queue_full")

    # ---- requests -----------------------------------------------------------------------------
    def submit(self, requests: list[tuple[str, list[int], SamplingParams]], queue: JobQueue,
               routing: list[str] | None = None) -> None:
        """Send engine requests `(rid, prompt_ids, params)`; their items arrive in `queue` as
        `(index, item)`. `routing`: the routing kinds their deltas carry (none by default)."""
        self.check_available(len(requests))
        now = time.monotonic()
        for index, (rid, _, params) in enumerate(requests):
            assert rid not in self._routes, f"request id {rid} is already in flight"
            self._routes[rid] = _Route(queue, index, RequestTiming(sent=now),
                                       OutputText(self.tokenizer, params))
        try:
            for rid, prompt_ids, params in requests:
                self._send(AddRequest(rid, prompt_ids, params, list(routing or [])))
        except APIError:
            self.abort([rid for rid, _, _ in requests])
            raise

    def abort(self, rids: list[str]) -> None:
        """Forget `rids` here and abort them in the engine (its pages are freed); unknown rids are
        ignored."""
        live = [rid for rid in rids if self._routes.pop(rid, None) is not None]
        if live and self.failure is None:
            self._send(AbortRequests(live), quiet=True)

    async def query_stats(self, check_integrity: bool = False, flush_cache: bool = False,
                          timeout: float = 10.0) -> EngineSnapshot:
        if not self.is_ready:
            raise unavailable("the engine is not ready", "engine_not_ready")
        query_id = next(self._query_ids)
        future: asyncio.Future[EngineSnapshot] = asyncio.get_running_loop().create_future()
        self._queries[query_id] = future
        try:
            self._send(StatsQuery(query_id, check_integrity, flush_cache))
            return await asyncio.wait_for(future, timeout)
        except TimeoutError as e:
            raise unavailable(f"the engine did not answer a stats query within {timeout} s",
                              "timeout") from e
        finally:
            self._queries.pop(query_id, None)

    async def update_weights(self, model_path: str, weight_version: str | None = None
                             ) -> UpdateWeightsReply:
        """Have the engine load the checkpoint directory `model_path` between two steps (its
        tokens labelled `weight_version`); 400 (the served weights unchanged) when it refuses it.
        Waits as long as the load takes."""
        return await self.weights_call(lambda q: UpdateWeights(q, model_path, weight_version),
                                       "model_path")

    async def weights_call(self, make: Callable[[int], Message], param: str
                           ) -> UpdateWeightsReply:
        """Send `make(query_id)` (a message the engine answers with an UpdateWeightsReply) and
        wait, as long as the engine takes, for the reply; 400 naming `param` when it refuses."""
        if not self.is_ready:
            raise unavailable("the engine is not ready", "engine_not_ready")
        query_id = next(self._query_ids)
        future: asyncio.Future[UpdateWeightsReply] = asyncio.get_running_loop().create_future()
        self._updates[query_id] = future
        try:
            self._send(make(query_id))
            reply = await future
        finally:
            self._updates.pop(query_id, None)
        if not reply.success:
            raise bad_request(reply.message, param)
        return reply

    def _send(self, msg: Message, quiet: bool = False) -> None:
        try:
            self._push.send_multipart(encode_frames(msg), flags=zmq.NOBLOCK)
        except zmq.Again as e:
            if not quiet:
                raise unavailable("the engine process is not reachable",
                                  "engine_unreachable") from e

    # ---- reader -------------------------------------------------------------------------------
    async def run_reader(self) -> None:
        """Receive and dispatch engine messages until cancelled."""
        while True:
            frames = await self._pull.recv_multipart()
            self._dispatch(decode_frames(frames))

    def _dispatch(self, msg: Message) -> None:
        if isinstance(msg, StepOutputs):
            now = time.monotonic()
            for delta in msg.deltas:
                self._on_delta(delta, now, msg.weight_version)
        elif isinstance(msg, RequestsAccepted):
            for rid in msg.rids:
                if (route := self._routes.get(rid)) is not None:
                    route.queue.put_nowait((route.index, Accepted()))
        elif isinstance(msg, RequestError):
            if (route := self._routes.pop(msg.rid, None)) is not None:
                route.queue.put_nowait((route.index, msg))
        elif isinstance(msg, StatsReply):
            future = self._queries.get(msg.query_id)
            if future is not None and not future.done():
                future.set_result(msg.stats)
        elif isinstance(msg, UpdateWeightsReply):
            update = self._updates.get(msg.query_id)
            if update is not None and not update.done():
                update.set_result(msg)
        elif isinstance(msg, EngineReady):
            self.model, self.engine_pid = msg.model, msg.pid
            logger.info("engine ready (pid %d)", msg.pid)
            if self.on_ready is not None:
                self.on_ready()
        elif isinstance(msg, EngineFailed):
            logger.error("engine reported a failure: %s", msg.message)
            self.failure = self.failure or msg.message
        else:
            raise AssertionError(f"the API cannot handle {type(msg).__name__}")

    def _on_delta(self, delta: RequestDelta, now: float, version: str) -> None:
        route = self._routes.get(delta.rid)
        if route is None:
            return  # aborted (or stopped) here while the delta was on its way
        out = self._with_text(route, delta, version)
        self.metrics.on_delta(route.timing, out, now)
        if out.finish_reason is not None:
            del self._routes[delta.rid]
            if delta.finish_reason is None:          # a stop string: the engine is still generating
                self._send(AbortRequests([delta.rid], reason="stop"), quiet=True)
        route.queue.put_nowait((route.index, out))

    @staticmethod
    def _with_text(route: _Route, delta: RequestDelta, version: str) -> ChoiceDelta:
        """Detokenise the delta's tokens and apply the stop strings: the tokens kept, the new text,
        the reason; `version` labels the weights that produced them."""
        keep = route.text.feed(delta.token_ids)
        reason = "stop" if route.text.stopped else delta.finish_reason
        if reason is not None and not route.text.stopped:
            route.text.finish()
        text = route.text.text[route.num_chars:]
        route.num_chars = len(route.text.text)
        return ChoiceDelta(delta.token_ids[:keep], delta.logprobs[:keep], delta.top_logprobs[:keep],
                           text, reason, delta.num_prompt_tokens, delta.cached_tokens,
                           delta.routing, delta.spec_draft_tokens, delta.spec_accepted_tokens,
                           delta.prompt_logprobs, delta.prompt_top_logprobs, route.text.matched,
                           version)

    # ---- liveness -----------------------------------------------------------------------------
    def engine_exited(self, exitcode: int | None) -> None:
        """The engine process is gone: fail every open request and every query, then call
        `on_failure`."""
        message = self.failure or f"the engine process exited unexpectedly (exit code {exitcode})"
        self.failure = message
        logger.error("%s; failing %d in-flight requests", message, len(self._routes))
        for route in self._routes.values():
            route.queue.put_nowait((route.index, EngineGone(message)))
        self._routes.clear()
        _fail(self._queries.values(), message)
        _fail(self._updates.values(), message)
        if self.on_failure is not None:
            self.on_failure()

    def shutdown(self) -> None:
        """Abort whatever is still in flight and tell the engine to exit (after uvicorn's graceful
        drain)."""
        self.draining = self.stopping = True
        if self._routes:
            logger.info("aborting %d requests still in flight", len(self._routes))
            for route in self._routes.values():
                route.queue.put_nowait((route.index, EngineGone("the server is shutting down")))
            self.abort(list(self._routes))
        if self.failure is None:
            self._send(ShutdownEngine(), quiet=True)

    def close(self) -> None:
        self._push.close(linger=500)
        self._pull.close(linger=0)
        self._sync_ctx.term()
        self._async_ctx.term()


def _fail(futures: Iterable[asyncio.Future[Any]], message: str) -> None:
    for future in futures:
        if not future.done():
            future.set_exception(unavailable(message, "engine_failed"))


def raise_if_error(item: Item) -> None:
    """Turn a RequestError (the engine's ValueError) into 400 and EngineGone into 503."""
    if isinstance(item, RequestError):
        raise bad_request(item.message)
    if isinstance(item, EngineGone):
        raise APIError(503, item.message, code="engine_failed")
