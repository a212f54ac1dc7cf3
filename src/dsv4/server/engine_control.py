"""The engine process's side of a trainer's control messages (the endpoints of weight_update.py):
weight updates over a process group, pause / continue, release / resume of the KV memory, and the
label of the served weights.

`EngineControls.handle` answers each message with an UpdateWeightsReply (success=false and the
reason on a refusal, a failed join or a failed transfer; the served weights then unchanged). The
engine loop steps only while `holds_steps` is false, and stamps each step's outputs with `label`.
Pause and release hold steps independently: a continue does not resume released memory, and a
resume does not lift a pause.

Test: `pytest tests/server/test_weight_update.py`.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from dsv4.engine.engine import LLMEngine
from dsv4.engine.parallel import ParallelEngine
from dsv4.engine.weight_group import WeightGroup, backend_for, open_group, receive_tensors
from dsv4.server.ipc import (
    ContinueGeneration,
    DestroyWeightsGroup,
    InitWeightsGroup,
    PauseGeneration,
    ReleaseMemory,
    UpdateWeights,
    UpdateWeightsDistributed,
    UpdateWeightsReply,
)
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)

Engine = LLMEngine | ParallelEngine
"""One engine process, or rank 0 of tensor / expert / data-parallel ranks (which mirrors weight
updates, retraction and memory release to its other ranks: `engine/parallel.py`)."""
ControlMessage = (InitWeightsGroup | UpdateWeightsDistributed | DestroyWeightsGroup
                  | PauseGeneration | ContinueGeneration | ReleaseMemory)
JOIN_TIMEOUT_S = 600.0                             # a join or a broadcast waiting longer fails
PAUSE_MODES = ("abort", "retract", "in_place")     # SGLang's /pause_generation modes
RELEASABLE = ("kv_cache", "cuda_graph")            # SGLang's memory tags dsv4 releases


class ControlledLoop(Protocol):
    """What the controls need of the engine loop."""

    @property
    def engine(self) -> object: ...

    def abort_all(self) -> None:
        """Abort every request, each ending with an "abort" delta to the API process."""


class EngineControls:
    def __init__(self) -> None:
        self._groups: dict[str, WeightGroup] = {}
        self.paused = False      # PauseGeneration until the ContinueGeneration
        self.released = False    # ReleaseMemory until the resume: the KV pools are freed
        self.label = "0"         # the served weights' label (SGLang's weight_version)

    @property
    def holds_steps(self) -> bool:
        return self.paused or self.released

    def labelled(self, msg: UpdateWeights | UpdateWeightsDistributed,
                 reply: UpdateWeightsReply) -> UpdateWeightsReply:
        """After a weight update that succeeded, the label its tokens carry: the update's
        `weight_version`, else the update count."""
        if reply.success:
            self.label = msg.weight_version or str(reply.weight_version)
        return reply

    def handle(self, msg: ControlMessage, loop: ControlledLoop) -> UpdateWeightsReply:
        engine = loop.engine
        assert isinstance(engine, LLMEngine | ParallelEngine), type(engine)
        try:
            message, num = self._apply(msg, engine, loop)
        except (ValueError, RuntimeError) as e:     # RuntimeError: a join or broadcast failed
            logger.warning("%s refused: %s", type(msg).__name__, e)
            return UpdateWeightsReply(msg.query_id, False, str(e), 0, engine.weight_version)
        logger.info("%s", message)
        reply = UpdateWeightsReply(msg.query_id, True, message, num, engine.weight_version)
        return self.labelled(msg, reply) if isinstance(msg, UpdateWeightsDistributed) else reply

    def _apply(self, msg: ControlMessage, engine: Engine, loop: ControlledLoop
               ) -> tuple[str, int]:
        if isinstance(msg, PauseGeneration | ContinueGeneration):
            return self._pause(msg, engine, loop), 0
        if isinstance(msg, ReleaseMemory):
            return self._memory(msg, engine), 0
        if isinstance(msg, InitWeightsGroup):
            return self._join(msg, engine.runner.device), 0
        if isinstance(msg, DestroyWeightsGroup):
            self._group(msg.group_name)
            del self._groups[msg.group_name]
            return f"left weight-update group {msg.group_name!r}", 0
        start = time.perf_counter()
        named = receive_tensors(self._group(msg.group_name), msg.names, msg.dtypes, msg.shapes,
                                engine.runner.device)
        num = engine.update_weights(named)
        return (f"updated {num} tensors from group {msg.group_name!r} in "
                f"{time.perf_counter() - start:.2f} s; weight version {engine.weight_version}",
                num)

    def _pause(self, msg: PauseGeneration | ContinueGeneration, engine: Engine,
               loop: ControlledLoop) -> str:
        """SGLang's modes: "abort" every request, "retract" the running ones (their KV is freed;
        they recompute on the continue), "in_place" (they keep their KV); requests that arrive
        meanwhile wait."""
        if isinstance(msg, ContinueGeneration):
            self.paused = False
            return "generation continues"
        if msg.mode not in PAUSE_MODES:
            raise ValueError(f"mode={msg.mode!r} is invalid; allowed: {list(PAUSE_MODES)}")
        if msg.mode == "abort":
            loop.abort_all()
        elif msg.mode == "retract":
            engine.retract_running()
        self.paused = True
        return f"generation paused ({msg.mode})"

    def _memory(self, msg: ReleaseMemory, engine: Engine) -> str:
        """SGLang's release / resume of memory occupation: the KV pools and CUDA graphs of an
        idle engine ("kv_cache", "cuda_graph"; the weights stay resident); the prefix cache comes
        back empty, the graphs are captured again on first use."""
        tags = set(msg.tags or RELEASABLE)
        if not tags <= set(RELEASABLE):
            raise ValueError(f"tags={sorted(tags)} is invalid; allowed: a subset of "
                             f"{list(RELEASABLE)} (the weights stay resident)")
        if msg.resume:
            if self.released:
                engine.resume_memory()
            self.released = False
            return "KV pools and CUDA graphs resumed"
        if not self.released and engine.has_unfinished():
            raise ValueError("requests are in flight; allowed: an idle engine "
                             "(/pause_generation first)")
        freed = engine.release_memory() if not self.released else 0
        self.released = True
        return f"released {freed / 1e6:.1f} MB of KV pools and CUDA graphs; the weights stay"

    def _join(self, msg: InitWeightsGroup, device: torch.device) -> str:
        if msg.group_name in self._groups:
            raise ValueError(f"group_name={msg.group_name!r} is already joined; allowed: a new "
                             "name, or /destroy_weights_update_group first")
        suits = backend_for(device)
        if msg.backend != suits:
            raise ValueError(f"backend={msg.backend!r} does not suit the engine's {device.type} "
                             f"weights; allowed: {suits!r}")
        self._groups[msg.group_name] = open_group(msg.master_address, msg.master_port, msg.rank,
                                                  msg.world_size, msg.group_name, msg.backend,
                                                  JOIN_TIMEOUT_S)
        return (f"joined weight-update group {msg.group_name!r} as rank {msg.rank} of "
                f"{msg.world_size} ({msg.backend})")

    def _group(self, name: str) -> WeightGroup:
        group = self._groups.get(name)
        if group is None:
            raise ValueError(f"group_name={name!r} is not joined; allowed: "
                             f"{sorted(self._groups)} (/init_weights_update_group first)")
        return group
