"""Where the RL loop runs: in this process, or as Ray actors in one placement group.

`RLConfig.placement` picks it; `run_placed` runs (or resumes) a run with it:

* "local" (the default; no Ray): `RLTrainer` in this process (`trainer.open_run(...).run()`).
* "servers" (no Ray): `server_trainer.ServerTrainer` in this process, the rollouts on running
  `dsv4 serve` instances (`RLConfig.rollout_urls`).
* "colocated": the same run inside one Ray actor (`workers.ColocatedWorker`) on the group's
  single bundle: trainer and engine share the bundle's device and one process, the engine's KV
  pools are released while the trainer steps, and the weight sync is the in-process
  `LLMEngine.update_weights`. (A trainer and an engine in two processes on one GPU would pass
  CUDA IPC handles; in one process there is nothing to pass.)
* "disaggregated": a `workers.TrainerWorker` and a `workers.RolloutWorker` actor on two bundles
  (two processes, two devices), driven by `DisaggregatedRun`. A step:

      rollout actor  generate(step) -> RolloutBatch (packed TrainBatch + weight versions) into
                                       Ray's object store; its statistics to the driver
      trainer actor  optimize(ref)  <- the batch from the object store (not via the driver)
      both           sync           the trainer broadcasts its fp32 policy in buckets of
                                    `sync_bucket_mb` MiB over a torch.distributed group (gloo
                                    on CPU, NCCL on CUDA: `rl/bucket_sync.py`); the engine
                                    applies each bucket with `LLMEngine.update_weights`

Every placement logs the local run's records (all but the timings and each placement's own
keys): the actors run `RLTrainer`'s own methods (`rl/workers.py`) and `DisaggregatedRun` is an
`RLTrainer` whose `train_step` / `evaluate` / `save` / `load` call the actors, so its loop is
`RLTrainer.run` itself. Rollouts depend only on (seed, step) and the weights, and the weights
reach the engine byte for byte: in true-on-policy mode the drift stays exactly 0 across
processes, as in one.

Faults (disaggregated): the rollout actor restarts (Ray `max_restarts`: `ROLLOUT_MAX_RESTARTS`).
When it dies during a rollout, an evaluation or a sync, the driver re-forms the sync group with
the restarted process, pushes the current weights and submits the call again: the step's prompts
are generated again and, rollouts depending only on (seed, step) and the weights, the samples are
the ones the lost call would have returned (none lost, none doubled). More restarts, or a dead
trainer actor, stop the run with Ray's error; `state.pt` keeps the last saved step and
`--resume` continues from it.

Ray is optional (`pip install 'dsv4[rl]'`) and imported inside the functions that use it: this
module and "local" work without it. A Ray instance this process already initialised is used
(e.g. `ray.init(address=...)` to a cluster before `run_placed`); otherwise a new local one is
started for the run (`num_cpus` = the bundles' CPUs, no dashboard) and shut down after it.

Test: `pytest tests/rl/test_placement.py`.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from dsv4.rl.bucket_sync import Bucket
from dsv4.rl.config import RLConfig
from dsv4.rl.trainer import RLTrainer, open_run
from dsv4.rl.workers import ColocatedWorker, RolloutWorker, TrainerWorker
from dsv4.utils.logging import init_logger
from dsv4.utils.run_dir import STATE

logger = init_logger(__name__)

ROLLOUT_MAX_RESTARTS = 3
"""How often the rollout actor may die and be restarted within one run."""
READY_TIMEOUT_S = 300.0
"""How long the placement group may wait for its resources, and the driver for a restarted
rollout actor, before the run gives up."""
CPUS_PER_BUNDLE = 1

ActorHandle = Any   # ray.actor.ActorHandle (ray is imported lazily)
ObjectRef = Any     # ray.ObjectRef


class DisaggregatedRun(RLTrainer):
    """The driver of the disaggregated placement: `RLTrainer.run`'s loop (evaluation cadence,
    time limit, metrics, the final save) over a `TrainerWorker` and a `RolloutWorker` actor.
    Connects them and pushes the initial policy (version 0) on construction. `restarts`: how
    often the rollout actor died and was re-joined."""

    def __init__(self, config: RLConfig, trainer: ActorHandle,
                 rollout: ActorHandle) -> None:   # no super(): the actors hold the halves
        import ray

        self.config = config
        self.run_dir = Path(config.out_dir)
        self.trainer_actor, self.rollout_actor = trainer, rollout
        self.step, self.elapsed_s = 0, 0.0
        self.restarts = 0
        self.plan: list[Bucket] = ray.get(trainer.bucket_plan.remote())
        self._connect()
        self._sync(0)

    def train_step(self) -> dict[str, Any]:
        import ray

        t0 = time.perf_counter()
        (batch, _), record = self._on_rollout_actor(self._start_rollout)
        t1 = time.perf_counter()
        record.update(ray.get(self.trainer_actor.optimize.remote(batch)))
        t2 = time.perf_counter()
        record["sync_mb"] = round(self._sync(self.step + 1) / 1e6, 1)
        t3 = time.perf_counter()
        self.step += 1
        record.update(step=self.step, rollout_s=round(t1 - t0, 4), train_s=round(t2 - t1, 4),
                      sync_s=round(t3 - t2, 4))
        return record

    def _start_rollout(self) -> list[ObjectRef]:
        """Submit this step's rollout: [the RolloutBatch's ref, the statistics' ref]."""
        return list(self.rollout_actor.generate.options(num_returns=2).remote(self.step))

    def evaluate(self) -> dict[str, Any]:
        _, result = self._on_rollout_actor(lambda: [self.rollout_actor.evaluate.remote()])
        return dict(result)

    def save(self) -> None:
        import ray

        ray.get(self.trainer_actor.save_at.remote(self.step, self.elapsed_s))

    def load(self) -> None:
        import ray

        self.step, self.elapsed_s = ray.get(self.trainer_actor.restore.remote())
        self._sync(self.step)

    # --- the rollout actor's faults ----------------------------------------------------------
    def _on_rollout_actor(self, submit: Callable[[], list[ObjectRef]]
                          ) -> tuple[list[ObjectRef], Any]:
        """`submit()` a call to the rollout actor and wait for its last result (the others stay
        in the object store); when the actor dies meanwhile, re-join it once restarted, push the
        current weights and submit again. Returns (the refs, the last one's value)."""
        import ray
        from ray.exceptions import RayActorError

        while True:
            refs = submit()
            try:
                return refs, ray.get(refs[-1])
            except RayActorError as err:
                self._rejoin(err)
                self._sync(self.step)

    def _sync(self, version: int) -> int:
        """The trainer's weights into the engine as `version` (re-joined and pushed again if the
        rollout actor dies meanwhile); returns the bytes sent."""
        import ray
        from ray.exceptions import RayActorError

        while True:
            push = self.trainer_actor.push_weights.remote()
            pull = self.rollout_actor.pull_weights.remote(version)
            try:
                ray.get(pull)
            except RayActorError as err:
                ray.wait([push])      # the broadcast ends: sent into the void, or failed
                self._rejoin(err)
                continue
            return int(ray.get(push))

    def _rejoin(self, err: Exception) -> None:
        """Count a death of the rollout actor (raising past `ROLLOUT_MAX_RESTARTS`) and form the
        sync group again with its restarted process."""
        import ray

        self.restarts += 1
        if self.restarts > ROLLOUT_MAX_RESTARTS:
            raise RuntimeError(f"the rollout actor died {self.restarts} times; allowed: "
                               f"{ROLLOUT_MAX_RESTARTS} restarts per run") from err
        logger.warning("the rollout actor died after step %d (%s); restart %d of %d: re-joining "
                       "it and pushing the weights again", self.step, type(err).__name__,
                       self.restarts, ROLLOUT_MAX_RESTARTS)
        ray.get(self.trainer_actor.leave.remote())
        self._wait_for_rollout_actor()
        self._connect()

    def _wait_for_rollout_actor(self) -> None:
        """Until the restarted rollout actor answers (calls to a restarting actor fail at once
        with ActorUnavailableError); a permanently dead one raises ActorDiedError."""
        import ray
        from ray.exceptions import ActorUnavailableError

        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                ray.get(self.rollout_actor.ready.remote())
                return
            except ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def _connect(self) -> None:
        """Form the sync group: the trainer (rank 0) and the engine (rank 1) join together."""
        import ray

        address = ray.get(self.trainer_actor.sync_address.remote())
        engine = self.rollout_actor.join.remote(address, 1, 2, self.plan)
        trainer = self.trainer_actor.join.remote(address, 2)
        ray.get(engine)                # first: a dead rollout actor raises here
        ray.get(trainer)


