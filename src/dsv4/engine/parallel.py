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
once. Structured output: every rank holds the grammars (`engine/grammar.py`); a structured
request's grammar is compiled before its "add" on every rank (`compile_grammar`: rank 0 before
recording it, each worker before applying it), so it is admitted at the same step everywhere (a
background compile finishes on a clock); this blocks the driving loop for the compile (cached
specs: none). Overlap scheduling and speculative decoding run as on one rank (not tested across
ranks). A rank that dies is detected before the next step
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

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dsv4.config.model import ModelConfig
from dsv4.distributed.dp import check_dp_attention
from dsv4.distributed.tp import check_shardable
from dsv4.engine.parallel_ranks import (
    Command,
    RankSpec,
    build_rank,
    compile_grammar,
    spawn_ranks,
)
from dsv4.engine.request import Request
from dsv4.engine.sampling_params import SamplingParams
from dsv4.engine.weight_sync import read_checkpoint_dir
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)

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
        self.engine.validate(prompt_ids, params)

    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    rid: str | None = None) -> Request:
        self.engine.validate(prompt_ids, params)
        compile_grammar(self.engine, params)        # admitted now, as on the other ranks
        req = self.engine.add_request(prompt_ids, params, rid)
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
