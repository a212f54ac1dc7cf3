"""The typed, pickle-free messages between the API process and the engine process, and their
codec.

Transport (ZMQ over `ipc://` sockets in a private temp dir, see `IpcPaths`):

    API process                                   engine process
    PUSH  --bind-->  <dir>/requests   --connect-->  PULL
          AddRequest, AbortRequests, StatsQuery, UpdateWeights, InitWeightsGroup,
          UpdateWeightsDistributed, DestroyWeightsGroup, PauseGeneration, ContinueGeneration,
          ReleaseMemory, ShutdownEngine
    PULL  --bind-->  <dir>/outputs    --connect-->  PUSH
          EngineReady, RequestsAccepted, RequestError, StepOutputs, StatsReply, UpdateWeightsReply,
          EngineFailed

Wire format: one multipart ZMQ message per message. Frame 0 is a UTF-8 JSON object
`{"kind": <class name>, ...fields}`; every `bytes` field (the int32 routing rows of `RoutingRows`)
travels raw in a frame of its own, referenced from the JSON as `{"__frame__": i}`. Decoding goes
through an explicit table of message classes, so nothing but these dataclasses (plain ints, floats,
strings, lists and byte buffers) ever crosses the process boundary — no pickle.
`decode_frames(encode_frames(m)) == m` for every message, and `decode(encode(m)) == m` for those
without byte buffers (one frame).

Test: `pytest tests/server/test_ipc.py`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsv4.engine.engine_state import EngineState
from dsv4.engine.sampling_params import SamplingParams

# ---- API -> engine ------------------------------------------------------------------------------


ROUTING_KINDS = ("experts", "indexer")
"""Kinds of captured routing (the keys of `Request.routing`): routed experts per layer, indexer
top-k per CSA layer."""


@dataclass(frozen=True)
class AddRequest:
    """`routing`: the ROUTING_KINDS whose rows the request's deltas carry (the engine must capture
    routing)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    routing: list[str] = field(default_factory=list)


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
class UpdateWeights:
    """Load the checkpoint directory `model_path` into the served model between steps
    (`LLMEngine.load_weights_from_dir`); answered by an UpdateWeightsReply. `weight_version`:
    the label the new weights' tokens carry (SGLang's; None: the update count)."""

    query_id: int
    model_path: str
    weight_version: str | None = None


@dataclass(frozen=True)
class InitWeightsGroup:
    """Join the weight-update group `group_name` (`engine/weight_group.py`) as `rank`; answered by
    an UpdateWeightsReply (num_tensors 0)."""

    query_id: int
    master_address: str
    master_port: int
    rank: int
    world_size: int
    group_name: str
    backend: str


@dataclass(frozen=True)
class UpdateWeightsDistributed:
    """Receive the announced tensors from the group's rank 0 and serve them between steps
    (`LLMEngine.update_weights`); answered by an UpdateWeightsReply."""

    query_id: int
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str
    weight_version: str | None = None     # as UpdateWeights'


@dataclass(frozen=True)
class DestroyWeightsGroup:
    """Leave the weight-update group `group_name`; answered by an UpdateWeightsReply."""

    query_id: int
    group_name: str


@dataclass(frozen=True)
class PauseGeneration:
    """Stop stepping until ContinueGeneration (SGLang's modes: "abort" every request, "retract"
    the running ones, "in_place" keep them); answered by an UpdateWeightsReply."""

    query_id: int
    mode: str


@dataclass(frozen=True)
class ContinueGeneration:
    """Step again after a PauseGeneration; answered by an UpdateWeightsReply."""

    query_id: int


@dataclass(frozen=True)
class ReleaseMemory:
    """Free the KV pools and CUDA graphs of an idle engine (`resume=False`) or allocate them again
    (`resume=True`): SGLang's release / resume of memory occupation, `tags` as it names them (None:
    every tag dsv4 releases); answered by an UpdateWeightsReply."""

    query_id: int
    resume: bool
    tags: list[str] | None = None


