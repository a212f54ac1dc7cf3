"""Plot `benchmarks/kernels/bench_moe_quant.py` results: time over the weight-byte floor against
tokens N, one line per (format, inner loop) of each result, labelled by the result's name.

    python3 benchmarks/plot_moe_quant.py OUT.png NAME=RESULT.json [NAME=RESULT.json ...]
    # RESULT: a run's JSON line (--out); NAME prefixes its lines in the legend
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, result in results.items():
        lines: dict[str, list[tuple[int, float]]] = {}
        for row in result["results"]:
            if row["best_x_floor"] == row["best_x_floor"]:          # NOTE: skips NaN (failed)
                lines.setdefault(f"{row['fmt']} {row['variant']}", []).append(
                    (row["N"], row["best_x_floor"]))
        for label, points in sorted(lines.items()):
            points.sort()
            ax.plot([n for n, _ in points], [x for _, x in points], marker="o",
                    label=f"{name}: {label}")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set(xscale="log", xlabel="tokens N", ylabel="time / weight-byte floor",
           title="routed experts (E 256, d 4096, I 2048, k 6) on one H200")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    if len(sys.argv) < 3 or any("=" not in a for a in sys.argv[2:]):
        sys.exit(__doc__)
    results = {}
    for arg in sys.argv[2:]:
        name, _, file = arg.partition("=")
        results[name] = json.loads(Path(file).read_text())
    plot(results, Path(sys.argv[1]))


if __name__ == "__main__":
    main()
