"""The ranks of a tensor / expert / data-parallel engine (`engine/parallel.py` drives them):
what each rank is given (`RankSpec`), how it builds its engine (`build_rank`: the process group,
its shard of the model, the grammars, the warm-up), and the worker loop that applies rank 0's
broadcast commands in order (`serve_rank`, `apply`), on this node (`spawn_ranks`) or on another
(`serve_node`)."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import socket
from datetime import timedelta
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dsv4.config.engine import EngineConfig
from dsv4.config.server import check_load_balance_method
from dsv4.distributed.dp import DPGroup
from dsv4.distributed.group import join_default_group
from dsv4.distributed.loading import Source, load_dp_shard, load_shard, owned_cuts
from dsv4.distributed.tp import TPGroup
from dsv4.engine.dp_outbox import Outbox
from dsv4.engine.engine import LLMEngine
from dsv4.engine.grammar import Grammars
from dsv4.engine.parallel_weights import WeightChannel
from dsv4.engine.sampling_params import SamplingParams
from dsv4.engine.warmup import warm_up
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)

Command = tuple[Any, ...]
TIMEOUT = timedelta(minutes=10)
"""Collectives that wait longer than this raise (a peer that stopped without dying)."""


@dataclasses.dataclass(frozen=True)
class RankSpec:
    """What every rank needs to build its engine: the checkpoint, how to load and shard it, the
    engine config, and the rendezvous."""

    model: str
    dtype: str
    device: str
    weight_format: str
    config: EngineConfig
    world: int
    expert_parallel: bool
    init_method: str
    data_parallel: bool = False     # DP attention over `world` ranks instead of TP
    # DP: which rank takes a new request (`engine/dp_router.py`)
    load_balance_method: str = "shortest_queue"
    nnodes: int = 1                 # nodes the ranks are spread over, `world / nnodes` each
    node_rank: int = 0              # this node; rank 0 (the driver) lives on node 0
    # "dummy": each rank draws its shard's random weights (seed: `config.seed`), reads no files
    load_format: str = "auto"

    def __post_init__(self) -> None:
        check_load_balance_method(self.load_balance_method)
        Source(self.load_format)                        # raises for an unknown format
        if self.nnodes < 1 or self.world % self.nnodes:
            raise ValueError(f"nnodes={self.nnodes} is invalid for {self.world} ranks; allowed: "
                             "a divisor of the number of ranks")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} is invalid; "
                             f"allowed: 0..{self.nnodes - 1}")

    @property
    def local_ranks(self) -> range:
        """The global ranks this node runs: node n runs [n * per_node, (n + 1) * per_node)."""
        per_node = self.world // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)

    def device_of(self, rank: int) -> str:
        local = rank % (self.world // self.nnodes)
        return f"cuda:{local}" if self.device.startswith("cuda") else self.device


def build_rank(spec: RankSpec, rank: int) -> tuple[LLMEngine, WeightChannel]:
    """Join the process group, read this rank's shard of the model, warm up; returns (engine, its
    weight-update channel over the gloo control group)."""
    device = spec.device_of(rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    join_default_group("nccl" if device.startswith("cuda") else "gloo", spec.init_method, rank,
                       spec.world, TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=TIMEOUT)
    source = Source(spec.load_format, spec.config.seed)
    if spec.data_parallel:     # with EP, another rank's routed experts are never read
        model = load_dp_shard(spec.model, spec.dtype, device, DPGroup(rank, spec.world),
                              spec.expert_parallel, spec.weight_format,  # type: ignore[arg-type]
                              source)
    else:
        model = load_shard(spec.model, spec.dtype, device, TPGroup(rank, spec.world),
                           spec.expert_parallel, spec.weight_format,  # type: ignore[arg-type]
                           source)
    # DP ranks step in lockstep one plain forward at a time (`step_or_idle`): no overlap
    config = spec.config
    if spec.data_parallel:
        config = dataclasses.replace(config, overlap_schedule=False)
    tok_file, mc = Path(spec.model) / "tokenizer.json", model.config
    grammars = (Grammars(tok_file, mc.vocab_size, [mc.eos_token_id]) if tok_file.is_file()
                else None)
    engine = LLMEngine(model, config, grammars)
    warm_up(engine, progress=rank == 0)     # every rank the same steps: matched collectives
    cuts = owned_cuts(spec.model, spec.dtype, TPGroup(rank, spec.world), spec.expert_parallel,
                      spec.weight_format, spec.data_parallel, source)  # type: ignore[arg-type]
    return engine, WeightChannel(cuts, spec.world, control, torch.device(device))


def serve_rank(spec: RankSpec, rank: int) -> None:
    """A worker rank (1..world-1): apply rank 0's broadcast commands until told to stop."""
    if spec.device == "cpu":
        torch.set_num_threads(1)
    engine, weights = build_rank(spec, rank)
    outbox = Outbox(rank, weights.control)
    try:
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=weights.control)
            if not apply(engine, box[0], outbox, weights):
                return
    finally:
        dist.destroy_process_group()


