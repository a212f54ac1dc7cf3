"""`dsv4 rl run` end to end on CPU (dsv4-tiny, the CI smoke run of issue 18) and its bad inputs.

The 20-step run checks: rewards are computed, the loss is finite, the weights change, the engine
serves the synced weights (its log-probs of a fixed sequence equal the trainer's), the metrics
and plot are written, and `--resume` refuses a changed config without touching the run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dsv4.assets import default_model_path
from dsv4.cli.main import main
from dsv4.engine.sampling_params import SamplingParams
from dsv4.kernels.ref.batch_invariant import batch_invariant
from dsv4.model.forward_mode import INFERENCE
from dsv4.model.loader import load_model
from dsv4.rl.config import RLConfig
from dsv4.rl.objective import sequence_logprobs
from dsv4.rl.trainer import RLTrainer, open_run

# 2 prompts x 4 samples a step: groups wide enough for informative rewards, the 20 steps cheap
SMOKE = ["--group-size", "4", "--prompts-per-step", "2", "--max-tokens", "6", "--lr", "1e-4",
         "--eval-every", "10", "--eval-per-level", "1", "--levels", "3-5", "--true-on-policy"]


def _engine_logprobs(trainer: RLTrainer, ids: list[int]) -> tuple[list[int], list[float]]:
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=7, logprobs=0,
                            scaled_logprobs=True, ignore_eos=True)
    req = trainer.engine.add_request(ids, params)
    while trainer.engine.has_unfinished():
        trainer.engine.step()
    done = trainer.engine.pop(req.rid)
    return done.output_ids, done.logprobs


@pytest.mark.slow
def test_twenty_step_cpu_smoke_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main(["rl", "run", "--out", str(out), "--steps", "20", *SMOKE]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] > 0 and "loss" in r]
    assert len(steps) == 20
    assert all(math.isfinite(r["loss"]) for r in steps)
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in steps)
    assert any(0.0 < r["reward_mean"] < 1.0 for r in steps), "rewards never informative"
    assert all(r["train_rollout_logprob_abs_diff"] == 0.0 for r in steps)
    assert "heldout_by_level" in records[0] and "heldout_by_level" in records[-1]
    assert (out / "rl.png").stat().st_size > 0

    initial = load_model(default_model_path(), dtype="float32", device="cpu").state_dict()
    state = torch.load(out / "state.pt", weights_only=True)
    changed = [n for n, t in state["policy"].items() if not torch.equal(t, initial[n])]
    assert changed, "the policy did not change"

    # the engine serves the synced weights: its sampling log-probs equal the trainer's forward
    config = RLConfig.from_dict(json.loads((out / "rl_config.json").read_text()))
    trainer = open_run(config.replace(steps=20), resume=True)
    ids = list(trainer.tokenizer.encode("What is 12+34?").ids)
    out_ids, engine_lp = _engine_logprobs(trainer, ids)
    seq = torch.tensor([ids + out_ids])
    with torch.no_grad(), batch_invariant():
        logp, _ = sequence_logprobs(trainer.policy, seq[:, :-1], seq[:, 1:],
                                    INFERENCE.with_replay(None, fixed_widths=True), 1.0)
    assert logp[0, len(ids) - 1:].tolist() == engine_lp

    # resume with a changed config: refused, the run untouched
    before = (out / "state.pt").read_bytes()
    with pytest.raises(ValueError, match="lr"):
        main(["rl", "run", "--out", str(out), "--steps", "20", "--resume",
              *[("2e-4" if a == "1e-4" else a) for a in SMOKE]])
    assert (out / "state.pt").read_bytes() == before


@pytest.mark.parametrize(("args", "message"), [
    (["--task", "chess"], "task='chess' is unknown"),
    (["--algo", "ppo"], "algo='ppo' is unknown"),
    (["--group-size", "1"], "group_size=1 is invalid"),
    (["--replay", "experts"], "replay='experts' is invalid"),
    (["--mis", "2,1"], "mis="),
    (["--levels", "9"], "levels"),
    (["--formulation", "fast"], "formulation='fast' is invalid"),
    (["--formulation", "training", "--true-on-policy"], "invalid with true_on_policy"),
])
def test_bad_run_arguments_are_clear_errors(tmp_path: Path, args: list[str],
                                            message: str) -> None:
    with pytest.raises(ValueError, match=message):
        main(["rl", "run", "--out", str(tmp_path / "r"), *args])
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(("kw", "values", "fixed", "exact"), [
    ({}, False, False, False),                                   # CPU: the ref formulation
    ({"true_on_policy": True}, False, True, True),               # ref ops: fixed-width rows
    ({"kernel_backend": "triton"}, True, False, True),           # GPU default: exact, kernels
    ({"kernel_backend": "triton", "true_on_policy": False}, True, False, False),
    ({"kernel_backend": "triton", "true_on_policy": True, "formulation": "training"}, True,
     False, True),                                               # values from the kernels
    ({"kernel_backend": "triton", "kernel_values": False}, False, False, False),
])
def test_where_the_trainer_takes_its_values(kw: dict, values: bool, fixed: bool,
                                            exact: bool) -> None:
    """`true_on_policy` None resolves to `values_from_kernels` (exact on a fused backend), once:
    the saved config holds the bool, so a resumed run compares equal."""
    config = RLConfig(model="m", out_dir="o", **kw)
    assert (config.values_from_kernels, config.fixed_widths) == (values, fixed)
    assert config.true_on_policy is exact
    assert RLConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(("flags", "exact"), [
    ([], False), (["--kernel-backend", "triton"], True),
    (["--kernel-backend", "triton", "--no-true-on-policy"], False),
    (["--kernel-backend", "triton", "--no-kernel-values"], False), (["--true-on-policy"], True)])
def test_true_on_policy_flag_defaults_to_the_backend(flags: list[str], exact: bool) -> None:
    from dsv4.cli.main import build_parser
    from dsv4.cli.rl import config_from_args

    args = build_parser().parse_args(["rl", "run", "--out", "o", *flags])
    assert config_from_args(args).true_on_policy is exact


def test_resume_needs_a_run(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no state.pt"):
        main(["rl", "run", "--out", str(tmp_path), "--resume"])


def test_bf16_compute_copy_tracks_the_master_weights(tmp_path: Path) -> None:
    """A bf16 engine: the trainer's forward runs on a bf16 copy cast like the engine's weights;
    after a step the copy equals the fp32 master cast again, the engine serves it, and the
    engine's log-probs agree with the trainer's within the documented bf16 tolerance (<= 0.1 max,
    <= 0.02 mean nats per token)."""
    config = RLConfig(model=str(default_model_path()), out_dir=str(tmp_path), group_size=4,
                      prompts_per_step=4, steps=1, lr=1e-4, dtype="bfloat16", levels=(3,))
    trainer = RLTrainer(config)
    record = trainer.train_step()
    assert record["grad_norm"] > 0
    served = trainer.engine.runner.model.state_dict()
    for (name, master), copy in zip(trainer.policy.state_dict().items(),
                                    trainer.compute.state_dict().values(), strict=True):
        assert torch.equal(copy, master.to(copy.dtype)), name
        assert torch.equal(served[name], copy), name

    # bf16 tolerance of the synced engine against the trainer (greedy, teacher-forced; ref backend
    # on CPU): measured 0, 0 and 0.028 max / 0.0049 mean nats on these prompts
    worst, means = 0.0, []
    for prompt in ("What is 12+34?", "def f(x):", "import os\n"):
        ids = list(trainer.tokenizer.encode(prompt).ids)
        req = trainer.engine.add_request(ids, SamplingParams(max_tokens=8, temperature=0.0,
                                                             logprobs=0, ignore_eos=True))
        while trainer.engine.has_unfinished():
            trainer.engine.step()
        done = trainer.engine.pop(req.rid)
        seq = torch.tensor([ids + done.output_ids])
        with torch.no_grad():
            logp, _ = sequence_logprobs(trainer.compute, seq[:, :-1], seq[:, 1:], INFERENCE, 1.0)
        diff = (logp[0, len(ids) - 1:] - torch.tensor(done.logprobs)).abs()
        worst, means = max(worst, float(diff.max())), means + [float(diff.mean())]
    assert worst <= 0.1 and max(means) <= 0.02, (worst, means)


def test_engine_releases_and_restores_its_kv_memory() -> None:
    """release_memory frees the pools (refused with requests in flight); after resume_memory the
    engine generates exactly what a fresh engine generates."""
    from dsv4.config.engine import EngineConfig
    from dsv4.engine.engine import LLMEngine

    def engine() -> LLMEngine:
        model = load_model(default_model_path(), dtype="float32", device="cpu")
        return LLMEngine(model, EngineConfig(page_size=128, max_total_tokens=2048))

    def greedy(e: LLMEngine) -> list[int]:
        req = e.add_request([5, 9, 13, 17], SamplingParams(max_tokens=5, temperature=0.0))
        while e.has_unfinished():
            e.step()
        return e.pop(req.rid).output_ids

    fresh, reused = engine(), engine()
    expected = greedy(fresh)
    greedy(reused)
    reused.add_request([5, 9], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="in flight"):
        reused.release_memory()
    while reused.has_unfinished():
        reused.step()
    assert reused.release_memory() > 0 and reused.runner.memory_released
    reused.resume_memory()
    assert greedy(reused) == expected
    reused.check_integrity()


# the TIS / MIS / KL / entropy terms run in the real loop in
# test_fp8_index_keys_reach_the_engine_and_the_trainer (its trainer has the KL reference)
@pytest.mark.parametrize("extra", [{"algo": "dapo"}], ids=["dapo"])
def test_algorithm_options_run_a_step(tmp_path: Path, extra: dict) -> None:
    """DAPO's dynamic sampling in the real loop."""
    config = RLConfig(model=str(default_model_path()), out_dir=str(tmp_path), group_size=4,
                      prompts_per_step=3, steps=1, lr=1e-5, levels=(3,), **extra)
    record = RLTrainer(config).train_step()
    assert math.isfinite(record.get("loss", 0.0))
    assert record["groups_kept"] <= 3 and record["samples_drawn"] >= 12
    assert record["samples_drawn"] % 12 == 0          # whole over-sampling rounds


