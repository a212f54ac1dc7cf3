"""Plot a `benchmarks/hisparse.py` result: output throughput and TPOT p50 against concurrency, with
HiSparse off and on, each mode's admitted maximum marked; with a `--profile-steps` run, a third
panel: each level's GPU ms per step by kernel family (stacked).

    python3 benchmarks/plot_hisparse.py RESULT.json OUT.png    # RESULT: the run's JSON line
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profiled = [(mode["mode"], r) for mode in result["modes"] for r in mode["levels"]
                if r.get("profile", {}).get("families_ms")]
    fig, axes = plt.subplots(1, 3 if profiled else 2, figsize=(17 if profiled else 11, 4.2))
    ax_tok, ax_tpot = axes[0], axes[1]
    if profiled:
        _families(axes[2], profiled)
    for mode in result["modes"]:
        levels = mode["levels"]
        conc = [r["concurrency"] for r in levels]
        label = f"HiSparse {mode['mode']} (admits {mode['admitted']})"
        ax_tok.plot(conc, [r["tok_s"] for r in levels], marker="o", label=label)
        ax_tpot.plot(conc, [r["tpot_ms_p50"] for r in levels], marker="o", label=label)
    ax_tok.set(xlabel="concurrent requests", ylabel="output tok/s", title="throughput")
    ax_tpot.set(xlabel="concurrent requests", ylabel="ms", title="TPOT p50")
    for ax in (ax_tok, ax_tpot):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{result['preset']} {result['dtype']}, {result['prompt_len']} + "
                 f"{result['output_len']} tokens, {result['kv_cache_memory_gb']} GB KV budget")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _families(ax: Any, profiled: list[tuple[str, dict[str, Any]]]) -> None:
    """Stacked bars: GPU ms per step by kernel family, one bar per (mode, concurrency)."""
    import matplotlib
    names = list(profiled[0][1]["profile"]["families_ms"])
    labels = [f"{mode}\n{r['concurrency']}" for mode, r in profiled]
    bottom = [0.0] * len(profiled)
    colors = matplotlib.colormaps["tab20"].colors     # 11 families: no colour twice
    for name, color in zip(names, colors, strict=False):
        ms = [r["profile"]["families_ms"].get(name, 0.0) for _, r in profiled]
        ax.bar(labels, ms, bottom=bottom, label=name, color=color)
        bottom = [b + m for b, m in zip(bottom, ms, strict=True)]
    ax.set(ylabel="GPU ms per step (kernels' summed time)", title="where a step goes")
    ax.legend(fontsize=7, ncol=2)


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    lines = Path(sys.argv[1]).read_text().splitlines()
    plot(json.loads([line for line in lines if line.startswith("{")][-1]), Path(sys.argv[2]))


if __name__ == "__main__":
    main()
