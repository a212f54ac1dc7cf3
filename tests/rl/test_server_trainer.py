"""The "servers" placement (`rl/server_trainer.py`, issue 24): an RL run whose rollouts and
evaluations go to a real `dsv4 serve --enable-return-routing` on loopback, its weights pushed over
a gloo weight-update group after every step, logs the local run's records on dsv4-tiny: the same
samples and rewards at every step (so the pushed weights are the trainer's), losses and drift to
fp32 summation order (the server batches on its own), and the same final policy to 1e-5, also when
the server releases its memory around each step (`rollout_colocated`); through a
`--batch-invariant` server a true-on-policy run's drift is exactly 0; a `--tp-size 2 --ep-size 2`
server serves the run as one process does. A server killed mid-run is
dropped and the run goes on unchanged. A server that runs other knobs than the run's engine would
is refused by name before any group forms."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from dsv4.assets import default_model_path
from dsv4.rl.config import RLConfig
from dsv4.rl.placement import run_placed
from dsv4.rl.server_trainer import RolloutServers, ServerTrainer
from server.conftest import ServerProcess, running_server

from .records import assert_same_records, read_records

# timings, each placement's own bookkeeping, and where the fp32-noise drift peaks (not true
# on-policy: which tokens exceed the drift threshold follows the batches' summation order)
UNCOMPARED = {"rollout_s", "train_s", "sync_s", "kv_released_mb", "drift_tokens",
              "drift_worst_position"}
EXACT = {"reward_mean", "reward_std", "accuracy", "response_len", "groups_kept",
         "samples_drawn", "step", "heldout_accuracy", "heldout_by_level"}


def _config(out: Path, urls: tuple[str, ...] = (), **kw: Any) -> RLConfig:
    return RLConfig(model=str(default_model_path()), out_dir=str(out), group_size=2,
                    prompts_per_step=2, steps=2, max_tokens=4, lr=1e-4, entropy_coef=0.01,
                    eval_every=10, eval_per_level=1, levels=(3,), sync_bucket_mb=3.0,
                    placement="servers" if urls else "local", rollout_urls=urls, **kw)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory.mktemp("rl_server"), "--model",
                        str(default_model_path()), "--enable-return-routing",
                        "--shutdown-timeout", "2") as s:
        yield s


@pytest.fixture(scope="module")
def second(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A second server, `--tp-size 2 --ep-size 2` (issue 24's rollout engines with TP / EP: its
    rank 0 joins the weight group and hands each rank its part of every push): it serves the
    two-server run, which kills it (its only user)."""
    with running_server(tmp_path_factory.mktemp("rl_server2"), "--model",
                        str(default_model_path()), "--tp-size", "2", "--ep-size", "2",
                        "--torch-threads", "1", "--enable-return-routing",
                        "--shutdown-timeout", "2") as s:
        yield s


def test_config_needs_urls_with_servers_only(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"rollout_urls=\[\] with placement='servers'"):
        RLConfig(model="m", out_dir=str(tmp_path), placement="servers")
    with pytest.raises(ValueError, match=r"with placement='local' is invalid"):
        RLConfig(model="m", out_dir=str(tmp_path), rollout_urls=("http://127.0.0.1:1",))


@pytest.fixture(scope="module")
def local_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("rl_local") / "run"
    run_placed(_config(out))
    return out


