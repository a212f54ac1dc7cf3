"""The engine process: loads the model, then runs the scheduler loop and streams per-request deltas
back.

Spawned by `launch.py` (multiprocessing "spawn" context) as `run_engine_process(config, paths)`; it
owns the only LLMEngine, so the model and the scheduler never share a GIL with HTTP handling. One
loop turn:

    drain the inbox (block up to IDLE_POLL_MS when idle)
        -> AddRequest / AbortRequests / StatsQuery / Shutdown; one RequestsAccepted (or a
           RequestError per refused request)
    engine.step() when there is work
        -> one StepOutputs message with the new tokens of every request the step advanced
           (token ids only: the API process detokenises and applies stop strings)
    on becoming idle
        -> engine.check_integrity() (a failure is fatal)

Lifecycle: EngineReady after the model loads. SIGINT/SIGTERM are ignored here — the API process owns
shutdown and sends ShutdownEngine (abort everything, exit 0). The process also exits when its parent
dies. Any exception (model load or step) is logged, reported as EngineFailed, and exits 1; the API
process watches this process's sentinel, so even a SIGKILL is noticed.

Tests: `tests/server/test_lifecycle.py`, `tests/server/test_disconnect.py` and
`tests/server/test_soak.py`.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import sys
import time

import torch
import zmq

from dsv4.config.server import ServerConfig
from dsv4.engine.engine import LLMEngine
from dsv4.engine.request import Request
from dsv4.model.loader import load_model
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
    ShutdownEngine,
    StatsQuery,
    StatsReply,
    StepOutputs,
    decode,
    encode,
    finite_logprob,
)
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)

IDLE_POLL_MS = 50
PARENT_CHECK_S = 1.0


def run_engine_process(config: ServerConfig, paths: IpcPaths) -> None:
    """Process entry point. Exits 0 after ShutdownEngine or parent death, 1 after any failure."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(paths.requests)
    outbox.connect(paths.outputs)
    code = 0
    try:
        EngineLoop(build_engine(config), inbox, outbox).run()
    except Exception as e:
        logger.exception("engine process failed")
        outbox.send(encode(EngineFailed(f"{type(e).__name__}: {e}")), flags=zmq.NOBLOCK)
        code = 1
    finally:
        inbox.close(linger=0)
        outbox.close(linger=1000)
        ctx.term()
    sys.exit(code)


def build_engine(config: ServerConfig) -> LLMEngine:
    if config.torch_threads is not None:
        torch.set_num_threads(config.torch_threads)
    model = load_model(config.model, dtype=config.dtype, device=config.device,
                       weight_format=config.weight_format)
    return LLMEngine(model, config.engine_config)


