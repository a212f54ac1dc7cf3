"""How much train / rollout drift a last-bit difference in one engine op makes (bf16).

    PYTHONPATH=src python benchmarks/drift_sensitivity.py [--device cuda] [--eps 0,1e-7,1e-6]

The engine runs the `ref` kernels (the trainer's own ops), except that its sparse attention
computes the fp32 result, multiplies it by (1 + eps * z), z ~ N(0, 1) per element, and only then
rounds to bf16. Engine and trainer run true on-policy (batch-invariant GEMMs and reductions on
both sides, fixed-width index rows), so eps = 0 is zero drift on any machine (a GEMM library's
shape-dependent kernels, e.g. oneDNN's bf16 GEMM on AVX-512 CPUs, would otherwise make drift
there). eps ~ 1e-7 is the size of a summation-order
difference between a fused kernel and the reference (`backend_rounding.py` measures the kernels
at 1e-8 .. 3e-7 mean relative difference). Each eps gets a fresh step-0 rollout of the same
prompts, scored by the trainer (routing + indexer replay): `train_rollout_logprob_abs_diff`
(`rl_drift.py`). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from drift_ablation import step0_drift
from rl_drift import EagerTrainer

from dsv4.assets import default_model_path
from dsv4.kernels.ops import SparseAttentionOp
from dsv4.kernels.ref.attention import sparse_attention_multi
from dsv4.kernels.ref.rope_norm import rope_inverse
from dsv4.kernels.registry import create_kernels
from dsv4.rl.config import RLConfig

Sources = Sequence[tuple[torch.Tensor, torch.Tensor]]


def perturbed_attention(eps: float, gen: torch.Generator) -> SparseAttentionOp:
    def op(q: torch.Tensor, sources: Sources, sink: torch.Tensor, scale: float, *,
           inverse_rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        wide = sparse_attention_multi(q.float(), [(kv.float(), idx) for kv, idx in sources],
                                      sink, scale)
        if eps:
            z = torch.randn(wide.shape, generator=gen).to(wide.device)
            wide = wide * (1 + eps * z)
        out = wide.to(q.dtype)            # rounded, then de-rotated, as the op's contract
        return out if inverse_rope is None else rope_inverse(out, *inverse_rope)
    return op


def plot(combined: dict[str, dict[str, Any]], png: Path,
         marks: dict[str, float]) -> None:
    """drift against eps for each device's run in `combined` ({device: result}), with the
    measured drift of whole backends (`marks`, label -> value) as horizontal lines."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for device, result in combined.items():
        rows = result["rows"]
        shown = [r for r in rows if r["eps"] > 0 and r["step0_mean"] > 0]
        exact = [f"{r['eps']:.0e}" for r in rows if r["step0_mean"] == 0]
        note = f"; exactly 0 at eps = {', '.join(exact)}" if exact else ""
        ax.plot([r["eps"] for r in shown], [r["step0_mean"] for r in shown], "o-",
                label=f"ref engine, attention x (1 + eps z), {device}{note}")
    for i, (label, value) in enumerate(marks.items()):
        ax.axhline(value, ls="--", color=f"C{i + 2}", label=label)
    ax.set(xscale="log", yscale="log", xlabel="eps (relative perturbation before bf16 rounding)",
           ylabel="step-0 mean |log pi_train - log pi_rollout|",
           title="bf16 drift from a last-bit difference in one op (dsv4-tiny)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(default_model_path()))
    p.add_argument("--device", default="cpu")
    p.add_argument("--eps", default="0,1e-8,1e-7,1e-6")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None,
                   help="only draw: a JSON {device: result} of earlier runs, to --png")
    p.add_argument("--png", type=Path, default=Path("drift_sensitivity.png"))
    p.add_argument("--mark", action="append", default=[],
                   help="LABEL=VALUE: a measured drift drawn as a line (with --plot)")
    args = p.parse_args()
    if args.plot is not None:
        marks = {m.rsplit("=", 1)[0]: float(m.rsplit("=", 1)[1]) for m in args.mark}
        plot(json.loads(args.plot.read_text()), args.png, marks)
        return
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    ref = create_kernels("ref")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        trainer = EagerTrainer(RLConfig(
            model=args.model, out_dir=tmp, group_size=args.group_size,
            prompts_per_step=args.prompts, device=args.device, dtype="bfloat16",
            kernel_backend="ref", true_on_policy=True))
        for eps in (float(e) for e in args.eps.split(",")):
            gen = torch.Generator().manual_seed(0)
            mean, top = step0_drift(trainer, dataclasses.replace(
                ref, sparse_attention=perturbed_attention(eps, gen)))
            rows.append({"eps": eps, "step0_mean": mean, "step0_max": top})
            print(f"eps {eps:8.1e}  step-0 mean {mean:10.3g}  max {top:10.3g}", flush=True)
    result = {"device": args.device, "torch": torch.__version__, "model": args.model,
              "rows": rows}
    print(json.dumps(result))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
