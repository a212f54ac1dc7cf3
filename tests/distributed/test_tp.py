"""Tensor and expert parallelism on CPU (gloo, 2 processes) against one process (issue 22).

Both runs load the same `micro` checkpoint in fp32; the 2-process runs shard it
(`distributed/tp.py`: TP 2, and TP 2 with the routed experts split by id, EP 2). The
full-sequence logits (serving and training formulations) agree to 1e-5, and the engine's greedy
tokens are identical, with log-probs within 1e-5, across chunked prefill, a prefix-cache hit and
preemptions (a KV cache too small for every request at once)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fp8_geometry import micro_blocks

from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import write_checkpoint
from dsv4.distributed.tp import TPGroup, shard_model
from dsv4.model.loader import load_model

WORKER = Path(__file__).with_name("tp_worker.py")


def run(ckpt: Path, out: Path, world: int, tmp: Path, *extra: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2] / "src"),
                                           os.environ.get("PYTHONPATH", "")]))
    store = tmp / f"store-{world}-{'-'.join(extra)}"
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(ckpt), str(out), str(r),
                               str(world), str(store), *extra], env=env,
                              stderr=subprocess.PIPE, text=True) for r in range(world)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def micro_one_process(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The bf16 `micro` checkpoint and one process's results on it: the reference of the tp2 and
    tp2-ep2 rows (one process has no experts to split)."""
    tmp = tmp_path_factory.mktemp("tp_one")
    ckpt = tmp / "micro"
    write_checkpoint(micro(), ckpt, seed=4, tokenizer=False)
    return ckpt, run(ckpt, tmp / "one.pt", 1, tmp)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [(), ("ep",), ("ep", "checkpoint")],
                         ids=["tp2", "tp2-ep2", "tp2-ep2-fp8"])
def test_two_ranks_equal_one_process(tmp_path: Path, layout: tuple[str, ...],
                                     request: pytest.FixtureRequest) -> None:
    """`tp2-ep2-fp8`: a geometry whose FP8 linears are cut on whole scale blocks, loaded in
    checkpoint format, so each rank computes with its cut of the codes (no dequantised copy)."""
    if "checkpoint" in layout:
        ckpt = tmp_path / "micro"
        write_checkpoint(micro_blocks(), ckpt, seed=4, tokenizer=False, weight_quant="fp8+fp4")
        one = run(ckpt, tmp_path / "one.pt", 1, tmp_path, *layout[1:])
    else:
        ckpt, one = request.getfixturevalue("micro_one_process")
    two = run(ckpt, tmp_path / "two.pt", 2, tmp_path, *layout)
    assert one["logits"].keys() == two["logits"].keys()
    for name in one["logits"]:
        diff = (one["logits"][name] - two["logits"][name]).abs().max().item()
        assert diff <= 1e-5, f"{name} logits differ by {diff}"
    assert two["tokens"] == one["tokens"]
    for a, b in zip(one["logprobs"], two["logprobs"], strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-5
    assert one["cached"][3] == 32 and two["cached"] == one["cached"]
    assert one["preemptions"] > 0 and two["preemptions"] == one["preemptions"]


@pytest.mark.parametrize(("field", "size"), [("num_heads", 3), ("o_groups", 4)])
def test_sizes_that_do_not_divide_are_clear_errors(tmp_path: Path, field: str,
                                                   size: int) -> None:
    ckpt = tmp_path / "micro"
    write_checkpoint(micro(), ckpt, seed=4, tokenizer=False)
    model = load_model(ckpt, dtype="float32", device="cpu", progress=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=f"does not divide {field}="):
        shard_model(model, TPGroup(0, size))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a refused shard changed weights"