class EngineLoop:
    def __init__(self, engine: LLMEngine, inbox: zmq.Socket, outbox: zmq.Socket) -> None:
        self.engine, self.inbox, self.outbox = engine, inbox, outbox
        self._sent: dict[str, int] = {}      # request id -> output tokens sent to the API process
        self._accepted: list[str] = []
        self.num_finished = self.num_aborted = 0
        self._stopping = False
        self._checked_idle = True
        self._parent = multiprocessing.parent_process()
        self._parent_checked = time.monotonic()

    def run(self) -> None:
        eng = self.engine
        info = ModelInfo(context_length=eng.context_length, max_total_tokens=eng.max_total_tokens,
                         vocab_size=eng.vocab_size, eos_token_id=eng.eos_token_id)
        self._send(EngineReady(pid=_pid(), model=info))
        logger.info("engine ready: context %d tokens, KV cache %d tokens", info.context_length,
                    info.max_total_tokens)
        while not self._stopping:
            self._drain(timeout_ms=0 if eng.has_unfinished() else IDLE_POLL_MS)
            if eng.has_unfinished():
                self._step()
            elif not self._checked_idle:
                eng.check_integrity()
                self._checked_idle = True
            self._check_parent()

    # ---- inbox ----------------------------------------------------------------------------------
    def _drain(self, timeout_ms: int) -> None:
        if not self.inbox.poll(timeout_ms):
            return
        while not self._stopping:
            try:
                data = self.inbox.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            self._handle(decode(data))
        if self._accepted:
            self._send(RequestsAccepted(self._accepted))
            self._accepted = []

    def _handle(self, msg: Message) -> None:
        if isinstance(msg, AddRequest):
            self._add(msg)
        elif isinstance(msg, AbortRequests):
            for rid in msg.rids:
                self._abort(rid, msg.reason)
        elif isinstance(msg, StatsQuery):
            if msg.flush_cache:
                self.engine.flush_cache()
            self._send(StatsReply(msg.query_id, self.snapshot(msg.check_integrity)))
        elif isinstance(msg, ShutdownEngine):
            for rid in list(self._sent):
                self._abort(rid, "abort")
            self._stopping = True
        else:
            raise AssertionError(f"the engine cannot handle {type(msg).__name__}")

    def _add(self, msg: AddRequest) -> None:
        try:
            self.engine.add_request(msg.prompt_ids, msg.params, rid=msg.rid)
        except ValueError as e:
            self._send(RequestError(msg.rid, str(e)))
            return
        self._sent[msg.rid] = 0
        self._accepted.append(msg.rid)
        self._checked_idle = False

    def _abort(self, rid: str, reason: str) -> None:
        if self._sent.pop(rid, None) is None:
            return  # already finished (its final delta is on the way) or never admitted
        self.engine.finish(rid, reason)
        self.engine.pop(rid)
        if reason == "abort":
            self.num_aborted += 1
        else:
            self.num_finished += 1

    # ---- stepping -------------------------------------------------------------------------------
    def _step(self) -> None:
        updated = self.engine.step()
        deltas = [self._delta(req) for req in updated]
        finished = [req for req in updated if req.is_finished]
        for req in finished:
            self.engine.pop(req.rid)
            del self._sent[req.rid]
        self.num_finished += len(finished)
        self._send(StepOutputs(deltas, num_running=self.engine.num_running,
                               num_waiting=self.engine.num_waiting))

    def _delta(self, req: Request) -> RequestDelta:
        n = self._sent[req.rid]
        top = [[(t, finite_logprob(lp)) for t, lp in d.items()] for d in req.top_logprobs[n:]]
        self._sent[req.rid] = len(req.output_ids)
        return RequestDelta(rid=req.rid, token_ids=req.output_ids[n:],
                            logprobs=[finite_logprob(lp) for lp in req.logprobs[n:]],
                            top_logprobs=top, finish_reason=req.finish_reason,
                            num_prompt_tokens=len(req.prompt_ids), cached_tokens=req.cached_tokens)

    # ---- state ----------------------------------------------------------------------------------
    def snapshot(self, check_integrity: bool = False) -> EngineSnapshot:
        return EngineSnapshot(pid=_pid(), **dataclasses.asdict(self.engine.snapshot()),
                              num_finished=self.num_finished, num_aborted=self.num_aborted,
                              integrity=self._integrity() if check_integrity else None)

    def _integrity(self) -> str:
        try:
            self.engine.check_integrity()
        except AssertionError as e:
            return f"failed: {e}"
        return "ok"

    def _check_parent(self) -> None:
        now = time.monotonic()
        if self._parent is None or now - self._parent_checked < PARENT_CHECK_S:
            return
        self._parent_checked = now
        if not self._parent.is_alive():
            logger.warning("the API process is gone; engine exiting")
            self._stopping = True

    def _send(self, msg: Message) -> None:
        """Send, waiting while the API process is alive but slow (backpressure); drop it if the API
        is gone."""
        data = encode(msg)
        while True:
            try:
                self.outbox.send(data, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                if self._parent is not None and not self._parent.is_alive():
                    self._stopping = True
                    return
                self.outbox.poll(100, zmq.POLLOUT)


def _pid() -> int:
    return os.getpid()