class ColocatedRun:
    """The driver of the colocated placement: the whole loop runs in the actor."""

    def __init__(self, worker: ActorHandle) -> None:
        self.worker = worker
        self.step = 0

    def run(self) -> dict[str, Any]:
        import ray

        self.step, last = ray.get(self.worker.run.remote())
        return dict(last)


# ---- the placement group ------------------------------------------------------------------------


def run_placed(config: RLConfig, resume: bool = False) -> tuple[int, dict[str, Any]]:
    """Run (or resume) `config`'s run with its placement; returns (the step reached, the last
    logged record)."""
    if config.placement in ("local", "servers"):
        if config.placement == "servers":
            from dsv4.rl.server_trainer import ServerTrainer
            trainer = open_run(config, resume, ServerTrainer)
        else:
            trainer = open_run(config, resume)
        try:
            last = trainer.run()
        finally:
            trainer.close()
        return trainer.step, last
    with start_placement(config, resume) as run:
        last = run.run()
        return run.step, last


def check_run_dir(config: RLConfig, resume: bool) -> None:
    """`open_run`'s checks, before any actor starts: a fresh run refuses a directory holding a
    run; a resumed one needs its state.pt and the same config but for the invocation fields."""
    run_dir = Path(config.out_dir)
    if not resume:
        if (run_dir / STATE).exists():
            raise FileExistsError(f"{run_dir} already holds a run; "
                                  "pass --resume or choose another --out")
        return
    if not (run_dir / STATE).exists():
        raise FileNotFoundError(f"--resume: no state.pt in {run_dir}")
    saved = RLConfig.from_dict(json.loads((run_dir / "rl_config.json").read_text()))
    changed = saved.changed_fields(config)
    if changed:
        raise ValueError(f"--resume: {changed} differ from the run's rl_config.json; only "
                         f"{list(RLConfig.INVOCATION_FIELDS)} may change")