WeightsGroupMessage = InitWeightsGroup | UpdateWeightsDistributed | DestroyWeightsGroup


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
class RoutingRows:
    """Captured routing of consecutive token positions: int32 little-endian bytes, row-major
    `shape` = [positions, layers, k] (-1 = no route)."""

    shape: list[int]
    data: bytes


@dataclass(frozen=True)
class RequestDelta:
    """The tokens one request produced since its previous delta (the engine deals in token ids
    only; the API process detokenises them). `logprobs` / `top_logprobs` are empty unless the
    request asked for log-probs; then `top_logprobs[i]` lists (token id, logprob) pairs for
    `token_ids[i]`. `routing` (requests that asked, by kind): the rows of the positions fed since
    the previous delta; a request's rows concatenate to one per fed token. `spec_draft_tokens` /
    `spec_accepted_tokens` (speculative decoding): the request's drafts verified and accepted so
    far (totals, not increments, like `cached_tokens`)."""

    rid: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
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


@dataclass(frozen=True)
class StepOutputs:
    """One step's deltas; `weight_version`: the label of the weights that produced them (every
    token of one step comes from one version: updates run between steps)."""

    deltas: list[RequestDelta]
    num_running: int
    num_waiting: int
    weight_version: str = "0"


@dataclass(frozen=True)
class RequestsAccepted:
    """These requests passed LLMEngine.validate and are queued (sent once per inbox drain)."""

    rids: list[str]


@dataclass(frozen=True)
class RequestError:
    """The engine refused a request (LLMEngine.validate); `message` names the field."""

    rid: str
    message: str


@dataclass(frozen=True, kw_only=True)
class EngineSnapshot(EngineState):
    """Engine state for /metrics and the tests: `LLMEngine.snapshot()` (the `EngineState` fields,
    speculative decoding's counters included) plus the engine process's pid and what its loop
    counts. Flat on the wire and in /v1/engine_stats (`spec_accept_hist` as a JSON list).
    Keyword-only: `EngineState` ends in fields with defaults."""

    pid: int
    num_finished: int
    num_aborted: int
    integrity: str | None = None        # None: not checked; "ok"; or the failed assertion's message
    weight_version: int = 0             # weight updates applied since the model loaded


@dataclass(frozen=True)
class StatsReply:
    query_id: int
    stats: EngineSnapshot


@dataclass(frozen=True)
class UpdateWeightsReply:
    """`success`: the new weights are served (`weight_version` counts the updates); otherwise
    `message` says why and the served weights are unchanged. Also the answer to the weight-group
    and pause / continue messages (num_tensors 0 where none moved)."""

    query_id: int
    success: bool
    message: str
    num_tensors: int
    weight_version: int


@dataclass(frozen=True)
class EngineFailed:
    message: str


Message = (AddRequest | AbortRequests | StatsQuery | UpdateWeights | InitWeightsGroup
           | UpdateWeightsDistributed | DestroyWeightsGroup | PauseGeneration | ContinueGeneration
           | ReleaseMemory | ShutdownEngine | EngineReady
           | StepOutputs | RequestsAccepted | RequestError | StatsReply | UpdateWeightsReply
           | EngineFailed)

# ---- codec --------------------------------------------------------------------------------------

_FRAME = "__frame__"


def encode_frames(msg: Message) -> list[bytes]:
    """[JSON header, then one frame per bytes field, in the order the header references them]."""
    frames: list[bytes] = [b""]

    def to_frame(value: object) -> dict[str, int]:
        if not isinstance(value, bytes):
            raise TypeError(f"{type(value).__name__} cannot cross the IPC")
        frames.append(value)
        return {_FRAME: len(frames) - 1}

    payload = {"kind": type(msg).__name__, **dataclasses.asdict(msg)}
    # allow_nan=False: strict JSON; senders pass logprobs through finite_logprob
    frames[0] = json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False,
                           default=to_frame).encode()
    return frames


