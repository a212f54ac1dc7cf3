"""Tensor / expert-parallel engines: one engine per rank, rank 0 drives (issue 22).

Every rank runs an `LLMEngine` over its shard of the model (`distributed/tp.py`), which it reads
from the checkpoint itself (`distributed/loading.py`: only the tensors and slices it owns).
Rank 0's is the one the caller uses, through `ParallelEngine` (the surface `LLM` uses). Every call
that changes engine state (`add_request` with its request id and resolved seed, `finish`, `pop`,
`step`) is recorded and, at the next step, broadcast to the other ranks over a gloo group as one
list; they apply it in the same order and run the same step. As in SGLang, where every TP rank
runs a scheduler over the requests rank 0 broadcasts: scheduling is deterministic given the call
sequence, every rank computes the same logits (the head all-gathers them) and samples with the
same per-request seeds, so all ranks take the same steps, their collectives match, and only rank
0's outputs are read.

Several nodes (`RankSpec.nnodes`, SGLang's `--nnodes` / `--node-rank` / `--dist-init-addr`): the
ranks are spread evenly, node n running ranks [n * per_node, (n + 1) * per_node) on its devices
cuda:0.. (GPU rank r: cuda:(r mod per_node)); node 0 runs rank 0's `ParallelEngine` and spawns
its other local ranks, every other node runs `serve_node`, and all rendezvous at the given TCP
address. The commands travel over the same gloo group, across nodes.

Weight updates (`update_weights`, `load_weights_from_dir`; the server's trainer endpoints) take
full tensors on rank 0, which applies its part first and then sends every rank its part
(`engine/parallel_weights.py`); retraction and the release / resume of KV memory are mirrored at
once. Not yet: structured output (its grammars compile in the background, on a clock, so ranks
could admit a request at different steps) is refused; overlap scheduling and speculative decoding
run as on one rank (not tested across ranks). A rank that dies is detected before the next step
(`RuntimeError` naming it) instead of hanging in a collective.

Data-parallel attention (`RankSpec.data_parallel`, `DataParallelEngine`; `distributed/dp.py`):
every rank loads the full model with its MoE layers shared over all ranks' tokens, and serves
only its own requests. Rank 0 resolves each request's id and seed as one process would, assigns
it to the rank with the fewest unfinished requests (ties: the lowest rank; so a workload
re-submitted after the first finished lands on the same ranks and hits their prefix caches),
and sends `add` / `finish` / `pop` to that rank only (`("at", rank, command)`). Every step runs
on all ranks, each exactly one forward (`LLMEngine.step_or_idle`); then each rank sends rank 0
what its requests got in the step (`RequestDelta`, through a gloo `gather_object`), which rank 0
applies to a mirror `Request` per remote request, so callers (`LLM.generate`) see every request
as with one process (`engine/dp_outbox.py`, `engine/data_parallel.py`). Reads (`READS`) still
see rank 0's engine only.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import socket
from collections.abc import Mapping
from datetime import timedelta
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dsv4.config.engine import EngineConfig
from dsv4.config.model import ModelConfig
from dsv4.config.server import check_load_balance_method
from dsv4.distributed.dp import DPGroup, check_dp_attention
from dsv4.distributed.loading import Source, load_dp_shard, load_shard, owned_cuts
from dsv4.distributed.tp import TPGroup, check_shardable
from dsv4.engine.dp_outbox import Outbox
from dsv4.engine.engine import LLMEngine
from dsv4.engine.parallel_weights import WeightChannel
from dsv4.engine.request import Request
from dsv4.engine.sampling_params import SamplingParams
from dsv4.engine.warmup import warm_up
from dsv4.engine.weight_sync import read_checkpoint_dir
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)

Command = tuple[Any, ...]
READS = frozenset({
    "config", "runner", "scheduler", "cache", "requests", "context_length", "max_total_tokens",
    "vocab_size", "eos_token_id", "has_unfinished", "num_running", "num_waiting", "snapshot",
    "check_integrity", "steps", "prefill_tokens", "decode_tokens", "spec_accept_hist",
    "spec_draft_tokens", "spec_accepted_tokens", "grammars", "weight_version"})
"""`LLMEngine` attributes read through `ParallelEngine` (rank 0's values)."""
MIRRORED = frozenset({"add_request", "finish", "pop", "step", "flush_cache", "validate", "close",
                      "update_weights", "load_weights_from_dir", "retract_running",
                      "release_memory", "resume_memory"})
DEATH_GRACE_S = 2.0
"""After a failed broadcast, how long the ranks get to be reaped (so the error names them)."""
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
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo",
                            init_method=spec.init_method, rank=rank, world_size=spec.world,
                            timeout=TIMEOUT)
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
    engine = LLMEngine(model, config)
    warm_up(engine, progress=rank == 0)     # every rank the same steps: matched collectives
    cuts = owned_cuts(spec.model, spec.dtype, TPGroup(rank, spec.world), spec.expert_parallel,
                      spec.weight_format, spec.data_parallel, source)  # type: ignore[arg-type]
    return engine, WeightChannel(cuts, spec.world, control)


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