# One two-server run checks the tensor-parallel server, the 3-rank weight group and the loss of
# a server: the run is the local run's until the kill (step 1 and the evaluation at step 0 dealt
# over both servers, two pushes through the 3-rank group), and after it.
@pytest.mark.slow
def test_servers_run_equals_the_local_run_and_drops_a_dead_server(
        srv: ServerProcess, second: ServerProcess, local_run: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two servers (`second` is a `--tp-size 2 --ep-size 2` one: the weight group has 3 ranks,
    and the groups are dealt over both; one server alone runs in the resume test). The second is
    killed (SIGKILL) before step 2's rollout, once both serve the weights pushed at the start and
    after step 1: that rollout's requests go to the first server, which forms the weight group
    again alone, and the run logs what the undisturbed run logs (the rollouts' routing included,
    the replay's input), with the same final policy."""
    doomed = second
    urls = [srv.url, doomed.url]
    generate = ServerTrainer._generate

    def label(url: str) -> str:
        r = httpx.post(f"{url}/generate", timeout=60.0, json={
            "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}})
        return str(r.json()["meta_info"]["weight_version"])

    def kill_before_step_2(self: ServerTrainer, *args: Any, **kw: Any) -> Any:
        if self.step == 1 and doomed.proc.poll() is None:
            assert [label(url) for url in urls] == ["2", "2"], "pushed at start and after step 1"
            doomed.stop(signal.SIGKILL)
        return generate(self, *args, **kw)

    monkeypatch.setattr(ServerTrainer, "_generate", kill_before_step_2)
    served = tmp_path / "servers"
    step, last = run_placed(_config(served, tuple(urls)))
    assert step == 2 and last["step"] == 2
    assert doomed.proc.returncode == -signal.SIGKILL
    assert label(srv.url) == "3", "pushed at start and after 2 steps"
    got = read_records(served)
    assert [r["step"] for r in got] == [0, 1, 2]
    assert_same_records(got, read_records(local_run), UNCOMPARED, EXACT, 1e-5)
    policy = torch.load(served / "state.pt", weights_only=True)["policy"]
    reference = torch.load(local_run / "state.pt", weights_only=True)["policy"]
    for name, t in reference.items():
        torch.testing.assert_close(policy[name], t, rtol=0, atol=1e-5, msg=name)


# One run on `srv` checks both `--resume` and `rollout_colocated`: each builds the same
# ServerTrainer on one server, and the release / resume calls wrap every step of either call.
@pytest.mark.slow
def test_a_resumed_colocated_servers_run_continues_the_run(
        srv: ServerProcess, local_run: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Stopped after step 1 and resumed (`--resume`: the restored policy pushed again), the run
    logs what the uninterrupted run logs. `rollout_colocated`: the server frees its KV pools
    before each optimizer step and allocates them again before the push (its replies say so)."""
    replies: list[str] = []
    release = RolloutServers.release

    def recorded(self: RolloutServers, resume: bool = False) -> list[str]:
        replies.extend(release(self, resume))
        return replies[-len(self.urls):]

    monkeypatch.setattr(RolloutServers, "release", recorded)
    out = tmp_path / "run"
    config = _config(out, (srv.url,), rollout_colocated=True)
    assert run_placed(config.replace(max_steps_this_call=1))[0] == 1
    assert [r.split()[0] for r in replies] == ["released", "KV"], replies
    assert run_placed(config, resume=True)[0] == 2
    assert [r.split()[0] for r in replies] == ["released", "KV"] * 2, replies
    assert all("resumed" in r for r in replies[1::2])
    got = read_records(out)
    assert [r["step"] for r in got] == [0, 1, 2]
    assert_same_records(got, read_records(local_run), UNCOMPARED, EXACT, 1e-5)
    with pytest.raises(ValueError, match="rollout_colocated=True with placement='local'"):
        _config(tmp_path / "bad", rollout_colocated=True)


@pytest.mark.slow
def test_true_on_policy_through_a_batch_invariant_server(tmp_path: Path) -> None:
    """`dsv4 serve --batch-invariant` and a true-on-policy run: the trainer's log-probs equal the
    server's sampling log-probs bit for bit at every step (drift exactly 0), across processes
    and whatever the server's batches."""
    with running_server(tmp_path, "--model", str(default_model_path()),
                        "--enable-return-routing", "--batch-invariant",
                        "--shutdown-timeout", "2") as s:
        run_placed(_config(tmp_path / "run", (s.url,), true_on_policy=True))
    records = read_records(tmp_path / "run")[1:]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["train_rollout_logprob_abs_diff_max"] == 0.0 for r in records), records


def test_a_refused_join_fails_at_once(srv: ServerProcess) -> None:
    """A server that refuses to join (here: a group of that name already joined) fails `open` at
    once with its answer, not at the group's 600 s timeout."""
    first = RolloutServers((srv.url,), torch.device("cpu"))
    first.open()
    try:
        second = RolloutServers((srv.url,), torch.device("cpu"))
        second.group_name = first.group_name
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"{srv.url}/init_weights_update_group answered "
                                               r"400.*already joined"):
            second.open()
        assert time.monotonic() - start < 60 and second.group is None
    finally:
        first.close()


def test_a_mismatched_server_is_refused_by_name(srv: ServerProcess, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=rf"rollout server {srv.url} runs dtype='float32'; "
                                         r"allowed: dtype='bfloat16'"):
        ServerTrainer(_config(tmp_path / "run", (srv.url,), dtype="bfloat16"))
