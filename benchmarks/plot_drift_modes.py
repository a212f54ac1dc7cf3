"""Step-0 drift and rollout time per RL mode, from `rl_drift.py` JSON files (issue 18 report).

    python3 benchmarks/plot_drift_modes.py A.json [B.json ...] --out drift_modes.png

One bar group per file (its `model`), one bar per mode, routing + indexer replay rows only. Left:
step-0 mean |log pi_train - log pi_rollout| (exact zeros drawn at the axis floor and labelled 0),
with the 0.005 target and Miles' 0.023. Right: the rollout time of each mode (`last_rollout_s`
when the file has it: the last step of a multi-step run; else `rollout_s`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

FLOOR = 1e-9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    runs = [json.loads(f.read_text()) for f in args.files]
    modes = list(dict.fromkeys(r["mode"] for run in runs for r in run["rows"]))
    fig, (ax_d, ax_t) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        xs, drift, times = [], [], []
        for j, run in enumerate(runs):
            rows = [r for r in run["rows"]
                    if r["mode"] == mode and r["replay"] == "routing,indexer"]
            if rows:
                xs.append(j + (i - (len(modes) - 1) / 2) * width)
                drift.append(rows[0]["step0_mean"])
                times.append(rows[0].get("last_rollout_s", rows[0]["rollout_s"]))
        bars = ax_d.bar(xs, [max(d, FLOOR) for d in drift], width, label=mode)
        for bar, d in zip(bars, drift, strict=True):
            label = "0" if d == 0 else f"{d:.4f}"
            ax_d.annotate(label, (bar.get_x() + width / 2, bar.get_height()), ha="center",
                          va="bottom", fontsize=7)
        ax_t.bar(xs, times, width, label=mode)
    names = [Path(str(run["model"])).name for run in runs]
    for ax in (ax_d, ax_t):
        ax.set_xticks(range(len(runs)), names)
    ax_d.set_yscale("log")
    ax_d.axhline(0.005, color="k", ls="--", lw=1, label="target 0.005")
    ax_d.axhline(0.023, color="r", ls=":", lw=1, label="Miles 0.023")
    ax_d.set_ylabel("step-0 mean |dlogp| (0 drawn at 1e-9)")
    ax_d.set_title("train / rollout drift, bf16, routing + indexer replay")
    ax_t.set_ylabel("rollout s")
    ax_t.set_title("rollout time per mode")
    ax_d.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
