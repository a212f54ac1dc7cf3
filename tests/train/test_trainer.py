"""The training loop on CPU (micro preset, short sequences): reproducibility from the seed, exact
resume, QAT weight swapping, expert balancing, indexer distillation, export -> load_model, and the
CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import random_model
from dsv4.cli.main import main as cli_main
from dsv4.kernels.ref.quant import dequant_fp4_group, quant_fp4_group
from dsv4.model.forward_mode import INFERENCE, TRAINING
from dsv4.model.loader import load_model
from dsv4.train.config import TrainConfig
from dsv4.train.data import prepare_data
from dsv4.train.export import export_run
from dsv4.train.indexer_loss import indexer_kl
from dsv4.train.qat import QuantShadow
from dsv4.train.trainer import Trainer, lm_losses, open_run


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("data")
    prepare_data(out, seed=0, vocab_size=512, max_text_bytes=200_000, progress=False)
    return out


def _config(data_dir: Path, out: Path, **changes: object) -> TrainConfig:
    base = TrainConfig(data_dir=str(data_dir), out_dir=str(out), preset="micro", steps=6,
                       batch_size=2, seq_len=64, warmup_steps=2, log_every=1, eval_every=3,
                       eval_tokens=128, ckpt_every=100, qat_start=0.5)
    return base.replace(**changes)


def _losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"])
            for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "loss" in r]


@pytest.fixture(scope="module")
def seed0_run(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 6-step run of `_config` (seed 0), uninterrupted: the reference of the
    reproducibility and resume tests."""
    out = tmp_path_factory.mktemp("seed0") / "run"
    Trainer(_config(data_dir, out)).run()
    return out


def test_same_seed_reproduces_losses(data_dir: Path, seed0_run: Path, tmp_path: Path) -> None:
    """A second run with the same seed logs the same losses bit for bit; another seed's first
    step (its initial weights and batches) already differs."""
    again, other = tmp_path / "again", tmp_path / "other"
    Trainer(_config(data_dir, again)).run()
    assert len(_losses(seed0_run)) == 6 and _losses(again) == _losses(seed0_run)
    Trainer(_config(data_dir, other, seed=1, max_steps_this_call=1)).run()
    assert _losses(other)[0] != _losses(seed0_run)[0]


def test_resume_continues_exactly(data_dir: Path, seed0_run: Path, tmp_path: Path) -> None:
    split = tmp_path / "split"
    first = open_run(_config(data_dir, split, max_steps_this_call=4), resume=False)
    # steps 1..4 (crosses qat_start = step 3 and an evaluation at step 3)
    first.run()
    assert first.step == 4
    second = open_run(_config(data_dir, split), resume=True)
    assert second.step == 4
    second.run()
    assert _losses(split) == _losses(seed0_run)
    final_whole = torch.load(seed0_run / "state.pt", weights_only=True)["model"]
    final_split = torch.load(split / "state.pt", weights_only=True)["model"]
    assert all(torch.equal(final_whole[k], final_split[k]) for k in final_whole)


def test_resume_refuses_changed_run(data_dir: Path, tmp_path: Path) -> None:
    open_run(_config(data_dir, tmp_path, max_steps_this_call=1), resume=False).run()
    with pytest.raises(ValueError, match="lr"):
        open_run(_config(data_dir, tmp_path, lr=1e-4), resume=True)
    with pytest.raises(FileExistsError):
        open_run(_config(data_dir, tmp_path), resume=False)
    with pytest.raises(ValueError, match="compile_backend='cudagraphs' is invalid"):
        _config(data_dir, tmp_path, compile=True, compile_backend="cudagraphs")


def test_loss_decreases(data_dir: Path, tmp_path: Path) -> None:
    trainer = Trainer(_config(data_dir, tmp_path, steps=30, lr=3e-3, qat_start=1.0, log_every=30,
                              eval_every=30))
    before = trainer.evaluate()["heldout_loss"]
    after = trainer.run()
    assert after["heldout_loss"] < before - 0.5, (before, after)


def test_qat_swaps_in_rounded_weights_and_restores_masters(data_dir: Path, tmp_path: Path) -> None:
    trainer = Trainer(_config(data_dir, tmp_path))
    shadow = QuantShadow(trainer.model, "fp8+fp4")
    experts = trainer.model.layers[2].ffn.experts.w1
    master = experts.detach().clone()
    packed, scale = quant_fp4_group(master[0])
    with shadow.rounded():
        assert torch.equal(experts[0], dequant_fp4_group(packed, scale, torch.float32))
        assert not torch.equal(experts, master)
        lm_losses(trainer.model, trainer.stream.batch(0, 1, 32), TRAINING)["loss"].backward()
    assert torch.equal(experts, master) and experts.grad is not None
    with shadow.rounded(enabled=False):
        assert torch.equal(experts, master)


