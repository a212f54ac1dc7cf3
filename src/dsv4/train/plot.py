"""Loss curves of a training run: `metrics.jsonl` -> `loss.png` (train, held-out and MTP losses
vs tokens)."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(path: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_losses(metrics: Path, out: Path, tokens_per_step: int) -> Path:
    try:
        import matplotlib
    except ImportError as e:  # optional dependency: pip install 'dsv4[train]'
        raise RuntimeError("plotting needs matplotlib: pip install 'dsv4[train]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    series = (("loss", "train"), ("mtp_loss", "train MTP (t+2)"), ("heldout_loss", "held-out"),
              ("heldout_mtp_loss", "held-out MTP"))
    for key, label in series:
        points = [(r["step"] * tokens_per_step / 1e6, r[key]) for r in records if key in r]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, label=label, marker="o" if key.startswith("heldout") else None,
                    markersize=3)
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
