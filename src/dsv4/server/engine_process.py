"""The engine process: loads the model, then runs the scheduler loop and streams per-request deltas
back.

Spawned by `launch.py` (multiprocessing "spawn" context) as `run_engine_process(config, paths)`; it
owns the only LLMEngine, so the model and the scheduler never share a GIL with HTTP handling. One
loop turn:

    drain the inbox (block up to IDLE_POLL_MS when idle)
        -> AddRequest / AbortRequests / StatsQuery / UpdateWeights / Shutdown; one
           RequestsAccepted (or a RequestError per refused request)
    engine.step() when there is work
        -> one StepOutputs message with the new tokens of every request the step advanced
           (token ids only: the API process detokenises and applies stop strings), plus, for the
           requests that asked, the int32 routing rows of the positions fed since their last delta,
           and (speculative decoding) each request's drafts verified and accepted so far
    on becoming idle
        -> engine.check_integrity() (a failure is fatal)

Weight updates (UpdateWeights; UpdateWeightsDistributed from a trainer's process group) and a
trainer's other controls (engine_control.py: the group, pause / continue, memory release / resume)
run inside the drain, i.e. between two steps: no step ever sees half-updated weights.
`LLMEngine.update_weights` retracts the running requests (they recompute their KV with the new
weights and continue) and flushes the prefix cache; weights it refuses (ValueError) leave the
served ones unchanged and are answered with success=false.

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
from pathlib import Path

import torch
import zmq

from dsv4.config.server import ServerConfig
from dsv4.engine.data_parallel import DataParallelEngine
from dsv4.engine.engine import LLMEngine
from dsv4.engine.grammar import Grammars
from dsv4.engine.llm import load_served_model
from dsv4.engine.parallel import ParallelEngine, check_layout
from dsv4.engine.parallel_ranks import RankSpec, free_init_method
from dsv4.engine.request import Request
from dsv4.engine.warmup import warm_up
from dsv4.server.engine_control import EngineControls
from dsv4.server.ipc import (
    ROUTING_KINDS,
    AbortRequests,
    AddRequest,
    ContinueGeneration,
    DestroyWeightsGroup,
    EngineFailed,
    EngineReady,
    EngineSnapshot,
    InitWeightsGroup,
    IpcPaths,
    Message,
    ModelInfo,
    PauseGeneration,
    ReleaseMemory,
    RequestDelta,
    RequestError,
    RequestsAccepted,
    RoutingRows,
    ShutdownEngine,
    StatsQuery,
    StatsReply,
    StepOutputs,
    UpdateWeights,
    UpdateWeightsDistributed,
    UpdateWeightsReply,
    decode_frames,
    encode,
    encode_frames,
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
    engine = None
    try:
        engine = build_engine(config)
        EngineLoop(engine, inbox, outbox).run()
    except Exception as e:
        logger.exception("engine process failed")
        outbox.send(encode(EngineFailed(f"{type(e).__name__}: {e}")), flags=zmq.NOBLOCK)
        code = 1
    finally:
        if isinstance(engine, ParallelEngine):
            engine.close()
        inbox.close(linger=0)
        outbox.close(linger=1000)
        ctx.term()
    sys.exit(code)


def rank_spec(config: ServerConfig) -> RankSpec:
    """The ranks of a parallel `config` (tp_size or dp_size > 1), checked: this node's share
    of them and the rendezvous (`dist_init_addr` across nodes, else a free loopback port)."""
    check_layout(config.tp_size, config.ep_size, config.device, config.dp_size, config.nnodes)
    ranks = max(config.tp_size, config.dp_size)
    init = (f"tcp://{config.dist_init_addr}" if config.dist_init_addr is not None
            else free_init_method())
    return RankSpec(config.model, config.dtype, config.device, config.weight_format,
                    config.engine_config, ranks, config.ep_size > 1, init,
                    data_parallel=config.dp_size > 1, nnodes=config.nnodes,
                    node_rank=config.node_rank,
                    load_balance_method=config.load_balance_method,
                    load_format=config.load_format)


def build_engine(config: ServerConfig) -> LLMEngine | ParallelEngine:
    """The engine of `config`, warmed up (`EngineConfig.warmup`) before the caller reports
    ready; with `tp_size` or `dp_size` > 1 rank 0's, the other ranks spawned
    (`engine/parallel.py`, `engine/data_parallel.py`)."""
    if config.torch_threads is not None:
        torch.set_num_threads(config.torch_threads)
    if max(config.tp_size, config.dp_size) > 1:
        spec = rank_spec(config)
        return DataParallelEngine(spec) if spec.data_parallel else ParallelEngine(spec)
    model = load_served_model(Path(config.model), config.dtype, config.device,
                              config.weight_format, config.load_format, config.seed)
    tok_file, mc = Path(config.model) / "tokenizer.json", model.config
    grammars = (Grammars(tok_file, mc.vocab_size, [mc.eos_token_id]) if tok_file.is_file()
                else None)
    engine = LLMEngine(model, config.engine_config, grammars)
    warm_up(engine)      # before EngineReady: no request pays for compiles or graph captures
    return engine


class EngineLoop:
    def __init__(self, engine: LLMEngine | ParallelEngine, inbox: zmq.Socket,
                 outbox: zmq.Socket) -> None:
        self.engine, self.inbox, self.outbox = engine, inbox, outbox
        self._sent: dict[str, int] = {}      # request id -> output tokens sent to the API process
        # request id -> (routing kinds it asked for, positions whose rows were sent)
        self._routing: dict[str, tuple[list[str], int]] = {}
        self._accepted: list[str] = []
        self.num_finished = self.num_aborted = 0
        self._stopping = False
        self._checked_idle = True
        self._parent = multiprocessing.parent_process()
        self._parent_checked = time.monotonic()
        self.controls = EngineControls()    # a trainer's control messages (engine_control.py)

    def run(self) -> None:
        eng = self.engine
        info = ModelInfo(context_length=eng.context_length, max_total_tokens=eng.max_total_tokens,
                         vocab_size=eng.vocab_size, eos_token_id=eng.eos_token_id)
        self._send(EngineReady(pid=_pid(), model=info))
        logger.info("engine ready: context %d tokens, KV cache %d tokens", info.context_length,
                    info.max_total_tokens)
        while not self._stopping:
            busy = eng.has_unfinished() and not self.controls.holds_steps
            self._drain(timeout_ms=0 if busy else IDLE_POLL_MS)
            if eng.has_unfinished():
                if not self.controls.holds_steps:   # else requests wait: paused or released
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
                frames = self.inbox.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            self._handle(decode_frames(frames))
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
        elif isinstance(msg, UpdateWeights):
            self._send(self.controls.labelled(msg, self._update_weights(msg)))
        elif isinstance(msg, InitWeightsGroup | UpdateWeightsDistributed | DestroyWeightsGroup
                        | PauseGeneration | ContinueGeneration | ReleaseMemory):
            self._send(self.controls.handle(msg, self))
            self._checked_idle = self.controls.released     # released: no integrity check
        elif isinstance(msg, ShutdownEngine):
            for rid in list(self._sent):
                self._abort(rid, "abort")
            self._stopping = True
        else:
            raise AssertionError(f"the engine cannot handle {type(msg).__name__}")

    def _add(self, msg: AddRequest) -> None:
        try:
            self._check_routing(msg.routing)
            self.engine.add_request(msg.prompt_ids, msg.params, rid=msg.rid)
        except ValueError as e:
            self._send(RequestError(msg.rid, str(e)))
            return
        self._sent[msg.rid] = 0
        if msg.routing:
            self._routing[msg.rid] = (msg.routing, 0)
        self._accepted.append(msg.rid)
        self._checked_idle = False

    def _check_routing(self, kinds: list[str]) -> None:
        unknown = sorted(set(kinds) - set(ROUTING_KINDS))
        if unknown:
            raise ValueError(f"routing={unknown} is invalid; allowed: {list(ROUTING_KINDS)}")
        if kinds and not self.engine.config.capture_routing:
            raise ValueError("return_routed_experts / return_indexer_topk need the engine to "
                             "capture routing; allowed: a server started with "
                             "--enable-return-routing")

    def _abort(self, rid: str, reason: str) -> None:
        self._routing.pop(rid, None)
        if self._sent.pop(rid, None) is None:
            return  # already finished (its final delta is on the way) or never admitted
        self.engine.finish(rid, reason)
        self.engine.pop(rid)
        if reason == "abort":
            self.num_aborted += 1
        else:
            self.num_finished += 1

    def abort_all(self) -> None:
        """Abort every request here, each ending with an "abort" delta to the API process."""
        deltas = []
        for rid in list(self._sent):
            self.engine.finish(rid, "abort")
            deltas.append(self._delta(self.engine.pop(rid)))
            del self._sent[rid]
            self._routing.pop(rid, None)
            self.num_aborted += 1
        if deltas:
            self._send(StepOutputs(deltas, num_running=self.engine.num_running,
                                   num_waiting=self.engine.num_waiting,
                                   weight_version=self.controls.label))

    # ---- stepping -------------------------------------------------------------------------------
    def _step(self) -> None:
        updated = self.engine.step()
        deltas = [self._delta(req) for req in updated]
        finished = [req for req in updated if req.is_finished]
        for req in finished:
            self.engine.pop(req.rid)
            del self._sent[req.rid]
            self._routing.pop(req.rid, None)
        self.num_finished += len(finished)
        self._send(StepOutputs(deltas, num_running=self.engine.num_running,
                               num_waiting=self.engine.num_waiting,
                               weight_version=self.controls.label))

    def _delta(self, req: Request) -> RequestDelta:
        n = self._sent[req.rid]
        top = [[(t, finite_logprob(lp)) for t, lp in d.items()] for d in req.top_logprobs[n:]]
        self._sent[req.rid] = len(req.output_ids)
        prompt = n == 0 and bool(req.output_ids) and req.params.prompt_logprobs is not None
        return RequestDelta(rid=req.rid, token_ids=req.output_ids[n:],
                            logprobs=[finite_logprob(lp) for lp in req.logprobs[n:]],
                            top_logprobs=top, finish_reason=req.finish_reason,
                            num_prompt_tokens=len(req.prompt_ids), cached_tokens=req.cached_tokens,
                            routing=self._routing_delta(req),
                            spec_draft_tokens=req.spec_draft_tokens,
                            spec_accepted_tokens=req.spec_accepted_tokens,
                            prompt_logprobs=([None if lp is None else finite_logprob(lp)
                                              for lp in req.prompt_logprobs] if prompt else None),
                            prompt_top_logprobs=([[(t, finite_logprob(lp)) for t, lp in d.items()]
                                                  for d in req.prompt_top_logprobs]
                                                 if prompt else None))

    def _routing_delta(self, req: Request) -> dict[str, RoutingRows]:
        """The routing rows of the positions fed since the request's previous delta.

        Positions [0, num_cached) have been fed; their captured rows are `req.routing[kind]`. After
        a recompute preemption the positions already sent are not sent again."""
        if req.rid not in self._routing:
            return {}
        kinds, sent = self._routing[req.rid]
        fed = req.num_cached
        if fed <= sent:
            return {}
        self._routing[req.rid] = (kinds, fed)
        return {kind: routing_rows(req.routing[kind], sent, fed) for kind in kinds
                if kind in req.routing}

    # ---- weights --------------------------------------------------------------------------------
    def _update_weights(self, msg: UpdateWeights) -> UpdateWeightsReply:
        start = time.perf_counter()
        try:
            num = self.engine.load_weights_from_dir(msg.model_path)
        except ValueError as e:
            logger.warning("weight update from %s refused: %s", msg.model_path, e)
            return UpdateWeightsReply(msg.query_id, success=False, message=str(e), num_tensors=0,
                                      weight_version=self.engine.weight_version)
        self._checked_idle = False
        version = self.engine.weight_version
        message = (f"loaded {num} tensors from {msg.model_path} in "
                   f"{time.perf_counter() - start:.2f} s; weight version {version}")
        logger.info("%s", message)
        return UpdateWeightsReply(msg.query_id, success=True, message=message, num_tensors=num,
                                  weight_version=version)

    # ---- state ----------------------------------------------------------------------------------
    def snapshot(self, check_integrity: bool = False) -> EngineSnapshot:
        return EngineSnapshot(pid=_pid(), **dataclasses.asdict(self.engine.snapshot()),
                              num_finished=self.num_finished, num_aborted=self.num_aborted,
                              integrity=self._integrity() if check_integrity else None,
                              weight_version=self.engine.weight_version)

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
        frames = encode_frames(msg)
        while True:
            try:
                self.outbox.send_multipart(frames, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                if self._parent is not None and not self._parent.is_alive():
                    self._stopping = True
                    return
                self.outbox.poll(100, zmq.POLLOUT)


def _pid() -> int:
    return os.getpid()


def routing_rows(chunks: list[torch.Tensor], start: int, stop: int) -> RoutingRows:
    """Rows [start, stop) of `torch.cat(chunks)` as int32 little-endian bytes, touching only the
    chunks that hold them. `chunks`: [positions, layers, k] int64 with `stop` rows in all."""
    picked, first = [], stop           # first: the position of picked[-1]'s first row
    for chunk in reversed(chunks):
        if first <= start:
            break
        picked.append(chunk)
        first -= chunk.shape[0]
    assert first <= start, f"routing rows [{start}, {stop}) are not all captured"
    rows = torch.cat(picked[::-1])[start - first:]
    return RoutingRows(shape=list(rows.shape), data=rows.numpy().astype("<i4").tobytes())