@contextlib.contextmanager
def start_placement(config: RLConfig, resume: bool = False
                    ) -> Iterator[ColocatedRun | DisaggregatedRun]:
    """The run's actors on a new placement group, as a driver with `run()` and `step`; the
    actors, the group and a Ray instance started here are gone on exit."""
    if config.placement in ("local", "servers"):
        raise ValueError(f"placement={config.placement!r} runs without Ray; allowed here: "
                         "'colocated', 'disaggregated'")
    try:
        import ray
    except ImportError as err:
        raise ImportError(f"placement={config.placement!r} needs Ray: pip install 'dsv4[rl]' "
                          "(or run with placement 'local')") from err
    from ray.util.placement_group import placement_group, remove_placement_group

    check_run_dir(config, resume)
    num_bundles = 1 if config.placement == "colocated" else 2
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=num_bundles * CPUS_PER_BUNDLE,
                 include_dashboard=False)
    group = placement_group([_bundle(config)] * num_bundles, strategy="PACK")
    actors: list[ActorHandle] = []
    try:
        _wait_ready(group, num_bundles)
        if config.placement == "colocated":
            actors = [_actor(ColocatedWorker, config, group, 0).remote(config, resume)]
            yield ColocatedRun(actors[0])
        else:
            actors = [_actor(TrainerWorker, config, group, 0).remote(config),
                      _actor(RolloutWorker, config, group, 1,
                             max_restarts=ROLLOUT_MAX_RESTARTS).remote(config)]
            run = DisaggregatedRun(config, *actors)
            if resume:
                run.load()
            yield run
    finally:
        for actor in actors:
            ray.kill(actor)
        remove_placement_group(group)
        if started:
            ray.shutdown()


def _bundle(config: RLConfig) -> dict[str, float]:
    """One bundle: a CPU, and the GPU of a CUDA run."""
    cuda = torch.device(config.device).type == "cuda"
    return {"CPU": CPUS_PER_BUNDLE, **({"GPU": 1} if cuda else {})}


def _actor(cls: type, config: RLConfig, group: Any, bundle: int, **options: Any) -> Any:
    """`cls` as a Ray actor class pinned to `bundle` of `group` (all of the bundle's
    resources)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle)
    resources = _bundle(config)
    return ray.remote(cls).options(num_cpus=resources["CPU"], num_gpus=resources.get("GPU", 0),
                                   scheduling_strategy=strategy, **options)


def _wait_ready(group: Any, num_bundles: int) -> None:
    import ray
    from ray.exceptions import GetTimeoutError

    try:
        ray.get(group.ready(), timeout=READY_TIMEOUT_S)
    except GetTimeoutError:
        raise RuntimeError(f"the placement group of {num_bundles} bundles was not scheduled in "
                           f"{READY_TIMEOUT_S:.0f} s; Ray has {ray.available_resources()}"
                           ) from None
