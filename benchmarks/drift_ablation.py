"""Which kernel moves the train / rollout log-prob drift: step-0 drift with one op swapped.

    PYTHONPATH=src python benchmarks/drift_ablation.py --device cuda --dtype bfloat16
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/drift_ablation.py --device cpu \
        --dtype float32 --ops rms_norm --prompts 1 --group-size 2        # CPU smoke

One `RLTrainer` (dsv4-tiny, routing + indexer replay, the engine's decode eager: CUDA graphs do
not change the drift, measured) rolls out the step-0 prompts once per variant of the engine's
kernel set, and the trainer scores the samples (no optimizer step): the engine on all `triton`
ops, on all `ref` ops, then for each op the `triton` set with that one op taken from `ref`
("-op": what the op adds) and the `ref` set with that one op from `triton` ("+op"). The metric
is `train_rollout_logprob_abs_diff` (`rl_drift.py`). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import torch
from rl_drift import EagerTrainer

from dsv4.assets import default_model_path
from dsv4.kernels.registry import KernelOps, create_kernels
from dsv4.rl import algorithms as alg
from dsv4.rl.batch import advantages_of, group_rewards, pack
from dsv4.rl.config import RLConfig
from dsv4.rl.trainer import RLTrainer


def step0_drift(trainer: RLTrainer, ops: KernelOps) -> tuple[float, float]:
    """(mean, max) drift of one step-0 rollout with the engine on `ops`."""
    trainer.engine.runner.ops = ops
    samples, _ = trainer.rollout()
    c = trainer.config
    batch = pack(samples, advantages_of(group_rewards(samples)), c.replay_routing,
                 c.replay_indexer).to(trainer.device)
    with torch.no_grad():
        logp, _ = trainer.policy_logprobs(batch)
    mean, top = alg.logprob_abs_diff(logp, batch.rollout_logp, batch.mask)
    return float(mean), float(top)


OPS = [f.name for f in dataclasses.fields(KernelOps) if f.name != "name"]


def variants(names: list[str]) -> list[tuple[str, KernelOps]]:
    ref, tri = create_kernels("ref"), create_kernels("triton")
    return ([("triton", tri), ("ref", ref)]
            + [(f"triton -{n}", dataclasses.replace(tri, **{n: getattr(ref, n)})) for n in names]
            + [(f"ref +{n}", dataclasses.replace(ref, **{n: getattr(tri, n)})) for n in names])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(default_model_path()))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--ops", default=",".join(OPS), help="comma list of the ops to swap")
    p.add_argument("--variants", default=None,
                   help="comma list of the variants to run (default: all; e.g. 'ref,ref +OP')")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    names = args.ops.split(",")
    if bad := sorted(set(names) - set(OPS)):
        p.error(f"--ops: unknown {bad}; allowed: {OPS}")
    chosen = variants(names)
    if args.variants is not None:
        wanted = args.variants.split(",")
        if bad := sorted(set(wanted) - {n for n, _ in chosen}):
            p.error(f"--variants: unknown {bad}; allowed: {[n for n, _ in chosen]}")
        chosen = [(n, ops) for n, ops in chosen if n in wanted]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        trainer = EagerTrainer(RLConfig(
            model=args.model, out_dir=tmp, group_size=args.group_size,
            prompts_per_step=args.prompts, device=args.device, dtype=args.dtype,
            kernel_backend="triton", kernel_values=False))   # the formulation's own values
        for name, ops in chosen:
            mean, top = step0_drift(trainer, ops)
            rows.append({"variant": name, "step0_mean": mean, "step0_max": top})
            print(f"{name:28} {mean:11.3g} {top:10.3g}", flush=True)
    result = {"device": args.device, "dtype": args.dtype, "torch": torch.__version__,
              "model": args.model, "rows": rows}
    print(json.dumps(result))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
