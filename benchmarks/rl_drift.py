"""Train / rollout log-prob drift ablation of `dsv4 rl` (issue 18): replay none / routing /
routing+indexer x default / true on-policy, a few steps each, plus each mode's step time.

    PYTHONPATH=src python benchmarks/rl_drift.py --device cuda --dtype bfloat16 \
        --kernel-backend triton --steps 2 --out drift.json

Prints a table, then one JSON line; `--out` also writes the JSON. The metric is Miles'
`train_rollout_logprob_abs_diff` (rl-reference.md §4.3): per-sample masked mean over response
tokens of |log pi_train - log pi_rollout|, averaged over samples; `max` is over tokens.

`--preset NAME` (e.g. flash-4l) measures step 0 only, forward only, on random weights of that
preset generated in memory: per mode one rollout of random-token prompts from an engine, then the
trainer's forward (the same module: equal weights, no optimizer, so the model fits once) with
replay none / routing / routing+indexer on those same samples; and the colocated weight-sync
time (`time_sync`: `LLMEngine.update_weights` with every tensor of the model).

    PYTHONPATH=src python benchmarks/rl_drift.py --preset flash-4l --device cuda \
        --dtype bfloat16 --kernel-backend triton --prompts 8 --group-size 4 --prompt-len 256
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import torch

from dsv4.assets import default_model_path
from dsv4.config.engine import EngineConfig
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.rl.config import REPLAYS, RLConfig
from dsv4.rl.trainer import RLTrainer


class EagerTrainer(RLTrainer):
    """The trainer with its engine's CUDA graphs off (`--disable-cuda-graph`: isolates what the
    graphed decode contributes to the drift)."""

    def engine_config(self) -> EngineConfig:
        return dataclasses.replace(super().engine_config(), disable_cuda_graph=True)


MODES = ("default", "kernels", "formulation", "true-on-policy", "true-on-policy-ref")
"""default: `RLConfig`'s defaults (on a fused backend: exact, the kernel values plus
batch-invariant GEMMs and reductions on both sides; on `ref`: the formulation); kernels: the
trainer's values from the engine's kernels (invariant plans), cuBLAS GEMMs (`--no-true-on-policy`);
formulation: the trainer's own formulation, the kernels' usual plans (`--no-kernel-values
--no-true-on-policy`); true-on-policy: `--true-on-policy`; true-on-policy-ref: the same on the
`ref` ops (fixed-width index rows, eager engine)."""


def mode_fields(mode: str, backend: str) -> dict[str, object]:
    """The RLConfig fields of `mode` (see MODES) on kernel backend `backend`."""
    exact = {"default": backend != "ref", "kernels": False, "formulation": False}
    return {"true_on_policy": exact.get(mode, True), "kernel_values": mode != "formulation",
            "kernel_backend": "ref" if mode == "true-on-policy-ref" else backend}


def measure(args: argparse.Namespace, replay: str, mode: str) -> dict[str, object]:
    fields = mode_fields(mode, args.kernel_backend)
    true_on_policy = fields["true_on_policy"]
    with tempfile.TemporaryDirectory() as tmp:
        config = RLConfig(model=args.model, out_dir=tmp, steps=args.steps,
                          group_size=args.group_size, prompts_per_step=args.prompts,
                          lr=args.lr, replay=replay, device=args.device, dtype=args.dtype,
                          formulation=args.formulation, **fields)  # type: ignore[arg-type]
        trainer = (EagerTrainer if args.disable_cuda_graph else RLTrainer)(config)
        t0 = time.perf_counter()
        records = [trainer.train_step() for _ in range(args.steps)]
        wall = time.perf_counter() - t0
    return {"replay": replay, "mode": mode, "true_on_policy": true_on_policy,
            "step0_mean": records[0]["train_rollout_logprob_abs_diff"],
            "step0_max": records[0]["train_rollout_logprob_abs_diff_max"],
            "last_mean": records[-1]["train_rollout_logprob_abs_diff"],
            "last_max": records[-1]["train_rollout_logprob_abs_diff_max"],
            "run_max": max(r["train_rollout_logprob_abs_diff_max"] for r in records),
            "nonzero_steps": sum(r["train_rollout_logprob_abs_diff_max"] != 0 for r in records),
            "rollout_s": sum(r["rollout_s"] for r in records) / len(records),
            "train_s": sum(r["train_s"] for r in records) / len(records),
            "sync_s": sum(r["sync_s"] for r in records) / len(records),
            "last_rollout_s": records[-1]["rollout_s"], "last_train_s": records[-1]["train_s"],
            "step_s": wall / len(records)}


def measure_random(args: argparse.Namespace, modes: list[str]) -> list[dict[str, object]]:
    """Step-0 drift of a random-weight preset (see the module docstring), per mode."""
    from dsv4.checkpoint.presets import get_preset
    from dsv4.checkpoint.writer import random_model
    from dsv4.model.loader import resolve_device, resolve_dtype

    config = get_preset(args.preset)
    device = resolve_device(args.device)
    model = random_model(config, resolve_dtype(args.dtype), device, seed=0)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, config.vocab_size, (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.prompts)]
    return [row for mode in modes for row in random_mode(args, model, prompts, mode)]


def random_mode(args: argparse.Namespace, model: DeepSeekV4ForCausalLM, prompts: list[list[int]],
                mode: str) -> list[dict[str, object]]:
    """One engine over `model` (true on-policy: batch-invariant, ref backend, no graphs), one
    rollout, then the trainer-side forward with each replay setting on the same samples."""
    fields = mode_fields(mode, args.kernel_backend)
    true_on_policy, backend = bool(fields["true_on_policy"]), str(fields["kernel_backend"])
    values = bool(fields["kernel_values"]) and backend != "ref"
    from dsv4.config.engine import EngineConfig
    from dsv4.engine.engine import LLMEngine
    from dsv4.kernels.ref.batch_invariant import batch_invariant
    from dsv4.model.forward_mode import INFERENCE, Replay
    from dsv4.rl.algorithms import logprob_abs_diff
    from dsv4.rl.batch import pack
    from dsv4.rl.objective import sequence_logprobs
    from dsv4.rl.rollout import sample_token_ids

    device = next(model.parameters()).device
    n = args.prompts * args.group_size
    page = 256 if device.type == "cuda" else 128
    tokens = n * (args.prompt_len + args.max_tokens)
    engine = LLMEngine(model, EngineConfig(
        page_size=page, max_running_requests=n, max_total_tokens=2 * tokens + n * page,
        kernel_backend=backend, capture_routing=True,
        chunked_prefill_size=args.chunked_prefill_size,
        disable_prefix_cache=True, batch_invariant=true_on_policy, invariant_plans=values))
    # a first rollout compiles the kernels and captures the CUDA graphs; the second is timed
    sample_token_ids(engine, prompts, args.group_size, 1.0, args.max_tokens, seed=1)
    t0 = time.perf_counter()
    samples = sample_token_ids(engine, prompts, args.group_size, 1.0, args.max_tokens, seed=0)
    rollout_s = time.perf_counter() - t0
    full = pack(samples, torch.zeros(len(samples)), routing=True, indexer=True).to(device)
    assert full.replay is not None
    sync_s = 0.0 if true_on_policy else time_sync(engine, model)
    engine.release_memory()
    ops = engine.runner.ops if values else None
    numerics = batch_invariant if true_on_policy else contextlib.nullcontext
    rows = []
    for replay in REPLAYS:
        chosen = (None if replay == "none" else
                  Replay(full.replay.experts,
                         full.replay.indexer if replay == "routing,indexer" else None))
        t1 = time.perf_counter()
        with torch.no_grad(), numerics():
            logp, _ = sequence_logprobs(model, full.inputs, full.targets,
                                        INFERENCE.with_replay(chosen,
                                                              true_on_policy and not values)
                                        .with_values(ops), 1.0)
        mean, top = logprob_abs_diff(logp, full.rollout_logp, full.mask)
        rows.append({"replay": replay, "mode": mode, "true_on_policy": true_on_policy,
                     "step0_mean": float(mean), "step0_max": float(top), "last_mean": float(mean),
                     "last_max": float(top), "rollout_s": rollout_s,
                     "train_s": time.perf_counter() - t1, "sync_s": sync_s,
                     "step_s": rollout_s + time.perf_counter() - t1})
    return rows


def time_sync(engine: object, model: torch.nn.Module, chunk_bytes: int = 8 << 30) -> float:
    """Seconds `engine.update_weights` takes for every parameter and buffer of `model` (the
    engine serves `model` itself, so the sources are clones, made and sent in chunks of about
    `chunk_bytes` to bound memory; only the update calls are timed)."""
    from dsv4.engine.engine import LLMEngine

    assert isinstance(engine, LLMEngine)
    named = list(model.state_dict().items())
    total, start = 0.0, 0
    while start < len(named):
        end, size = start, 0
        while end < len(named) and (size == 0 or size + named[end][1].nbytes <= chunk_bytes):
            size += named[end][1].nbytes
            end += 1
        chunk = {name: t.clone() for name, t in named[start:end]}
        sync(model)
        t0 = time.perf_counter()
        engine.update_weights(chunk)
        sync(model)
        total += time.perf_counter() - t0
        del chunk
        start = end
    return total


def sync(model: torch.nn.Module) -> None:
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(default_model_path()))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kernel-backend", default="ref")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--modes", default="default,true-on-policy",
                   help=f"comma list of: {', '.join(MODES)}")
    p.add_argument("--preset", default=None,
                   help="random weights of this preset, step 0, forward only (e.g. flash-4l)")
    p.add_argument("--prompt-len", type=int, default=128, help="with --preset")
    p.add_argument("--max-tokens", type=int, default=16, help="with --preset")
    p.add_argument("--chunked-prefill-size", type=int, default=2048, help="with --preset")
    p.add_argument("--replays", default=",".join(r.replace(",", "+") for r in REPLAYS),
                   help="+-joined settings, comma list (default: all)")
    p.add_argument("--formulation", default="serving", choices=["serving", "training"],
                   help="the trainer's formulation (RLConfig.formulation; not with --preset)")
    p.add_argument("--disable-cuda-graph", action="store_true",
                   help="the engine's decode runs eagerly (not with --preset)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    replays = [r.replace("+", ",") for r in args.replays.split(",")]
    bad = sorted(set(replays) - set(REPLAYS))
    if bad:
        p.error(f"--replays: unknown {bad}; allowed: {[r.replace(',', '+') for r in REPLAYS]}")
    modes = args.modes.split(",")
    if set(modes) - set(MODES):
        p.error(f"--modes: unknown {sorted(set(modes) - set(MODES))}; allowed: {list(MODES)}")
    rows = (measure_random(args, modes) if args.preset is not None else
            [measure(args, replay, mode) for mode in modes for replay in replays])
    print(f"{'mode':16} {'replay':16} {'step0 mean':>11} {'step0 max':>10} {'last mean':>10} "
          f"{'last max':>10} {'step s':>7} {'sync s':>7}")
    for r in rows:
        print(f"{r['mode']!s:16} {r['replay']!s:16} {r['step0_mean']:11.3g} {r['step0_max']:10.3g} "
              f"{r['last_mean']:10.3g} {r['last_max']:10.3g} {r['step_s']:7.3f} {r['sync_s']:7.3f}")
    result = {"device": args.device, "gpu": (torch.cuda.get_device_name()
                                             if args.device.startswith("cuda") else None),
              "dtype": args.dtype, "kernel_backend": args.kernel_backend, "steps": args.steps,
              "model": args.preset or args.model,
              "torch": torch.__version__, "rows": rows}
    print(json.dumps(result))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
