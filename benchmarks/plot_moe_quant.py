"""Plot `benchmarks/kernels/bench_moe_quant.py` results: time over the weight-byte floor (or,
with --tflops, TFLOP/s beside the issue's 340 = 50% of the 680 TFLOP/s dense bf16 anchor) against
tokens N, one line per (format, inner loop) of each result at its best config, labelled by the
result's name.

    python3 benchmarks/plot_moe_quant.py [--tflops] OUT.png NAME=RESULT.json [NAME=RESULT.json ...]
    # RESULT: a run's JSON line (--out); NAME prefixes its lines in the legend
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

TFLOPS_LINE = 340.0


def plot(results: dict[str, dict[str, Any]], path: Path, tflops: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = "best_tflops" if tflops else "best_x_floor"
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, result in results.items():
        lines: dict[str, list[tuple[int, float]]] = {}
        for row in result["results"]:
            if row[key] == row[key]:          # NOTE: skips NaN (failed)
                lines.setdefault(f"{row['fmt']} {row['variant']}", []).append(
                    (row["N"], row[key]))
        for label, points in sorted(lines.items()):
            points.sort()
            ax.plot([n for n, _ in points], [x for _, x in points], marker="o",
                    label=f"{name}: {label}")
    ax.axhline(TFLOPS_LINE if tflops else 1.0, color="black", lw=0.8)
    ax.set(xscale="log", xlabel="tokens N",
           ylabel="TFLOP/s (bf16-equivalent)" if tflops else "time / weight-byte floor",
           title="routed experts (E 256, d 4096, I 2048, k 6) on one H200")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    args = sys.argv[1:]
    tflops = bool(args) and args[0] == "--tflops"
    args = args[1:] if tflops else args
    if len(args) < 2 or any("=" not in a for a in args[1:]):
        sys.exit(__doc__)
    results = {}
    for arg in args[1:]:
        name, _, file = arg.partition("=")
        results[name] = json.loads(Path(file).read_text())
    plot(results, Path(args[0]), tflops)


if __name__ == "__main__":
    main()
