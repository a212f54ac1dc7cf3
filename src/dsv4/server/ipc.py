"""The typed, pickle-free messages between the API process and the engine process, and their
codec.

Transport (ZMQ over `ipc://` sockets in a private temp dir, see `IpcPaths`):

    API process                                   engine process
    PUSH  --bind-->  <dir>/requests   --connect-->  PULL
          AddRequest, AbortRequests, StatsQuery, ShutdownEngine
    PULL  --bind-->  <dir>/outputs    --connect-->  PUSH
          EngineReady, RequestsAccepted, RequestError, StepOutputs, StatsReply, EngineFailed

Wire format: one UTF-8 JSON object per ZMQ message, `{"kind": <class name>, ...fields}`. Decoding
goes through an explicit table of message classes, so nothing but these dataclasses (plain ints,
floats, strings and lists) ever crosses the process boundary — no pickle. `decode(encode(m)) == m`
for every message.

Test: `pytest tests/server/test_ipc.py`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsv4.engine.engine import EngineState
from dsv4.engine.sampling_params import SamplingParams

# ---- API -> engine ------------------------------------------------------------------------------


@dataclass(frozen=True)
class AddRequest:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class AbortRequests:
    """Finish these requests now: reason "abort" (client gone, /v1/abort, shutdown) or "stop" (the
    API process found a stop string in their text)."""

    rids: list[str]
    reason: str = "abort"


@dataclass(frozen=True)
class StatsQuery:
    """Ask for an EngineSnapshot; optionally flush the prefix cache (entries no request uses) first
    and run the engine's check_integrity()."""

    query_id: int
    check_integrity: bool = False
    flush_cache: bool = False


@dataclass(frozen=True)
class ShutdownEngine:
    """Abort everything and exit 0."""


# ---- engine -> API ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelInfo:
    context_length: int
    max_total_tokens: int
    vocab_size: int
    eos_token_id: int


@dataclass(frozen=True)
class EngineReady:
    pid: int
    model: ModelInfo


@dataclass(frozen=True)
class RequestDelta:
    """The tokens one request produced since its previous delta (the engine deals in token ids
    only; the API process detokenises them). `top_logprobs[i]` lists (token id, logprob) pairs for
    `token_ids[i]`."""

    rid: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: str | None
    num_prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class StepOutputs:
    deltas: list[RequestDelta]
    num_running: int
    num_waiting: int


@dataclass(frozen=True)
class RequestsAccepted:
    """These requests passed LLMEngine.validate and are queued (sent once per inbox drain)."""

    rids: list[str]


@dataclass(frozen=True)
class RequestError:
    """The engine refused a request (LLMEngine.validate); `message` names the field."""

    rid: str
    message: str


@dataclass(frozen=True)
class EngineSnapshot(EngineState):
    """Engine state for /metrics and the tests: `LLMEngine.snapshot()` (the `EngineState` fields)
    plus the engine process's pid and what its loop counts. Flat on the wire and in
    /v1/engine_stats."""

    pid: int
    num_finished: int
    num_aborted: int
    integrity: str | None = None        # None: not checked; "ok"; or the failed assertion's message


@dataclass(frozen=True)
class StatsReply:
    query_id: int
    stats: EngineSnapshot


@dataclass(frozen=True)
class EngineFailed:
    message: str


Message = (AddRequest | AbortRequests | StatsQuery | ShutdownEngine | EngineReady | StepOutputs
           | RequestsAccepted | RequestError | StatsReply | EngineFailed)

# ---- codec --------------------------------------------------------------------------------------


def encode(msg: Message) -> bytes:
    payload = {"kind": type(msg).__name__, **dataclasses.asdict(msg)}
    # allow_nan=False: strict JSON; senders pass logprobs through finite_logprob
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def decode(data: bytes) -> Message:
    payload = json.loads(data)
    kind = payload.pop("kind", None)
    decoder = _DECODERS.get(kind) if isinstance(kind, str) else None
    if decoder is None:
        raise ValueError(f"unknown message kind {kind!r}; allowed: {sorted(_DECODERS)}")
    return decoder(payload)


def _add_request(d: dict[str, Any]) -> AddRequest:
    return AddRequest(rid=d["rid"], prompt_ids=list(d["prompt_ids"]),
                      params=SamplingParams.create(**d["params"]))


def _delta(d: dict[str, Any]) -> RequestDelta:
    top = [[(int(t), float(lp)) for t, lp in pairs] for pairs in d.pop("top_logprobs")]
    return RequestDelta(top_logprobs=top, **d)


def _step_outputs(d: dict[str, Any]) -> StepOutputs:
    return StepOutputs(deltas=[_delta(x) for x in d["deltas"]], num_running=d["num_running"],
                       num_waiting=d["num_waiting"])


_DECODERS: dict[str, Callable[[dict[str, Any]], Message]] = {
    "AddRequest": _add_request,
    "AbortRequests": lambda d: AbortRequests(**d),
    "StatsQuery": lambda d: StatsQuery(**d),
    "ShutdownEngine": lambda d: ShutdownEngine(),
    "EngineReady": lambda d: EngineReady(pid=d["pid"], model=ModelInfo(**d["model"])),
    "StepOutputs": _step_outputs,
    "RequestsAccepted": lambda d: RequestsAccepted(**d),
    "RequestError": lambda d: RequestError(**d),
    "StatsReply": lambda d: StatsReply(query_id=d["query_id"], stats=EngineSnapshot(**d["stats"])),
    "EngineFailed": lambda d: EngineFailed(**d),
}


def finite_logprob(value: float) -> float:
    """JSON has no -inf: an underflowed logprob is reported as -9999.0 (vLLM does the same)."""
    return value if math.isfinite(value) else -9999.0


# ---- sockets ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IpcPaths:
    """The two socket addresses, in a private (0700) temp dir that the API process creates and
    removes."""

    directory: str

    @property
    def requests(self) -> str:
        return f"ipc://{self.directory}/requests"

    @property
    def outputs(self) -> str:
        return f"ipc://{self.directory}/outputs"

    @staticmethod
    def create() -> IpcPaths:
        # NOTE: AF_UNIX paths are limited to ~107 bytes; mkdtemp in the system temp dir stays well
        # below.
        directory = tempfile.mkdtemp(prefix="dsv4-ipc-")
        os.chmod(directory, 0o700)
        return IpcPaths(directory)

    def remove(self) -> None:
        for name in ("requests", "outputs"):
            Path(self.directory, name).unlink(missing_ok=True)
        Path(self.directory).rmdir()
