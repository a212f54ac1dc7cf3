"""The processes of the Ray placements (`rl/placement.py`): what each actor holds and runs.

* `TrainerWorker` (disaggregated): the policy half of `RLTrainer`, built by its `_init_policy`
  (fp32 policy, compute copy, KL reference, AdamW; no engine). `optimize` is
  `RLTrainer._optimize`; `push_weights` broadcasts the fp32 policy (what `RLTrainer.sync` hands
  its engine) as rank 0 of the weight-sync group (`rl/bucket_sync.py`).
* `RolloutWorker` (disaggregated): the engine half (task, tokenizer, `LLMEngine` from
  `RLTrainer.engine_config`; no policy). `generate` is `RLTrainer.rollout` plus
  `RLTrainer.train_step`'s packing, `evaluate` is `RLTrainer.evaluate`; `pull_weights` receives
  the broadcast into the engine bucket by bucket (`LLMEngine.update_weights`).
* `ColocatedWorker` (colocated): the whole local run (`open_run`) in one actor.

Both halves are `RLTrainer`s whose constructors build only their half (no `super().__init__`):
the work they do is `RLTrainer`'s own methods, so the math, the seeds and the records are the
local run's by construction; a method of the missing half raises AttributeError.

Weight versions: the engine's weights after the trainer's step k are version k (0: the initial
policy). `RolloutWorker.generate(k)` requires version k and stamps it on every sample of its
`RolloutBatch`; `TrainerWorker.optimize` refuses samples of another version than its step
(synchronous on-policy RL) and logs it as `weight_version`.

Each actor's process uses the CPU threads Ray gives it (OMP_NUM_THREADS = the actor's CPUs) and
seeds torch with the run's seed, as `RLTrainer.__init__` does.

Test: `pytest tests/rl/test_placement.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from dsv4.config.engine import check_weight_format
from dsv4.engine.engine import LLMEngine
from dsv4.kernels.registry import create_kernels
from dsv4.model.forward_mode import ForwardMode
from dsv4.model.loader import load_model
from dsv4.rl.batch import TrainBatch, advantages_of, group_rewards, pack
from dsv4.rl.bucket_sync import (
    Bucket,
    free_port,
    join_group,
    leave_group,
    plan_buckets,
    receive_weights,
    send_weights,
)
from dsv4.rl.config import RLConfig
from dsv4.rl.objective import formulation_mode
from dsv4.rl.rewards import make_task
from dsv4.rl.trainer import RLTrainer, open_run
from dsv4.utils.logging import init_logger
from dsv4.utils.threads import use_cpu_threads

logger = init_logger(__name__)

SYNC_TIMEOUT_S = 600.0
"""A weight-sync collective waiting longer than this raises (a peer died without closing)."""


def _init_process(config: RLConfig) -> None:
    """An actor process's torch state: CPU threads (Ray sets OMP_NUM_THREADS to the actor's CPUs,
    which `use_cpu_threads` honours) and the run's seed, as `RLTrainer.__init__` seeds it."""
    if config.device == "cpu":
        use_cpu_threads()
    torch.manual_seed(config.seed)


@dataclass
class RolloutBatch:
    """A step's samples on their way to the trainer (Ray's object store): packed by
    `rl/batch.py::pack` (tensors only; None when DAPO kept no group) with the weight version
    each sample was generated with, in the batch's order."""

    batch: TrainBatch | None
    weight_versions: list[int]


