"""Ray placements of `dsv4 rl run` against the local run (issue 24), on CPU with dsv4-tiny.

A 3-step true-on-policy run (fp32, GRPO with an entropy bonus so the loss is not trivially 0)
with placement "colocated" (one actor) and "disaggregated" (a trainer actor and a rollout actor
on two bundles; weights broadcast over gloo in 3 MiB buckets, so the 4 MiB expert stacks travel
alone and the small tensors share buckets) logs the local run's records: the same rewards and
samples, the drift exactly 0 at every step (the engine in another process serves the trainer's
weights byte for byte), loss / entropy / gradient norm to 1e-6, and the same final policy. The
rollout actor killed while a weight sync or a step's rollout is in flight is restarted, re-joined
and re-synced; the call is repeated and the run's records equal the undisturbed run's.

The Ray tests need `ray` (the `rl` extra) and are skipped without it; they share one Ray
instance (2 CPUs) and one local reference run. The bucket layout tests need neither; the
disaggregated run (its faults and its resumption in one run) is `slow`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dsv4.assets import default_model_path
from dsv4.rl.bucket_sync import ALIGN, pack_bucket, plan_buckets, unpack_bucket
from dsv4.rl.config import RLConfig
from dsv4.rl.placement import DisaggregatedRun, run_placed, start_placement

from .records import assert_same_records, read_records

# measured per run, not compared: timings, and each placement's own bookkeeping
UNCOMPARED = {"rollout_s", "train_s", "sync_s", "kv_released_mb", "weight_version", "sync_mb"}
EXACT = {"reward_mean", "reward_std", "accuracy", "response_len", "groups_kept",
         "samples_drawn", "train_rollout_logprob_abs_diff", "train_rollout_logprob_abs_diff_max",
         "drift_tokens", "drift_worst_position", "step", "heldout_accuracy", "heldout_by_level"}


def _config(out: Path, placement: str) -> RLConfig:
    return RLConfig(model=str(default_model_path()), out_dir=str(out), group_size=2,
                    prompts_per_step=2, steps=3, max_tokens=4, lr=1e-4, entropy_coef=0.01,
                    eval_every=10, eval_per_level=1, levels=(3,), true_on_policy=True,
                    placement=placement, sync_bucket_mb=3.0)


def _records(run: Path) -> list[dict[str, Any]]:
    return read_records(run)


def _assert_same_run(run: Path, local: Path) -> None:
    got, want = _records(run), _records(local)
    assert [r["step"] for r in got] == [0, 1, 2, 3]
    assert got[1]["train_rollout_logprob_abs_diff"] == 0.0        # step-0 drift, exactly
    assert all(r["train_rollout_logprob_abs_diff_max"] == 0.0 for r in got[1:])
    assert_same_records(got, want, UNCOMPARED, EXACT, 1e-6)
    policy = torch.load(run / "state.pt", weights_only=True)["policy"]
    reference = torch.load(local / "state.pt", weights_only=True)["policy"]
    for name, t in reference.items():
        torch.testing.assert_close(policy[name], t, rtol=0, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def ray_session() -> Iterator[Any]:
    ray = pytest.importorskip("ray", reason="the Ray placements need ray: pip install 'dsv4[rl]'")
    # a new instance per process ("local"): pytest-xdist workers must not share one
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def local_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("local") / "run"
    assert run_placed(_config(out, "local"))[0] == 3
    return out


def _assert_resources_released(ray: Any) -> None:
    deadline = time.monotonic() + 10       # the placement group is removed asynchronously
    while ray.available_resources().get("CPU") != 2.0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU") == 2.0


# "disaggregated": test_disaggregated_run_survives_rollout_deaths_and_resumes logs the local run
# with that placement (and asserts its weight versions and the returned resources)
@pytest.mark.parametrize("placement", ["colocated"])
def test_ray_placement_logs_the_local_run(ray_session: Any, local_run: Path, tmp_path: Path,
                                          placement: str) -> None:
    out = tmp_path / "run"
    step, last = run_placed(_config(out, placement))
    assert step == 3 and last["step"] == 3
    _assert_same_run(out, local_run)
    _assert_resources_released(ray_session)


class _KillOnce:
    """Wraps the submission of a call to the rollout actor: at the first call of step `at`, kills
    the actor (Ray restarts it) 0.1 s after submitting, while the call is in flight."""

    def __init__(self, ray: Any, run: Any, submit: Any, at: int) -> None:
        self.ray, self.run, self.submit, self.at = ray, run, submit, at
        self.killed_at: list[int] = []

    def __call__(self, *args: Any) -> Any:
        refs = self.submit(*args)
        if self.run.step + 1 == self.at and not self.killed_at:
            time.sleep(0.1)
            self.ray.kill(self.run.rollout_actor, no_restart=False)
            self.killed_at.append(self.at)
        return refs


# One disaggregated run covers the placement's undisturbed records, its faults and `--resume`:
# every run of that placement builds the same two actors, so one run and its resumption check
# all three (each check below holds for the run as a whole).
@pytest.mark.slow
def test_disaggregated_run_survives_rollout_deaths_and_resumes(
        ray_session: Any, local_run: Path, tmp_path: Path) -> None:
    """2 steps, then `--resume` to 3, logging the local run's records. In the first call `ray.kill`
    of the rollout actor during the weight sync that ends step 1, and again during step 2's
    rollout (one run, two restarts): each time the driver re-joins the restarted actor, pushes
    the current weights and repeats the call, losing no sample. The trainer actor saved state.pt
    (policy, AdamW, step); the resumed driver (a changed lr refused) pushes it into a fresh
    engine. Every sample was drawn with the weights of its step, and the placement group's
    resources are returned."""
    out = tmp_path / "run"
    config = _config(out, "disaggregated")
    with start_placement(config.replace(max_steps_this_call=2)) as run:
        assert isinstance(run, DisaggregatedRun)
        in_rollout = _KillOnce(ray_session, run, run._start_rollout, at=2)
        run._start_rollout = in_rollout          # type: ignore[method-assign]
        pull = run.rollout_actor.pull_weights
        in_sync = _KillOnce(ray_session, run, pull.remote, at=1)
        run.rollout_actor.pull_weights = type("Pull", (), {"remote": staticmethod(in_sync)})()
        run.run()
        assert run.step == 2
        assert in_sync.killed_at == [1] and in_rollout.killed_at == [2] and run.restarts == 2
    with pytest.raises(ValueError, match="lr"):
        run_placed(config.replace(lr=2e-4), resume=True)
    step, last = run_placed(config, resume=True)
    assert step == 3 and last["step"] == 3
    _assert_same_run(out, local_run)
    assert [r.get("weight_version") for r in _records(out)[1:]] == [0, 1, 2]
    _assert_resources_released(ray_session)


def test_bucket_plan_layout_and_round_trip() -> None:
    """Buckets keep the state's order, stay within the size unless one tensor is larger, align
    every tensor, may mix dtypes, and unpack to the packed tensors bit for bit."""
    g = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(3, 5, generator=g), "b": torch.randn(7, generator=g).bfloat16(),
             "big": torch.randn(64, 64, generator=g), "ids": torch.arange(9),
             "flag": torch.tensor([True, False, True]), "scalar": torch.tensor(2.5),
             "empty": torch.zeros(0, 4)}
    limit = 256
    plan = plan_buckets(state, limit)
    assert [e.name for b in plan for e in b.entries] == list(state)
    for b in plan:
        assert b.num_bytes <= limit or len(b.entries) == 1
        assert all(e.offset % ALIGN == 0 for e in b.entries)
    assert any(len({e.dtype for e in b.entries}) > 1 for b in plan)
    out = torch.full((max(b.num_bytes for b in plan),), 255, dtype=torch.uint8)
    for b in plan:
        got = unpack_bucket(b, pack_bucket(b, state, out).clone())
        for name, t in got.items():
            assert t.dtype == state[name].dtype and torch.equal(t, state[name]), name
    with pytest.raises(ValueError, match="bucket_bytes=0 is invalid"):
        plan_buckets(state, 0)


def test_placement_is_validated_and_a_flag() -> None:
    from dsv4.cli.main import build_parser
    from dsv4.cli.rl import config_from_args

    with pytest.raises(ValueError, match=r"placement='ray' is unknown; allowed: \['local'"):
        RLConfig(model="m", out_dir="o", placement="ray")
    with pytest.raises(ValueError, match="sync_bucket_mb=0"):
        RLConfig(model="m", out_dir="o", sync_bucket_mb=0)
    args = build_parser().parse_args(["rl", "run", "--out", "o", "--placement", "disaggregated",
                                      "--sync-bucket-mb", "64"])
    config = config_from_args(args)
    assert (config.placement, config.sync_bucket_bytes) == ("disaggregated", 64 * 2**20)
    assert RLConfig.from_dict(config.to_dict()) == config
    assert not config.replace(placement="local").changed_fields(config)  # may change on resume