class ParallelEngine:
    """Rank 0's engine with the other ranks in lockstep (module docstring). Reads go to rank 0's
    engine; every state change is mirrored. `close()` stops the workers."""

    def __init__(self, spec: RankSpec) -> None:
        # before any process starts: a refused layout leaves nothing running
        mc = ModelConfig.from_hf(spec.model)
        if spec.data_parallel:
            check_dp_attention(mc, spec.config, spec.world, spec.expert_parallel, spec.device)
        else:
            check_shardable(mc, spec.world, spec.expert_parallel)
        if spec.node_rank != 0:
            raise ValueError(f"node_rank={spec.node_rank}: the engine (rank 0) runs on node 0; "
                             "other nodes run `serve_node`")
        self.spec = spec
        self.workers = spawn_ranks(spec, [r for r in spec.local_ranks if r != 0])
        self.engine, self.weights = build_rank(spec, 0)
        self.control = self.weights.control
        self._pending: list[Command] = []
        self._closed = False

    def __getattr__(self, name: str) -> Any:
        """Rank 0's engine for reads; a state change that is not mirrored is refused."""
        if name in READS:
            return getattr(self.engine, name)
        raise AttributeError(f"LLMEngine.{name} with tensor_parallel_size > 1 is not supported "
                             f"yet; allowed: {sorted(READS | MIRRORED)}")

    def flush_cache(self) -> None:
        self.engine.flush_cache()
        self._pending.append(("flush",))

    def update_weights(self, named: Mapping[str, torch.Tensor]) -> int:
        """`LLMEngine.update_weights` on every rank, each with its part of the full tensors
        (`engine/parallel_weights.py`): rank 0's applied first, so a refused update (ValueError)
        reaches no rank; then the queued commands and the update go to the others."""
        num = self.engine.update_weights(self.weights.check(named))
        self._send([*self._pending, ("update_weights", self.weights.header(named))])
        self._pending = []
        self.weights.broadcast(named)
        return num

    def load_weights_from_dir(self, path: str | Path) -> int:
        """`update_weights` with every tensor of the official-layout checkpoint at `path`, read
        once by rank 0 (`weight_sync.read_checkpoint_dir`)."""
        return self.update_weights(read_checkpoint_dir(path, self.engine.runner.model))

    def retract_running(self) -> int:
        """Every rank retracts its running requests (sent at once, after the queued commands)."""
        num = self.engine.retract_running()
        self._flush_pending(("retract",))
        return num

    def release_memory(self) -> int:
        """Every rank frees its KV pools and CUDA graphs now (a colocated trainer steps next);
        refused while any rank has requests. Returns rank 0's bytes freed."""
        if self.has_unfinished():
            raise RuntimeError("release_memory() with requests in flight; allowed: an idle "
                               "engine")
        freed = self.engine.release_memory()
        self._flush_pending(("release",))
        return freed

    def resume_memory(self) -> None:
        self.engine.resume_memory()
        self._flush_pending(("resume",))

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        _refuse_structured(params)
        self.engine.validate(prompt_ids, params)

    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    rid: str | None = None) -> Request:
        _refuse_structured(params)
        req = self.engine.add_request(prompt_ids, params, rid)      # validates the rest
        self._pending.append(("add", list(prompt_ids), params, req.rid, req.seed))
        return req

    def finish(self, rid: str, reason: str = "abort") -> None:
        self.engine.finish(rid, reason)
        self._pending.append(("finish", rid, reason))

    def pop(self, rid: str) -> Request:
        req = self.engine.pop(rid)
        self._pending.append(("pop", rid))
        return req

    def step(self) -> list[Request]:
        self._flush_pending(("step",))
        return self.engine.step()

    def _flush_pending(self, last: Command) -> None:
        self._send([*self._pending, last])
        self._pending = []

    def close(self) -> None:
        """Stop the worker ranks and leave the process group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            if all(w.is_alive() for w in self.workers):
                self._send([*self._pending, ("stop",)])
            for w in self.workers:
                w.join(timeout=60)
        finally:
            for w in self.workers:
                if w.is_alive():
                    w.kill()
            dist.destroy_process_group()

    def _send(self, commands: list[Command]) -> None:
        self._raise_if_dead()
        try:
            dist.broadcast_object_list([commands], src=0, group=self.control)
        except RuntimeError as e:       # a rank that died during the call: name it
            for w in self.workers:
                w.join(timeout=DEATH_GRACE_S)
            self._raise_if_dead(e)
            raise

    def _raise_if_dead(self, cause: BaseException | None = None) -> None:
        dead = [(w.name, w.exitcode) for w in self.workers if not w.is_alive()]
        if dead:
            raise RuntimeError(f"tensor-parallel rank(s) died: {dead} (name, exit code); the "
                               "engine cannot continue") from cause


def _refuse_structured(params: SamplingParams) -> None:
    if params.structured is not None:
        raise ValueError("structured output (response_format / guided decoding) with "
                         "tensor_parallel_size > 1 is not supported yet; allowed: None")


def free_init_method() -> str:
    """A TCP rendezvous on a free loopback port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def check_layout(world: int, expert_parallel_size: int, device: str,
                 data_parallel_size: int = 1, nnodes: int = 1) -> None:
    """Validate the parallel layout at the edge (errors name the field and what is allowed).
    `world` is tensor_parallel_size; with data_parallel_size > 1 it must be 1 and the ranks are
    the data-parallel ones."""
    if world < 1:
        raise ValueError(f"tensor_parallel_size={world} is invalid; allowed: >= 1")
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size={data_parallel_size} is invalid; allowed: >= 1")
    if data_parallel_size > 1:
        if world > 1:
            raise ValueError(f"tensor_parallel_size={world} with data_parallel_size="
                             f"{data_parallel_size} is not supported; allowed: "
                             "tensor_parallel_size=1 (attention DP, MoE over all ranks)")
        if expert_parallel_size not in (1, data_parallel_size):
            raise ValueError(f"expert_parallel_size={expert_parallel_size} is invalid; allowed:"
                             f" 1 or data_parallel_size ({data_parallel_size})")
        world = data_parallel_size
    elif expert_parallel_size not in (1, world):
        raise ValueError(f"expert_parallel_size={expert_parallel_size} is invalid; allowed: 1 "
                         f"or tensor_parallel_size ({world}): experts split over the TP ranks")
    if device.startswith("cuda") and world // nnodes > torch.cuda.device_count():
        raise ValueError(f"{world // nnodes} ranks per node are more than the "
                         f"{torch.cuda.device_count()} visible GPUs; allowed: at most that")
    if os.environ.get("RANK") is not None and world > 1:
        raise ValueError("tensor_parallel_size > 1 launches its own ranks; do not start it "
                         "under torchrun")
