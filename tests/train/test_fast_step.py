"""The cheap training step: the dense routed experts equal the per-expert loop (values and
gradients), and a `compile=True` trainer reproduces the eager losses."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from dsv4.config.model import ModelConfig
from dsv4.kernels.ref.moe import routed_experts, routed_experts_dense
from dsv4.train.config import TrainConfig
from dsv4.train.data import prepare_data
from dsv4.train.trainer import Trainer


def _inputs(N: int, E: int, inter: int, d: int, k: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, d, generator=g)
    w1, w3 = (torch.randn(E, inter, d, generator=g) / d ** 0.5 for _ in range(2))
    w2 = torch.randn(E, d, inter, generator=g) / inter ** 0.5
    # expert E-1 receives no token; one token picks the same expert twice (hash tables may)
    indices = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(N)])
    indices[0, 1] = indices[0, 0]
    weights = torch.rand(N, k, generator=g) + 0.1
    return [t.requires_grad_(t.is_floating_point()) for t in (x, w1, w2, w3, indices, weights)]


def test_dense_experts_equal_loop() -> None:
    x, w1, w2, w3, indices, weights = _inputs(N=48, E=6, inter=16, d=24, k=2)
    grad_out = torch.randn(48, 24)
    results = []
    for fn in (routed_experts, routed_experts_dense):
        y = fn(x, w1, w2, w3, indices, weights, 10.0)
        grads = torch.autograd.grad(y, (x, w1, w2, w3, weights), grad_out)
        results.append((y, *grads))
    for name, a, b in zip(("y", "x", "w1", "w2", "w3", "weights"), *results, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
    # the unused expert gets an exact zero gradient
    assert torch.count_nonzero(results[1][2][-1]) == 0


# inductor's generated kernels are Triton on CUDA (the trained model's path) and C++ on a CPU,
# where building them takes minutes: the CPU row captures and runs the same graphs with eager
# ops (dynamo + AOTAutograd: the graphs per block, the balancer hooks and the QAT swap inside
# them, no recompiles), the GPU row runs inductor's kernels
@pytest.mark.parametrize("backend", [
    "aot_eager",
    pytest.param("inductor", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU")]),
])
def test_compiled_step_matches_eager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     backend: str) -> None:
    # micro cut to one block of each attention kind (SWA and CSA on hash MoE, HCA on routed MoE:
    # every block code path compiled once) and a second HCA / routed block, which runs the first
    # one's graph on its own weights and gate
    preset_config = TrainConfig.model_config

    def blocks(config: TrainConfig) -> ModelConfig:
        return dataclasses.replace(preset_config(config), num_layers=4,
                                   attn_types=("swa", "csa", "hca", "hca"),
                                   moe_types=("hash", "hash", "routed", "routed"))

    monkeypatch.setattr(TrainConfig, "model_config", blocks)
    data = tmp_path / "data"
    # text only: the compiled and the eager step read the same batches whatever they hold
    prepare_data(data, seed=0, vocab_size=512, max_text_bytes=10_000, task_fraction=0.0,
                 progress=False)
    # 2 steps, the second with QAT: the compiled forward also runs on QAT-swapped weights; the
    # closing evaluation (eager under `compile` too) reads one held-out window
    device = "cuda" if backend == "inductor" else "cpu"
    base = TrainConfig(data_dir=str(data), out_dir=str(tmp_path / "eager"), preset="micro",
                       steps=2, batch_size=2, seq_len=64, warmup_steps=1, log_every=1,
                       eval_every=100, eval_tokens=64, ckpt_every=100, qat_start=0.5,
                       device=device, compile_backend=backend)
    runs = {}
    for compile_ in (False, True):
        out = tmp_path / f"compile{compile_}"
        counters.clear()
        Trainer(base.replace(out_dir=str(out), compile=compile_)).run()
        records = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        runs[compile_] = [r for r in records if "loss" in r]
    assert len(runs[True]) == 2
    # one graph per block kind: the last block reuses the third's (no recompile on its gate)
    assert counters["stats"]["unique_graphs"] == 3, dict(counters["stats"])
    for eager, compiled in zip(runs[False], runs[True], strict=True):
        for key in ("loss", "mtp_loss", "indexer_kl"):
            assert abs(eager[key] - compiled[key]) <= 1e-4, (key, eager, compiled)