def test_indexer_is_trained_only_by_its_distillation_loss(data_dir: Path, tmp_path: Path) -> None:
    trainer = Trainer(_config(data_dir, tmp_path))
    out = lm_losses(trainer.model, trainer.stream.batch(0, 2, 64), TRAINING)
    kl = trainer.distiller.take()
    assert kl is not None and float(kl) >= 0
    kl.backward()
    indexer = {n for n, p in trainer.model.named_parameters()
               if p.grad is not None and p.grad.abs().sum() > 0}
    assert indexer and all(".indexer." in n for n in indexer), sorted(indexer)[:5]
    trainer.model.zero_grad()
    out["loss"].backward()
    assert all(p.grad is None for n, p in trainer.model.named_parameters() if ".indexer." in n)


def test_balancer_moves_bias_against_load(data_dir: Path, tmp_path: Path) -> None:
    trainer = Trainer(_config(data_dir, tmp_path, bias_update_rate=0.01))
    name, gate = next((n, g) for n, g in trainer.balancer.gates if g.bias is not None)
    bias = gate.bias.detach().clone()
    with torch.no_grad():
        lm_losses(trainer.model, trainer.stream.batch(0, 2, 64), INFERENCE)
    load = trainer.balancer.loads[name].float()
    trainer.balancer.update()
    step = gate.bias.detach() - bias
    assert torch.equal(step, 0.01 * torch.sign(load.mean() - load))
    assert trainer.balancer.loads == {}


def test_export_loads_and_matches(data_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    trainer = Trainer(_config(data_dir, run, steps=2, warmup_steps=1, qat_start=1.0))
    trainer.run()
    out = export_run(run, data_dir, tmp_path / "model", weight_quant="none")
    model = load_model(out, dtype="float32", device="cpu")
    tokens = trainer.stream.batch(7, 1, 32)[:, :-1]
    trainer.model.eval()
    # the official layout stores unquantised matrices in bf16: logits agree to bf16 rounding, not
    # bitwise
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), trainer.model(tokens), rtol=0, atol=1e-2)
    quantised = load_model(export_run(run, data_dir, tmp_path / "q"), dtype="float32", device="cpu")
    shadow = QuantShadow(trainer.model, "fp8+fp4")
    with shadow.rounded():     # the shipped weights ARE the QAT-rounded ones
        rounded = dict(trainer.model.named_parameters())
        for name, p in quantised.named_parameters():
            if name.endswith(("experts.w1", "experts.w2", "attn.wq_a.weight", "attn.wo_b.weight")):
                assert torch.equal(p, rounded[name]), name
    assert json.loads((out / "training.json").read_text())["step"] == 2
    stage2 = Trainer(_config(data_dir, tmp_path / "stage2", init_from=str(out)))
    assert all(torch.equal(a, b) for a, b in zip(stage2.model.state_dict().values(),
                                                  model.state_dict().values(), strict=True))


def test_cli_run_resume_export(data_dir: Path, tmp_path: Path) -> None:
    run, model = tmp_path / "run", tmp_path / "model"
    args = ["train", "run", "--data", str(data_dir), "--out", str(run), "--preset", "micro",
            "--steps", "4", "--batch-size", "1", "--seq-len", "32", "--warmup-steps", "1",
            "--log-every", "1", "--eval-every", "2", "--eval-tokens", "64"]
    assert cli_main(args + ["--max-steps-this-call", "2"]) == 0
    assert cli_main(args + ["--resume"]) == 0
    assert [s for s, _ in _losses(run)] == [1, 2, 3, 4]
    assert (run / "loss.png").stat().st_size > 1000
    assert cli_main(["train", "export", "--run", str(run), "--data", str(data_dir),
                     "--out", str(model)]) == 0
    assert load_model(model, dtype="float32", device="cpu").config.weight_quant == "fp8+fp4"


@pytest.mark.parametrize("seq_len", [3, 9])
def test_indexer_kl_is_finite_with_or_without_visible_entries(seq_len: int) -> None:
    """Below `csa_ratio` tokens no query sees a C4 entry: the distillation loss is 0, not NaN."""
    model = random_model(micro(), torch.float32, torch.device("cpu"), seed=1)
    attn = next(b.attn for b in model.layers if b.attn.indexer is not None)
    x = torch.randn(2, seq_len, model.config.hidden_size,
                    generator=torch.Generator().manual_seed(0))
    cos, sin = model.rope_tables(seq_len, x.device)["compress"]
    kl = indexer_kl(attn, x, cos, sin).detach()
    assert torch.isfinite(kl) and (float(kl) == 0.0) == (seq_len < micro().csa_ratio)
