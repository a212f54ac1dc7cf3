"""The engine process: loads the model, then runs the scheduler loop and streams per-request deltas back.

Spawned by `launch.py` (multiprocessing "spawn" context) as `run_engine_process(config, paths)`; it owns
the only LLMEngine, so the model and the scheduler never share a GIL with HTTP handling. One loop turn:

    drain the inbox (block up to IDLE_POLL_MS when idle) -> AddRequest / AbortRequests / StatsQuery / Shutdown;
                                                    one RequestsAccepted (or a RequestError per refused request)
    engine.step() when there is work             -> one StepOutputs message with every request's delta
    on becoming idle                             -> engine.check_integrity() (a failure is fatal)

Lifecycle: EngineReady after the model loads. SIGINT/SIGTERM are ignored here — the API process owns
shutdown and sends ShutdownEngine (abort everything, exit 0). The process also exits when its parent
dies. Any exception (model load or step) is logged, reported as EngineFailed, and exits 1; the API
process watches this process's sentinel, so even a SIGKILL is noticed.

Test: `pytest tests/server/test_lifecycle.py tests/server/test_disconnect.py tests/server/test_soak.py`.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import zmq
from tokenizers import Tokenizer

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
    model = load_model(config.model, dtype=config.dtype, device=config.device, weight_format=config.weight_format)
    tokenizer = Tokenizer.from_file(str(Path(config.model) / "tokenizer.json"))
    return LLMEngine(model, config.engine_config, tokenizer)


@dataclass
class _Progress:
    """How much of a request's output has been sent to the API process."""

    num_tokens: int = 0
    num_chars: int = 0


class EngineLoop:
    def __init__(self, engine: LLMEngine, inbox: zmq.Socket, outbox: zmq.Socket) -> None:
        self.engine, self.inbox, self.outbox = engine, inbox, outbox
        self._sent: dict[str, _Progress] = {}
        self._accepted: list[str] = []
        self.num_finished = self.num_aborted = 0
        self._stopping = False
        self._checked_idle = True
        self._parent = multiprocessing.parent_process()
        self._parent_checked = time.monotonic()

    def run(self) -> None:
        eng = self.engine
        info = ModelInfo(context_length=eng.context_length, max_total_tokens=eng.runner.layout.max_total_tokens,
                         vocab_size=eng.vocab_size, eos_token_id=eng.eos_token_id)
        self._send(EngineReady(pid=_pid(), model=info))
        logger.info("engine ready: context %d tokens, KV cache %d tokens", info.context_length, info.max_total_tokens)
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
                self._abort(rid)
        elif isinstance(msg, StatsQuery):
            if msg.flush_cache:
                self.engine.flush_cache()
            self._send(StatsReply(msg.query_id, self.snapshot(msg.check_integrity)))
        elif isinstance(msg, ShutdownEngine):
            for rid in list(self._sent):
                self._abort(rid)
            self._stopping = True
        else:
            raise AssertionError(f"the engine cannot handle {type(msg).__name__}")

    def _add(self, msg: AddRequest) -> None:
        try:
            self.engine.add_request(msg.prompt_ids, msg.params, rid=msg.rid)
        except ValueError as e:
            self._send(RequestError(msg.rid, str(e)))
            return
        self._sent[msg.rid] = _Progress()
        self._accepted.append(msg.rid)
        self._checked_idle = False

    def _abort(self, rid: str) -> None:
        if self._sent.pop(rid, None) is None:
            return  # already finished (its final delta is on the way) or never admitted
        self.engine.abort(rid)
        self.engine.pop(rid)
        self.num_aborted += 1

    # ---- stepping -------------------------------------------------------------------------------
    def _step(self) -> None:
        finished = self.engine.step()
        sched = self.engine.scheduler
        deltas = [d for req in [*sched.running, *finished] if (d := self._delta(req)) is not None]
        for req in finished:
            self.engine.pop(req.rid)
            del self._sent[req.rid]
        self.num_finished += len(finished)
        self._send(StepOutputs(deltas, num_running=len(sched.running), num_waiting=len(sched.waiting)))

    def _delta(self, req: Request) -> RequestDelta | None:
        sent = self._sent[req.rid]
        n, c = sent.num_tokens, sent.num_chars
        if len(req.output_ids) == n and not req.is_finished:
            return None
        assert len(req.text) >= c, f"request {req.rid}: streamed text shrank ({len(req.text)} < {c} chars)"
        top = [[(t, finite_logprob(lp)) for t, lp in d.items()] for d in req.top_logprobs[n:]]
        delta = RequestDelta(rid=req.rid, token_ids=req.output_ids[n:],
                             logprobs=[finite_logprob(lp) for lp in req.logprobs[n:]], top_logprobs=top,
                             text=req.text[c:], finish_reason=req.finish_reason,
                             num_prompt_tokens=len(req.prompt_ids), cached_tokens=req.cached_tokens)
        sent.num_tokens, sent.num_chars = len(req.output_ids), len(req.text)
        return delta

    # ---- state ----------------------------------------------------------------------------------
    def snapshot(self, check_integrity: bool = False) -> EngineSnapshot:
        eng, table = self.engine, self.engine.runner.table
        shared: set[int] = getattr(table, "shared", set())   # pages held by the prefix cache, when there is one
        return EngineSnapshot(
            pid=_pid(), num_running=len(eng.scheduler.running), num_waiting=len(eng.scheduler.waiting),
            num_requests=len(eng.requests), full_free=table.full.num_free, full_usable=table.full.num_usable,
            full_cached=len(shared), swa_free=table.swa.num_free, swa_usable=table.swa.num_usable,
            swa_cached=sum(1 for p in shared if p in table.swa_of), free_slots=table.num_free_slots,
            num_slots=eng.config.max_running_requests, steps=eng.stats.steps,
            prefill_tokens=eng.stats.prefill_tokens, decode_tokens=eng.stats.decode_tokens,
            num_finished=self.num_finished, num_aborted=self.num_aborted,
            num_preemptions=eng.scheduler.num_preemptions,
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
        """Send, waiting while the API process is alive but slow (backpressure); drop it if the API is gone."""
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