def spawn_ranks(spec: RankSpec, ranks: list[int]) -> list[BaseProcess]:
    """Start `serve_rank` for each of `ranks` on this node (spawned, daemonic: they die with it)."""
    ctx = mp.get_context("spawn")
    workers: list[BaseProcess] = [ctx.Process(target=serve_rank, args=(spec, r), daemon=True,
                                              name=f"dsv4-rank-{r}") for r in ranks]
    for w in workers:
        w.start()
    return workers


def serve_node(spec: RankSpec) -> int:
    """Node `spec.node_rank` > 0 of a multi-node layout: run its ranks until rank 0 (node 0)
    stops them; returns 0, or 1 when a rank failed (the others are then stopped, and their
    peers' collectives fail, so no node hangs)."""
    if spec.node_rank == 0:
        raise ValueError("node_rank=0 runs the engine itself (`ParallelEngine`); allowed: > 0")
    workers = spawn_ranks(spec, list(spec.local_ranks))
    logger.info("node %d of %d: ranks %s", spec.node_rank, spec.nnodes, list(spec.local_ranks))
    try:
        while workers:
            for w in list(workers):
                w.join(timeout=0.5)
                if w.exitcode is None:
                    continue
                workers.remove(w)
                if w.exitcode != 0:
                    logger.error("%s exited with %s; stopping this node", w.name, w.exitcode)
                    return 1
        return 0
    finally:
        for w in workers:
            w.kill()


def apply(engine: LLMEngine, commands: list[Command], outbox: Outbox,
          weights: WeightChannel | None = None) -> bool:
    """Apply rank 0's commands to this rank's engine in order; False on "stop". Data-parallel
    attention: "at" commands apply on their rank only, and "dp_step" reports to rank 0. A weight
    update ("update_weights", header) receives its tensors through `weights`."""
    for cmd in commands:
        kind = cmd[0]
        if kind == "at":
            if cmd[1] == outbox.rank:
                apply(engine, [cmd[2]], outbox, weights)
        elif kind == "dp_step":
            outbox.send(engine.step_or_idle())
        elif kind == "add":
            _, ids, params, rid, seed = cmd
            compile_grammar(engine, params)
            engine.add_request(ids, dataclasses.replace(params, seed=seed), rid=rid)
        elif kind == "finish":
            engine.finish(cmd[1], cmd[2])
        elif kind == "pop":
            engine.pop(cmd[1])
            outbox.forget(cmd[1])
        elif kind == "step":
            engine.step()
        elif kind == "flush":
            engine.flush_cache()
        elif kind == "update_weights":
            assert weights is not None, "a weight update needs the rank's channel"
            engine.update_weights(weights.receive(cmd[1]))
        elif kind in ("retract", "release", "resume"):
            {"retract": engine.retract_running, "release": engine.release_memory,
             "resume": engine.resume_memory}[kind]()
        elif kind == "stop":
            return False
        else:
            raise ValueError(f"unknown command {kind!r}")
    return True


def compile_grammar(engine: LLMEngine, params: SamplingParams) -> None:
    """Compile a structured request's grammar now (a no-op without one): its `add_request` then
    finds it cached and schedules it at once, on every rank alike. ValueError for a bad spec."""
    if params.structured is not None and engine.grammars is not None:
        engine.grammars.prepare(params.structured).result()


def free_init_method() -> str:
    """A TCP rendezvous on a free loopback port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"