class TrainerWorker(RLTrainer):
    """The policy half of `RLTrainer` (see the module docstring); `plan`: the weight-sync buckets
    of its state dict."""

    def __init__(self, config: RLConfig) -> None:   # no super(): the engine half is not built
        _init_process(config)
        self._init_policy(config)
        c = self.config
        self.ops = (create_kernels(c.kernel_backend, True)  # type: ignore[arg-type]
                    if c.values_from_kernels else None)
        self.plan = plan_buckets(self.policy.state_dict(), c.sync_bucket_bytes)

    def mode(self) -> ForwardMode:
        """`RLTrainer.mode` with this actor's own kernel ops (the engine's backend and plans)."""
        return formulation_mode(self.config).with_values(self.ops)

    def sync(self) -> int:
        """No engine in this process: the driver syncs through `push_weights`."""
        return 0

    def bucket_plan(self) -> list[Bucket]:
        return self.plan

    def sync_address(self) -> str:
        import ray

        return f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"

    def join(self, address: str, world_size: int) -> None:
        join_group(address, 0, world_size, self.device, SYNC_TIMEOUT_S)

    def leave(self) -> None:
        leave_group()

    def optimize(self, rollout: RolloutBatch) -> dict[str, Any]:
        """`RLTrainer.train_step`'s optimisation of one rollout; advances the step."""
        stale = sorted(set(rollout.weight_versions) - {self.step})
        assert not stale, f"samples of weight versions {stale} at step {self.step} (on-policy)"
        record: dict[str, Any] = {"weight_version": self.step}
        if rollout.batch is None:
            record["skipped"] = True            # DAPO found no informative group
        else:
            record.update(self._optimize(rollout.batch.to(self.device)))
        self.step += 1
        return record

    @torch.no_grad()
    def push_weights(self) -> int:
        """Broadcast the policy (rank 0); returns the bytes sent."""
        num_bytes = send_weights(self.plan, self.policy.state_dict())
        logger.debug("pushed weights of step %d: %d buckets, %.1f MB", self.step, len(self.plan),
                     num_bytes / 1e6)
        return num_bytes

    def save_at(self, step: int, elapsed_s: float) -> None:
        assert step == self.step, f"the driver saves step {step}, the trainer is at {self.step}"
        self.elapsed_s = elapsed_s
        self.save()

    def restore(self) -> tuple[int, float]:
        """`RLTrainer.load` (state.pt, metrics truncated; the driver then syncs)."""
        self.load()
        return self.step, self.elapsed_s


class RolloutWorker(RLTrainer):
    """The engine half of `RLTrainer` (see the module docstring); `version`: the trainer step
    whose weights the engine serves (None before the first push)."""

    def __init__(self, config: RLConfig) -> None:   # no super(): the policy half is not built
        self.config = c = config
        _init_process(c)
        self.device = torch.device(c.device)
        self.task = make_task(c.task, c.levels)
        model_dir = Path(c.model)
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        served = load_model(model_dir, dtype=c.dtype, device=self.device,
                            weight_format=check_weight_format(c.weight_format))
        self.engine = LLMEngine(served, self.engine_config())
        self.step = 0
        self.version: int | None = None
        self.plan: list[Bucket] = []

    def ready(self) -> bool:
        return True

    def join(self, address: str, rank: int, world_size: int, plan: list[Bucket]) -> None:
        self.plan = plan
        join_group(address, rank, world_size, self.device, SYNC_TIMEOUT_S)

    def pull_weights(self, version: int) -> int:
        """Receive the trainer's broadcast into the engine; returns the bytes received."""
        num_bytes = receive_weights(self.plan, self.device, self.engine.update_weights)
        self.version = version
        return num_bytes

    def generate(self, step: int) -> tuple[RolloutBatch, dict[str, Any]]:
        """Step `step`'s samples (packed) and rollout statistics."""
        assert self.version == step, f"rollout of step {step} with weights {self.version}"
        self.step = step
        samples, stats = self.rollout()
        if not samples:
            return RolloutBatch(None, []), stats
        c = self.config
        batch = pack(samples, advantages_of(group_rewards(samples)), c.replay_routing,
                     c.replay_indexer)
        return RolloutBatch(batch, [step] * len(samples)), stats


class ColocatedWorker:
    """The local run inside one Ray actor (the colocated placement): `open_run` on the bundle's
    device, trainer and engine in this process."""

    def __init__(self, config: RLConfig, resume: bool) -> None:
        _init_process(config)
        self.trainer = open_run(config, resume)

    def run(self) -> tuple[int, dict[str, Any]]:
        last = self.trainer.run()
        return self.trainer.step, last
