"""SGLang's trainer-facing endpoints (server/weight_update.py) against a real `dsv4 serve` on a
micro checkpoint, gloo on the CPU: the test process is the trainer, rank 0 of the group. After
/update_weights_from_distributed with checkpoint b's tensors the server's greedy tokens and
log-probs are an offline engine's on b; a refused update (unknown tensor) is a 400 after its
broadcasts and changes nothing; the refusals that need no transfer. /pause_generation's three
modes: requests wait while paused, retracted ones recompute to the same tokens, aborted ones end
with "abort". The pools are free afterwards."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import write_checkpoint
from dsv4.engine.weight_group import open_group, send_tensors
from dsv4.model.loader import load_model

from .conftest import ServerProcess, assert_pools_free, free_port, running_server

PROMPT = torch.randint(3, 512, (19,), generator=torch.Generator().manual_seed(3)).tolist()
MAX_TOKENS = 6
TOL = 1e-5
LONG = 150
"""A request's tokens long enough to be still decoding when a pause or release reaches it."""


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("push_ckpts")
    out = {"a": root / "a", "b": root / "b"}
    write_checkpoint(micro(), out["a"], seed=1)
    write_checkpoint(micro(), out["b"], seed=2, tokenizer=False)
    return out


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory,
        ckpts: dict[str, Path]) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory.mktemp("push_server"), "--model", str(ckpts["a"]),
                        "--shutdown-timeout", "2") as s:
        yield s


def offline(path: Path) -> tuple[list[int], list[float]]:
    llm = LLM(path, dtype="float32", device="cpu", max_total_tokens=1024)
    out = llm.generate(prompt_token_ids=[PROMPT], use_tqdm=False, sampling_params=SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0))[0]
    return out.token_ids, out.logprobs


@pytest.fixture(scope="module")
def offline_out(ckpts: dict[str, Path]) -> dict[str, tuple[list[int], list[float]]]:
    """`offline` on each checkpoint, once for the module (the tests compare against it)."""
    return {name: offline(path) for name, path in ckpts.items()}


