"""The per-rank memory plan (`distributed/memory.py`) equals what a loaded engine allocates on CPU
(weights, KV pools, request state; and each TP-2 / EP-2 rank's shard, each DP-2 rank's model),
and `dsv4 serve --dry-run` prints it without loading weights (issue 22)."""

from __future__ import annotations

import os
import subprocess
import sys
from itertools import chain
from pathlib import Path

import pytest
import torch

from dsv4 import LLM
from dsv4.cache.pools import RingState
from dsv4.checkpoint.presets import PRESETS, micro
from dsv4.checkpoint.writer import write_checkpoint
from dsv4.config.engine import EngineConfig
from dsv4.config.model import ModelConfig
from dsv4.distributed.dp import DPGroup
from dsv4.distributed.loading import load_dp_shard
from dsv4.distributed.memory import plan_memory
from dsv4.distributed.tp import TPGroup, shard_model
from dsv4.model.loader import empty_model, load_model
from dsv4.model.quant_linear import QuantLinear, dequantize_linears_

META = torch.device("meta")


def nbytes(tensors: object) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)  # type: ignore[attr-defined]


def pool_bytes(pools: object) -> int:
    """Every tensor the KV pools hold, counted from the objects themselves."""
    total = 0
    for layer in pools.layers:  # type: ignore[attr-defined]
        for value in vars(layer).values():
            if isinstance(value, torch.Tensor):
                total += nbytes([value])
            elif isinstance(value, RingState):
                total += nbytes(t for t in vars(value).values() if isinstance(t, torch.Tensor))
    return total


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "tp-ep"])
def test_plan_equals_the_allocation(tmp_path: Path, expert_parallel: bool) -> None:
    ckpt = tmp_path / "micro"
    write_checkpoint(micro(), ckpt, seed=4, tokenizer=False)
    llm = LLM(ckpt, dtype="float32", device="cpu", page_size=16, max_total_tokens=4096,
              max_running_requests=8)
    engine, runner = llm.engine, llm.engine.runner
    (one,) = plan_memory(ModelConfig.from_hf(ckpt), engine.config, torch.float32)
    assert one.weights == nbytes(chain(llm.model.parameters(), llm.model.buffers()))
    assert one.kv == pool_bytes(runner.pools)
    state = [t for t in vars(runner.table).values() if isinstance(t, torch.Tensor)]
    rope = [llm.model.rope_main.cache, llm.model.rope_compress.cache]
    assert one.state == nbytes([*state, runner.penalties.token_counts,
                                    runner.penalties.seen, *rope])
    plans = plan_memory(ModelConfig.from_hf(ckpt), engine.config, torch.float32, 2,
                        expert_parallel)
    for rank, plan in enumerate(plans):
        shard = shard_model(load_model(ckpt, dtype="float32", device="cpu", progress=False),
                            TPGroup(rank, 2), expert_parallel)
        assert plan.weights == nbytes(chain(shard.parameters(), shard.buffers()))
        assert plan.weights < one.weights and plan.kv == one.kv


@pytest.mark.parametrize("fmt", ["bf16", "checkpoint"])
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["dp", "dp-ep"])
def test_dp_plan_equals_each_ranks_model(tmp_path: Path, expert_parallel: bool, fmt: str) -> None:
    """Data-parallel attention: each rank's planned weights are what `load_dp_shard` holds (the
    whole model without EP; with EP half the routed experts, checkpoint-format ones as codes);
    the KV pools are each rank's own, the same as one process's."""
    ckpt = tmp_path / "micro"
    write_checkpoint(micro(), ckpt, seed=4, tokenizer=False, weight_quant="fp8+fp4")
    config = ModelConfig.from_hf(ckpt)
    llm = LLM(ckpt, dtype="float32", device="cpu", page_size=16, max_total_tokens=4096,
              max_running_requests=8, weight_format=fmt)
    (one,) = plan_memory(config, llm.engine.config, torch.float32, weight_format=fmt)
    plans = plan_memory(config, llm.engine.config, torch.float32, 1, expert_parallel, fmt, 2)
    for rank, plan in enumerate(plans):
        model = load_dp_shard(ckpt, "float32", "cpu", DPGroup(rank, 2), expert_parallel, fmt)
        assert plan.weights == nbytes(chain(model.parameters(), model.buffers()))
        assert plan.kv == one.kv and (plan.weights < one.weights) == expert_parallel
    with pytest.raises(ValueError, match="tp_size=2 with dp_size=2 is not supported"):
        plan_memory(config, llm.engine.config, torch.float32, 2, False, fmt, 2)


@pytest.mark.parametrize("flags", [("--tp-size", "2"), ("--dp-size", "2", "--ep-size", "2")])
def test_serve_dry_run_prints_the_plan_and_exits_0(flags: tuple[str, ...]) -> None:
    out = subprocess.run([sys.executable, "-m", "dsv4", "serve", "--dry-run", *flags],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert f"{flags[0][2:4]}_size 2" in lines[0] and lines[1].split()[:2] == ["rank", "weights"]
    assert [line.split()[0] for line in lines[2:]] == ["0", "1"]


def test_dry_run_for_cuda_without_a_gpu_or_a_kv_size_is_a_clear_error() -> None:
    out = subprocess.run([sys.executable, "-m", "dsv4", "serve", "--dry-run", "--device", "cuda"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 2 and "allowed: --kv-cache-memory-gb" in out.stderr, out.stderr


@pytest.mark.parametrize(("preset", "tp_size"), [("flash-4l", 2), ("flash-4l", 4),
                                                 ("flash-4l", 8), ("flash", 2)])
def test_v4_flash_cuts_keep_every_fp8_linear(preset: str, tp_size: int) -> None:
    """V4-Flash's tensor-parallel cuts (TP 2-8, experts by id) are whole 128x128 scale blocks, so
    every FP8 linear stays FP8 codes on every rank (`QuantLinear.narrow_`), and the plan counts
    one byte per weight: a rank holds fewer bytes than with the cut linears dequantised."""
    config = PRESETS[preset]()
    full = empty_model(config, torch.bfloat16, META, "checkpoint")
    fp8 = sum(isinstance(m, QuantLinear) for m in full.modules())
    shard = shard_model(full, TPGroup(tp_size - 1, tp_size), True)
    assert sum(isinstance(m, QuantLinear) for m in shard.modules()) == fp8 > 0
    dense = empty_model(config, torch.bfloat16, META, "checkpoint")
    dequantize_linears_(dense, torch.bfloat16)
    dense = shard_model(dense, TPGroup(tp_size - 1, tp_size), True)
    engine = EngineConfig(max_total_tokens=4096, max_running_requests=1)
    plan = plan_memory(config, engine, torch.bfloat16, tp_size, True, "checkpoint")[-1]
    assert plan.weights == nbytes(chain(shard.parameters(), shard.buffers()))
    assert plan.weights < nbytes(chain(dense.parameters(), dense.buffers()))