# a 3-step true-on-policy run, saved after every step and evaluated every 2 (and at the last
# step): the resume tests' uninterrupted reference (`save_every` is an invocation field: it
# changes no record)
RESUME_ARGS = ["--steps", "3", "--save-every", "1", "--eval-every", "2", "--group-size", "2",
               "--prompts-per-step", "2", "--max-tokens", "4", "--eval-per-level", "1",
               "--levels", "3", "--lr", "1e-4", "--true-on-policy"]


def _records_but_timings(run: Path) -> list[dict]:
    drop = ("rollout_s", "train_s", "sync_s")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in drop} for r in rows]


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run of `RESUME_ARGS`, shared by the resume tests."""
    out = tmp_path_factory.mktemp("rl_whole") / "whole"
    assert main(["rl", "run", "--out", str(out), *RESUME_ARGS]) == 0
    return out


@pytest.mark.slow
def test_resumed_run_equals_the_uninterrupted_one(whole_run: Path, tmp_path: Path) -> None:
    """Rollouts depend on (seed, step) and state.pt holds the rest: 2 + 1 resumed steps (the cut
    at an evaluation) log what 3 uninterrupted steps log (true on-policy on CPU: bit for bit)."""
    split = str(tmp_path / "split")
    assert main(["rl", "run", "--out", split, "--max-steps-this-call", "2", *RESUME_ARGS]) == 0
    assert main(["rl", "run", "--out", split, "--resume", *RESUME_ARGS]) == 0
    assert _records_but_timings(tmp_path / "split") == _records_but_timings(whole_run)


def test_a_run_out_of_time_ends_with_an_evaluation(tmp_path: Path) -> None:
    """The held-out accuracy is measured where the time limit stops a run (here after 1 of 3
    steps, off the eval_every grid), so a time-limited run reports where it ended."""
    config = RLConfig(model=str(default_model_path()), out_dir=str(tmp_path), group_size=2,
                      prompts_per_step=2, steps=3, max_tokens=4, eval_every=10,
                      eval_per_level=2, levels=(3,), time_limit_s=1e-6)
    last = RLTrainer(config).run()
    assert last["step"] == 1 and "heldout_by_level" in last


@pytest.mark.slow
def test_a_killed_trainer_resumes_from_its_last_checkpoint(whole_run: Path,
                                                            tmp_path: Path) -> None:
    """`dsv4 rl run --save-every 1` killed (SIGKILL) after its second step: `--resume` continues
    from the last state.pt (written atomically every step) and the run logs what an undisturbed
    run logs (true on-policy on CPU: bit for bit)."""
    killed = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src"),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dsv4", "rl", "run", "--out", str(killed),
                             *RESUME_ARGS], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    metrics = killed / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and '"step": 2' in metrics.read_text():
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.kill()
    proc.wait()
    saved = torch.load(killed / "state.pt", weights_only=True)["step"]
    assert 1 <= saved < 3, saved
    assert main(["rl", "run", "--out", str(killed), "--resume", *RESUME_ARGS]) == 0
    assert _records_but_timings(killed) == _records_but_timings(whole_run)


def test_fp8_index_keys_reach_the_engine_and_the_trainer(tmp_path: Path) -> None:
    """`index_cache_dtype="fp8"`: the rollout engine's indexer-key pools are FP8 and every model
    of the trainer (policy, the KL reference) rounds its indexer's keys and queries as they do, so
    a run that replays only the routing selects its C4 entries as the rollouts did. Its step also
    runs the TIS / MIS / KL / entropy terms of the loss in the real loop."""
    from dsv4.model.indexer import Indexer
    from dsv4.rl.server_trainer import server_knobs

    config = RLConfig(model=str(default_model_path()), out_dir=str(tmp_path), group_size=2,
                      prompts_per_step=2, steps=1, levels=(3,), kl_coef=0.1, replay="routing",
                      index_cache_dtype="fp8", tis=2.0, mis=(0.5, 2.0), entropy_coef=0.01)
    trainer = RLTrainer(config)
    pools = [c for c in trainer.engine.runner.pools.layers if c.index_keys is not None]
    assert pools and all(c.index_keys is not None and c.index_keys.dtype == torch.float8_e4m3fn
                         for c in pools)
    assert trainer.reference is not None
    for model in (trainer.policy, trainer.compute, trainer.reference):
        assert all(m.fp8 for m in model.modules() if isinstance(m, Indexer))
    assert server_knobs(config)["index_cache_dtype"] == "fp8"
    record = trainer.train_step()
    assert math.isfinite(record.get("loss", 0.0))
    assert 0.0 <= record["tis_clip_frac"] <= 1.0 and 0.0 <= record["mis_mask_frac"] <= 1.0
    assert record["kl_k3"] >= 0.0
    with pytest.raises(ValueError, match="index_cache_dtype='fp4' is invalid"):
        RLConfig(model="m", out_dir="o", index_cache_dtype="fp4")
    # unset: the engine's default for the run's device and backend, recorded in the config
    assert RLConfig(model="m", out_dir="o").index_cache_dtype == "model"
    assert RLConfig(model="m", out_dir="o", device="cuda:0",
                    kernel_backend="triton").index_cache_dtype == "fp8"
