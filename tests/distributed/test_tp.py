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


def run(world: int, tmp: Path, jobs: list[tuple[Path, Path, tuple[str, ...]]]) -> None:
    """`world` worker processes, one process group, running `jobs` (checkpoint, output file,
    flags) in turn; rank 0 writes each job's results to its output file."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2] / "src"),
                                           os.environ.get("PYTHONPATH", "")]))
    args = [",".join([str(ckpt), str(out), *flags]) for ckpt, out, flags in jobs]
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(world),
                               str(tmp / f"store-{world}"), *args], env=env,
                              stderr=subprocess.PIPE, text=True) for r in range(world)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]


@pytest.fixture(scope="module")
def micro_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ckpt = tmp_path_factory.mktemp("tp_micro") / "micro"
    write_checkpoint(micro(), ckpt, seed=4, tokenizer=False)
    return ckpt


LAYOUTS = {"tp2": ("bf16", ()), "tp2-ep2": ("bf16", ("ep",)),
           "tp2-ep2-fp8": ("fp8", ("ep", "checkpoint"))}
"""Each row's checkpoint and worker flags. `fp8`: a geometry whose FP8 linears are cut on whole
scale blocks, loaded in checkpoint format, so each rank computes with its cut of the codes (no
dequantised copy); its one-process reference loads it in the same format."""


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory,
            micro_ckpt: Path) -> dict[str, tuple[dict, dict]]:
    """Per row of LAYOUTS: (one process's results, two ranks' results). One process runs both
    references (one process has no experts to split), then two ranks run every row in one
    process group."""
    tmp = tmp_path_factory.mktemp("tp_runs")
    ckpts = {"bf16": micro_ckpt, "fp8": tmp / "micro-fp8"}
    write_checkpoint(micro_blocks(), ckpts["fp8"], seed=4, tokenizer=False,
                     weight_quant="fp8+fp4")
    one_flags = {"bf16": (), "fp8": ("checkpoint",)}
    run(1, tmp, [(ckpts[c], tmp / f"one-{c}.pt", one_flags[c]) for c in ckpts])
    run(2, tmp, [(ckpts[c], tmp / f"two-{row}.pt", flags)
                 for row, (c, flags) in LAYOUTS.items()])
    return {row: (torch.load(tmp / f"one-{c}.pt", weights_only=False),
                  torch.load(tmp / f"two-{row}.pt", weights_only=False))
            for row, (c, _) in LAYOUTS.items()}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_equal_one_process(layout: str,
                                     results: dict[str, tuple[dict, dict]]) -> None:
    one, two = results[layout]
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
def test_sizes_that_do_not_divide_are_clear_errors(micro_ckpt: Path, field: str,
                                                   size: int) -> None:
    model = load_model(micro_ckpt, dtype="float32", device="cpu", progress=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=f"does not divide {field}="):
        shard_model(model, TPGroup(0, size))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a refused shard changed weights"
