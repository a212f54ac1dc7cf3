"""Curves of an RL run: `metrics.jsonl` -> one PNG (`rl.png`) with three panels sharing the step
axis.

(a) training reward mean (+- std band) and sample accuracy; (b) held-out greedy accuracy, one line
per level plus their mean; (c) trainer-vs-rollout log-prob drift (`train_rollout_logprob_abs_diff`
mean and max) on a symlog axis (linear below 1e-8), so exact zeros (true on-policy) still plot;
when every drift value is 0 the panel says "exactly 0". matplotlib is optional: without it
`plot_run` raises RuntimeError with the install hint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dsv4.utils.logging import init_logger

logger = init_logger(__name__)

DRIFT_LINTHRESH = 1e-8
DRIFT_KEYS = (("train_rollout_logprob_abs_diff", "mean |log pi_train - log pi_rollout|"),
              ("train_rollout_logprob_abs_diff_max", "max |log pi_train - log pi_rollout|"))


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a `metrics.jsonl`, in file order (blank lines skipped)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that carry `key`."""
    points = [(int(r["step"]), float(r[key])) for r in records if key in r]
    return [s for s, _ in points], [v for _, v in points]


def level_series(records: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """Held-out accuracy per level: level -> (steps, accuracies), levels in numeric order."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for r in records:
        for level, acc in r.get("heldout_by_level", {}).items():
            steps, accs = out.setdefault(str(level), ([], []))
            steps.append(int(r["step"]))
            accs.append(float(acc))
    return dict(sorted(out.items(), key=lambda kv: (len(kv[0]), kv[0])))


def plot_run(metrics: Path, out: Path) -> Path:
    """Draw the run's reward, held-out accuracy and drift panels into the PNG `out`."""
    try:
        import matplotlib
    except ImportError as e:  # optional dependency
        raise RuntimeError("plotting needs matplotlib: pip install matplotlib "
                           "(or pip install 'dsv4[train]')") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics)
    fig, (reward_ax, heldout_ax, drift_ax) = plt.subplots(3, 1, figsize=(8, 10), dpi=120,
                                                          sharex=True)
    _reward_panel(reward_ax, records)
    _heldout_panel(heldout_ax, records)
    _drift_panel(drift_ax, records)
    drift_ax.set_xlabel("optimizer step")
    for ax in (reward_ax, heldout_ax, drift_ax):
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    logger.info("wrote %s (%d records)", out, len(records))
    return out


def _no_data(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} logged", ha="center", va="center", transform=ax.transAxes)


def _reward_panel(ax: Any, records: list[dict[str, Any]]) -> None:
    ax.set_title("(a) training rollouts")
    steps, mean = series(records, "reward_mean")
    if not steps:
        _no_data(ax, "training step")
        return
    line = ax.plot(steps, mean, label="reward mean")[0]
    std_steps, std = series(records, "reward_std")
    if std_steps == steps:
        lo = [m - s for m, s in zip(mean, std, strict=True)]
        hi = [m + s for m, s in zip(mean, std, strict=True)]
        ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.15, label="+- reward std")
    acc_steps, acc = series(records, "accuracy")
    if acc_steps:
        ax.plot(acc_steps, acc, linestyle="--", label="sample accuracy")
    ax.set_ylabel("reward / accuracy")
    ax.legend(loc="best", fontsize="small")


def _heldout_panel(ax: Any, records: list[dict[str, Any]]) -> None:
    ax.set_title("(b) held-out greedy accuracy")
    levels = level_series(records)
    for level, (steps, accs) in levels.items():
        ax.plot(steps, accs, marker="o", markersize=3, linewidth=1, label=f"level {level}")
    steps, mean = series(records, "heldout_accuracy")
    if steps:
        ax.plot(steps, mean, marker="s", markersize=4, linewidth=2.5, color="black",
                label="mean over levels")
    if not steps and not levels:
        _no_data(ax, "held-out evaluation")
        return
    ax.set_ylim(-0.05, 1.05)
    ax.set_ylabel("accuracy")
    ax.legend(loc="best", fontsize="small", ncol=2)


def _drift_panel(ax: Any, records: list[dict[str, Any]]) -> None:
    ax.set_yscale("symlog", linthresh=DRIFT_LINTHRESH)
    drawn = [(label, *series(records, key)) for key, label in DRIFT_KEYS]
    drawn = [(label, steps, values) for label, steps, values in drawn if steps]
    all_zero = bool(drawn) and all(v == 0.0 for _, _, values in drawn for v in values)
    suffix = ": exactly 0 at every step" if all_zero else ""
    ax.set_title(f"(c) trainer vs rollout log-prob drift{suffix}")
    if not drawn:
        _no_data(ax, "drift")
        return
    for (label, steps, values), marker in zip(drawn, ("o", "^"), strict=False):
        ax.plot(steps, values, marker=marker, markersize=3,
                label=label + (" (exactly 0)" if all_zero else ""))
    # drift >= 0; the bottom margin keeps zeros off the frame
    ax.set_ylim(bottom=-0.3 * DRIFT_LINTHRESH, top=1e-6 if all_zero else None)
    ax.set_ylabel(f"nats (symlog, linear below {DRIFT_LINTHRESH:g})")
    ax.legend(loc="best", fontsize="small")
