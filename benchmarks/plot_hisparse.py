"""Plot a `benchmarks/hisparse.py` result: output throughput and TPOT p50 against concurrency, with
HiSparse off and on, each mode's admitted maximum marked.

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

    fig, (ax_tok, ax_tpot) = plt.subplots(1, 2, figsize=(11, 4.2))
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


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    lines = Path(sys.argv[1]).read_text().splitlines()
    plot(json.loads([line for line in lines if line.startswith("{")][-1]), Path(sys.argv[2]))


if __name__ == "__main__":
    main()