def served(srv: ServerProcess, version: str | None = None) -> tuple[list[int], list[float]]:
    """The greedy tokens and log-probs through /generate; `version`: the weight_version label its
    meta_info must carry."""
    r = httpx.post(f"{srv.url}/generate", timeout=60.0, json={
        "input_ids": PROMPT, "return_logprob": True,
        "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert version is None or meta["weight_version"] == version, meta["weight_version"]
    return r.json()["output_ids"], [t[0] for t in meta["output_token_logprobs"]]


class Call(threading.Thread):
    """One POST in the background (it returns only once the trainer's side is done too)."""

    def __init__(self, srv: ServerProcess, path: str, body: dict[str, Any]) -> None:
        super().__init__()
        self.url, self.body = f"{srv.url}{path}", body
        self.response: httpx.Response | None = None
        self.start()

    def run(self) -> None:
        self.response = httpx.post(self.url, json=self.body, timeout=120.0)

    def result(self) -> httpx.Response:
        self.join(120.0)
        assert self.response is not None, f"{self.url} did not answer"
        return self.response


def spec(tensors: dict[str, torch.Tensor], group: str) -> dict[str, Any]:
    return {"names": list(tensors), "group_name": group,
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
            "shapes": [list(t.shape) for t in tensors.values()]}


def push_b(srv: ServerProcess, ckpts: dict[str, Path],
           name: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """Join `srv` to a new group `name` as the trainer (rank 0) and push checkpoint b's tensors,
    labelled "step-1" (the server's first update); returns (the group, the tensors)."""
    port = free_port()
    join = Call(srv, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "group_name": name, "backend": "gloo"})
    group = open_group("127.0.0.1", port, 0, 2, name, "gloo", timeout_s=60.0)
    r = join.result()
    assert r.status_code == 200 and r.json()["success"], r.text
    trainer = dict(load_model(ckpts["b"], dtype="float32", device="cpu",
                              progress=False).state_dict())
    push = Call(srv, "/update_weights_from_distributed",
                {**spec(trainer, name), "weight_version": "step-1"})
    send_tensors(group, trainer)
    r = push.result()
    assert r.status_code == 200, r.text
    assert r.json()["num_tensors"] == len(trainer) and r.json()["weight_version"] == 1
    return group, trainer


def test_push_weights_over_a_group(srv: ServerProcess, ckpts: dict[str, Path],
                                   offline_out: dict[str, tuple[list[int], list[float]]]) -> None:
    assert served(srv, "0")[0] == offline_out["a"][0]
    group, trainer = push_b(srv, ckpts, "wg")
    want_ids, want_lps = offline_out["b"]
    ids, lps = served(srv, "step-1")
    assert ids == want_ids
    assert max(abs(a - b) for a, b in zip(lps, want_lps, strict=True)) <= TOL

    # a tensor the model does not have: received (the broadcast completes), then refused whole
    bad = {"layers.0.attn.wq_a.weight": trainer["layers.0.attn.wq_a.weight"] * 0,
           "no.such.weight": torch.ones(3)}
    push = Call(srv, "/update_weights_from_distributed", spec(bad, "wg"))
    send_tensors(group, bad)
    r = push.result()
    assert r.status_code == 400 and "no.such.weight" in r.json()["error"]["message"], r.text
    assert served(srv, "step-1")[0] == want_ids, "a refused update changes nothing"
    r = httpx.post(f"{srv.url}/update_weights_from_disk", timeout=60.0,
                   json={"model_path": str(ckpts["a"]), "weight_version": "disk-a"})
    assert r.status_code == 200 and r.json()["weight_version"] == 2, r.text
    assert served(srv, "disk-a")[0] == offline_out["a"][0], "the label follows the weights"

    r = httpx.post(f"{srv.url}/destroy_weights_update_group", json={"group_name": "wg"})
    assert r.status_code == 200, r.text
    r = httpx.post(f"{srv.url}/destroy_weights_update_group", json={"group_name": "wg"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "group_name", r.text
    assert_pools_free(srv.wait_idle(), srv.initial)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/update_weights_from_distributed",
     {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "none"}, "names"),
    ("/update_weights_from_distributed",
     {"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[1], [1]]}, "names"),
    ("/update_weights_from_distributed",
     {"names": ["a"], "dtypes": ["float77"], "shapes": [[1]]}, "dtypes"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                    "rank_offset": 1, "world_size": 2, "backend": "nccl"},
     "backend"),
])
def test_refusals_without_a_transfer(srv: ServerProcess, path: str, body: dict[str, Any],
                                     param: str) -> None:
    """An unknown group, unequal lists or a bad dtype, and a backend that does not suit the
    engine's device (NCCL for CPU weights): 400s naming the field, nothing joined or received."""
    r = httpx.post(f"{srv.url}{path}", json=body, timeout=30.0)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def generate_body(tokens: int) -> dict[str, Any]:
    return {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": tokens, "temperature": 0,
                                                     "ignore_eos": True}}


def control(srv: ServerProcess, path: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", json=body, timeout=30.0)


def wait_for(srv: ServerProcess, ready: Any) -> dict[str, Any]:
    """Poll the engine's stats until `ready(stats)` (bounded)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        stats = srv.engine_stats()
        if ready(stats):
            return stats
        time.sleep(0.05)
    raise AssertionError(f"engine never reached the state: {stats}")


def test_pause_modes(srv: ServerProcess,
                     offline_out: dict[str, tuple[list[int], list[float]]]) -> None:
    long = LONG
    # in_place: a request sent while paused waits, then completes as if never paused (the
    # offline engine's tokens on a, the server's weights here and after the push test's disk
    # update)
    assert control(srv, "/pause_generation", mode="in_place").status_code == 200
    call = Call(srv, "/generate", generate_body(MAX_TOKENS))
    before = wait_for(srv, lambda st: st["num_requests"] == 1)
    time.sleep(0.5)
    assert call.response is None and srv.engine_stats()["decode_tokens"] == \
        before["decode_tokens"], "no step while paused"
    assert control(srv, "/continue_generation").status_code == 200
    assert call.result().json()["output_ids"] == offline_out["a"][0]

    want = Call(srv, "/generate", generate_body(long)).result().json()["output_ids"]
    # retract: the running request loses its KV and recomputes to the same tokens
    call = Call(srv, "/generate", generate_body(long))
    wait_for(srv, lambda st: st["num_running"] == 1 and st["decode_tokens"] > 0)
    assert control(srv, "/pause_generation", mode="retract").status_code == 200
    stats = srv.engine_stats()
    assert (stats["num_running"], stats["num_waiting"]) == (0, 1), stats
    assert control(srv, "/continue_generation").status_code == 200
    assert call.result().json()["output_ids"] == want

    # abort: running requests end with "abort"; generation resumes on the continue
    call = Call(srv, "/generate", generate_body(long))
    wait_for(srv, lambda st: st["num_running"] == 1)
    assert control(srv, "/pause_generation").status_code == 200       # SGLang's default
    meta = call.result().json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < long
    assert control(srv, "/continue_generation").status_code == 200
    r = control(srv, "/pause_generation", mode="sideways")
    assert r.status_code == 400 and r.json()["error"]["param"] == "mode", r.text
    assert Call(srv, "/generate", generate_body(4)).result().status_code == 200
    assert_pools_free(srv.wait_idle(), srv.initial)


def test_release_and_resume_memory(srv: ServerProcess) -> None:
    """An idle engine frees its KV pools (a colocated trainer steps meanwhile); a request sent
    then waits, even through /continue_generation, until the resume, then completes as if nothing
    happened. The weights stay: "weights" is refused, and so is a release with requests running."""
    want = Call(srv, "/generate", generate_body(8)).result().json()["output_ids"]
    r = control(srv, "/release_memory_occupation")
    assert r.status_code == 200 and "released" in r.json()["message"], r.text
    call = Call(srv, "/generate", generate_body(8))
    wait_for(srv, lambda st: st["num_requests"] == 1)
    assert control(srv, "/continue_generation").status_code == 200
    time.sleep(0.3)
    assert call.response is None, "no step while the pools are released"
    assert control(srv, "/resume_memory_occupation").status_code == 200
    assert call.result().json()["output_ids"] == want

    r = control(srv, "/release_memory_occupation", tags=["weights"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "tags", r.text
    call = Call(srv, "/generate", generate_body(LONG))
    wait_for(srv, lambda st: st["num_running"] == 1)
    r = control(srv, "/release_memory_occupation", tags=["kv_cache", "cuda_graph"])
    assert r.status_code == 400 and "in flight" in r.json()["error"]["message"], r.text
    assert control(srv, "/pause_generation", mode="abort").status_code == 200
    assert call.result().json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert control(srv, "/continue_generation").status_code == 200
    assert_pools_free(srv.wait_idle(), srv.initial)


@pytest.mark.slow
def test_a_tensor_parallel_server_takes_pushed_weights(
        tmp_path: Path, ckpts: dict[str, Path],
        offline_out: dict[str, tuple[list[int], list[float]]]) -> None:
    """`dsv4 serve --tp-size 2 --ep-size 2`: rank 0 joins the trainer's group, takes the push and
    hands each rank its part (`engine/parallel_weights.py`); the greedy tokens and log-probs are
    then the offline engine's on b, a disk update brings a back; a retracting pause (which both
    ranks must apply, or their collectives no longer match: the request then recomputes and
    decodes until an aborting pause ends it) and a memory release with its resume leave the
    served tokens unchanged."""
    with running_server(tmp_path, "--model", str(ckpts["a"]), "--tp-size", "2", "--ep-size", "2",
                        "--torch-threads", "1", "--shutdown-timeout", "2") as srv:
        push_b(srv, ckpts, "tp")
        want_ids, want_lps = offline_out["b"]
        ids, lps = served(srv, "step-1")
        assert ids == want_ids
        assert max(abs(a - b) for a, b in zip(lps, want_lps, strict=True)) <= TOL

        call = Call(srv, "/generate", generate_body(LONG))
        wait_for(srv, lambda st: st["num_running"] == 1 and st["decode_tokens"] > 0)
        assert control(srv, "/pause_generation", mode="retract").status_code == 200
        stats = srv.engine_stats()
        assert (stats["num_running"], stats["num_waiting"]) == (0, 1), stats
        assert control(srv, "/continue_generation").status_code == 200
        # the retracted request recomputes and decodes on both ranks; an abort then ends it
        wait_for(srv, lambda st: st["num_running"] == 1
                 and st["decode_tokens"] >= stats["decode_tokens"] + 2)
        assert control(srv, "/pause_generation", mode="abort").status_code == 200
        assert call.result().json()["meta_info"]["finish_reason"]["type"] == "abort"
        assert control(srv, "/continue_generation").status_code == 200
        assert control(srv, "/release_memory_occupation").status_code == 200
        assert control(srv, "/resume_memory_occupation").status_code == 200
        assert served(srv, "step-1")[0] == want_ids

        r = httpx.post(f"{srv.url}/update_weights_from_disk", timeout=60.0,
                       json={"model_path": str(ckpts["a"]), "weight_version": "disk-a"})
        assert r.status_code == 200 and r.json()["weight_version"] == 2, r.text
        assert served(srv, "disk-a")[0] == offline_out["a"][0]
        assert_pools_free(srv.wait_idle(), srv.initial)