def decode_frames(frames: list[bytes]) -> Message:
    def from_frame(obj: dict[str, Any]) -> Any:
        if obj.keys() == {_FRAME}:
            index = obj[_FRAME]
            if not isinstance(index, int) or not 0 < index < len(frames):
                raise ValueError(f"frame reference {index!r} is invalid; "
                                 f"allowed: 1..{len(frames) - 1}")
            return frames[index]
        return obj

    return _decode_payload(json.loads(frames[0], object_hook=from_frame))


def encode(msg: Message) -> bytes:
    """The one frame of a message without byte buffers."""
    frames = encode_frames(msg)
    if len(frames) != 1:
        raise ValueError(f"{type(msg).__name__} carries byte buffers; use encode_frames")
    return frames[0]


def decode(data: bytes) -> Message:
    return decode_frames([data])


def _decode_payload(payload: dict[str, Any]) -> Message:
    kind = payload.pop("kind", None)
    decoder = _DECODERS.get(kind) if isinstance(kind, str) else None
    if decoder is None:
        raise ValueError(f"unknown message kind {kind!r}; allowed: {sorted(_DECODERS)}")
    return decoder(payload)


def _add_request(d: dict[str, Any]) -> AddRequest:
    return AddRequest(rid=d["rid"], prompt_ids=list(d["prompt_ids"]),
                      params=SamplingParams.create(**d["params"]), routing=list(d["routing"]))


def _delta(d: dict[str, Any]) -> RequestDelta:
    top = [[(int(t), float(lp)) for t, lp in pairs] for pairs in d.pop("top_logprobs")]
    routing = {key: RoutingRows(**rows) for key, rows in d.pop("routing").items()}
    ptop = d.pop("prompt_top_logprobs", None)
    if ptop is not None:
        ptop = [[(int(t), float(lp)) for t, lp in pairs] for pairs in ptop]
    return RequestDelta(top_logprobs=top, routing=routing, prompt_top_logprobs=ptop, **d)


def _snapshot(d: dict[str, Any]) -> EngineSnapshot:
    # JSON has no tuples: the histogram comes back as a list
    return EngineSnapshot(**{**d, "spec_accept_hist": tuple(d.get("spec_accept_hist", ()))})


def _step_outputs(d: dict[str, Any]) -> StepOutputs:
    return StepOutputs(deltas=[_delta(x) for x in d["deltas"]], num_running=d["num_running"],
                       num_waiting=d["num_waiting"], weight_version=d["weight_version"])


_DECODERS: dict[str, Callable[[dict[str, Any]], Message]] = {
    "AddRequest": _add_request,
    "AbortRequests": lambda d: AbortRequests(**d),
    "StatsQuery": lambda d: StatsQuery(**d),
    "UpdateWeights": lambda d: UpdateWeights(**d),
    "InitWeightsGroup": lambda d: InitWeightsGroup(**d),
    "UpdateWeightsDistributed": lambda d: UpdateWeightsDistributed(**d),
    "DestroyWeightsGroup": lambda d: DestroyWeightsGroup(**d),
    "PauseGeneration": lambda d: PauseGeneration(**d),
    "ContinueGeneration": lambda d: ContinueGeneration(**d),
    "ReleaseMemory": lambda d: ReleaseMemory(**d),
    "ShutdownEngine": lambda d: ShutdownEngine(),
    "EngineReady": lambda d: EngineReady(pid=d["pid"], model=ModelInfo(**d["model"])),
    "StepOutputs": _step_outputs,
    "RequestsAccepted": lambda d: RequestsAccepted(**d),
    "RequestError": lambda d: RequestError(**d),
    "StatsReply": lambda d: StatsReply(query_id=d["query_id"], stats=_snapshot(d["stats"])),
    "UpdateWeightsReply": lambda d: UpdateWeightsReply(**d),
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
