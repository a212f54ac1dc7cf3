"""`dsv4 rl plot` and `dsv4 rl export` on CPU: the three-panel PNG from a synthetic metrics.jsonl
(including all-zero drift), and a hand-made run directory (micro checkpoint, perturbed policy)
exported and loaded back bit for bit."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import write_checkpoint
from dsv4.model.loader import load_model
from dsv4.rl.config import RLConfig
from dsv4.rl.export import export_policy
from dsv4.rl.plot import level_series, plot_run, read_metrics, series

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _metrics(path: Path, drift: list[float]) -> Path:
    """A metrics.jsonl as `dsv4 rl run` writes it: step 0 eval, training steps, eval every 2."""
    lines: list[dict[str, Any]] = [{"step": 0, "heldout_accuracy": 0.25,
                                    "heldout_by_level": {"3": 0.5, "10": 0.0}}]
    for step, d in enumerate(drift, start=1):
        rec: dict[str, Any] = {"step": step, "reward_mean": 0.1 * step, "reward_std": 0.05,
                               "accuracy": 0.1 * step, "response_len": 4.0, "loss": -0.01,
                               "train_rollout_logprob_abs_diff": d,
                               "train_rollout_logprob_abs_diff_max": 4 * d}
        if step % 2 == 0:
            rec.update(heldout_accuracy=0.5, heldout_by_level={"3": 0.75, "10": 0.25})
        lines.append(rec)
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + "\n")
    return path


def _captured_plot(metrics: Path, out: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Run plot_run and return its figure (kept open by intercepting plt.close)."""
    import matplotlib.pyplot as plt

    figures: list[Any] = []
    monkeypatch.setattr(plt, "close", figures.append)
    assert plot_run(metrics, out) == out
    monkeypatch.undo()
    assert len(figures) == 1
    return figures[0]


def test_series_and_levels_from_metrics(tmp_path: Path) -> None:
    records = read_metrics(_metrics(tmp_path / "metrics.jsonl", [0.0, 1e-3, 2e-3]))
    assert len(records) == 4                          # the trailing blank line is skipped
    assert series(records, "heldout_accuracy") == ([0, 2], [0.25, 0.5])
    assert series(records, "train_rollout_logprob_abs_diff_max") == ([1, 2, 3], [0.0, 4e-3, 8e-3])
    assert level_series(records) == {"3": ([0, 2], [0.5, 0.75]), "10": ([0, 2], [0.0, 0.25])}
    assert list(level_series(records)) == ["3", "10"]  # numeric order, not "10" < "3"


@pytest.mark.parametrize("drift", [[1e-3, 0.0, 2e-5, 3e-4], [0.0, 0.0, 0.0, 0.0]])
def test_plot_writes_three_panels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  drift: list[float]) -> None:
    import matplotlib.pyplot as plt

    out = tmp_path / "sub" / "rl.png"
    fig = _captured_plot(_metrics(tmp_path / "metrics.jsonl", drift), out, monkeypatch)
    assert out.read_bytes()[:8] == PNG_MAGIC and out.stat().st_size > 5000
    reward_ax, heldout_ax, drift_ax = fig.axes
    assert [ln.get_label() for ln in heldout_ax.get_lines()] == ["level 3", "level 10",
                                                                 "mean over levels"]
    assert drift_ax.get_yscale() == "symlog"
    drift_lines = drift_ax.get_lines()
    assert [list(ln.get_ydata()) for ln in drift_lines] == [drift, [4 * d for d in drift]]
    all_zero = not any(drift)
    assert ("exactly 0" in drift_ax.get_title()) == all_zero
    assert all(("exactly 0" in ln.get_label()) == all_zero for ln in drift_lines)
    assert [ln.get_label() for ln in reward_ax.get_lines()] == ["reward mean", "sample accuracy"]
    plt.close(fig)


def test_plot_without_matplotlib_names_the_install(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # makes `import matplotlib` fail
    with pytest.raises(RuntimeError, match="pip install matplotlib"):
        plot_run(_metrics(tmp_path / "metrics.jsonl", [0.0]), tmp_path / "rl.png")


# --- export ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("source")
    write_checkpoint(micro(), path, seed=3)
    return path


def _perturbed_run(source: Path, run: Path) -> dict[str, torch.Tensor]:
    """A run directory whose policy is the source with three tensors changed; returns the
    policy. The official layout stores matrices in bf16 and sinks in fp32: each new value is
    exactly representable where it is stored."""
    sd = load_model(source, dtype="float32", device="cpu").state_dict()
    sd["head.weight"][7] *= 2.0                          # bf16 * 2 stays bf16
    sd["layers.2.ffn.experts.w1"][3, 5, 7] = -0.75       # one routed expert's element
    sd["layers.3.attn.attn_sink"][1] += 1e-3             # fp32-stored: any fp32 value
    run.mkdir()
    torch.save({"policy": sd, "optimizer": {}, "step": 3, "elapsed_s": 1.0}, run / "state.pt")
    RLConfig(model=str(source), out_dir=str(run)).save(run / "rl_config.json")
    return sd


def test_export_round_trips_the_policy(source: Path, tmp_path: Path) -> None:
    policy = _perturbed_run(source, tmp_path / "run")
    out = export_policy(tmp_path / "run", tmp_path / "model", weight_quant="none")
    exported = load_model(out, dtype="float32", device="cpu")
    assert exported.config.weight_quant == "none"
    loaded = exported.state_dict()
    assert loaded.keys() == policy.keys()
    assert torch.equal(loaded["layers.2.ffn.experts.w1"][3, 5, 7], torch.tensor(-0.75))
    assert all(torch.equal(loaded[k], v) for k, v in policy.items())
    perturbed = load_model(source, dtype="float32", device="cpu")
    tokens = torch.tensor([[1, 7, 9, 7, 3, 7]])
    with torch.no_grad():
        original = perturbed(tokens)
        perturbed.load_state_dict(policy)
        expected = perturbed(tokens)
        assert not torch.equal(expected, original)     # the perturbation is visible
        assert torch.equal(exported(tokens), expected)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (source / name).read_bytes()
    summary = json.loads((out / "rl.json").read_text())
    assert (summary["step"], summary["train_time_s"], summary["weight_quant"]) == (3, 1.0, "none")
    assert RLConfig.from_dict(summary["rl_config"]) == RLConfig(model=str(source),
                                                                out_dir=str(tmp_path / "run"))


def test_export_default_quant_serves(source: Path, tmp_path: Path) -> None:
    _perturbed_run(source, tmp_path / "run")
    out = export_policy(tmp_path / "run", tmp_path / "model")
    assert load_model(out, dtype="float32", device="cpu").config.weight_quant == "fp8+fp4"
    llm = LLM(out, dtype="float32", device="cpu", page_size=16, max_total_tokens=256)
    result = llm.generate("1+2=", SamplingParams(max_tokens=4, temperature=0.0,
                                                       ignore_eos=True), use_tqdm=False)
    assert len(result[0].token_ids) == 4


def test_export_rejects_bad_input(source: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    with pytest.raises(ValueError, match=r"weight_quant='int4'.*allowed: \['none', 'fp8'"):
        export_policy(run, tmp_path / "model", weight_quant="int4")
    run.mkdir()
    RLConfig(model=str(source), out_dir=str(run)).save(run / "rl_config.json")
    with pytest.raises(FileNotFoundError, match=str(run / "state.pt")):
        export_policy(run, tmp_path / "model", weight_quant="none")
    assert not (tmp_path / "model").exists()
