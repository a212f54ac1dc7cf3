"""Where a true on-policy step's non-zero drift comes from (issue 18): engine or trainer side.

    PYTHONPATH=src python benchmarks/drift_events.py --device cuda --dtype bfloat16 \
        --kernel-backend triton --steps 25 --prompts 32 --group-size 16 --lr 1e-5

Runs `dsv4 rl`'s step (rollout, pack, trainer forward, optimizer step, sync) in true on-policy
mode (the default on a fused backend; on `ref` it needs `--formulation serving`). At every step
where some response token's trainer log-prob differs from the engine's sampling log-prob, up to
`--per-step` of the differing samples are re-scored, the weights unchanged (before the step's
update):

* `train_alone`: the trainer's forward on that sample alone (a batch of one);
* `train_again`: the trainer's forward on the whole batch again (determinism);
* `engine_alone`: the engine samples that request alone, with its seed (same tokens expected);
* `engine_group`: the engine samples that request's group (its `group_size` requests) alone;
* `engine_again`: the whole rollout again (determinism).

Each is the largest |log-prob difference| over the sample's response tokens against the
in-batch trainer value, and against the in-batch rollout value; a side whose value changes
when the batch changes is the batch-dependent side. `--bisect`: for the first such sample, the
trainer's forward runs again on the whole batch and on the sample alone with hooks on every
submodule (`values_bisect.record`), and the modules whose output rows of that sample differ
are listed in call order. Prints one line per event, then one JSON line (`--out` also writes
it).
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import tempfile
from pathlib import Path
from typing import Any

import torch
from values_bisect import record

from dsv4.assets import default_model_path
from dsv4.rl.batch import advantages_of, group_rewards, pack
from dsv4.rl.config import RLConfig
from dsv4.rl.rollout import Sample, sampling_params
from dsv4.rl.trainer import RLTrainer


def request_seeds(config: RLConfig, step: int, n: int) -> list[int]:
    """The per-request sampling seeds of rollout `step` (round 0), as `rollout` draws them."""
    rng = random.Random(f"dsv4-rl-sample-{hash((config.seed, step, 0)) % 2**31}")
    return [rng.randrange(2**62) for _ in range(n)]


def sample_again(trainer: RLTrainer, samples: list[Sample], seeds: list[int]
                 ) -> list[tuple[list[int], list[float]]]:
    """(output ids, sampling log-probs) of `samples`' prompts run together with `seeds`."""
    c, engine = trainer.config, trainer.engine
    reqs = [engine.add_request(s.tokens[:s.prompt_len],
                               sampling_params(c.temperature, c.max_tokens, seed))
            for s, seed in zip(samples, seeds, strict=True)]
    while engine.has_unfinished():
        engine.step()
    done = [engine.pop(r.rid) for r in reqs]
    return [(d.output_ids, list(d.logprobs)) for d in done]


def scores(trainer: RLTrainer, samples: list[Sample]) -> torch.Tensor:
    """The trainer's log-probs [B, L-1] of `samples` packed as `train_step` packs them."""
    batch = pack(samples, torch.zeros(len(samples)), trainer.config.replay_routing,
                 trainer.config.replay_indexer).to(trainer.device)
    with torch.no_grad():
        return trainer.policy_logprobs(batch)[0].float().cpu()


def response(row: torch.Tensor, s: Sample) -> torch.Tensor:
    return row[s.prompt_len - 1:len(s.tokens) - 1]


def gap(a: list[float] | torch.Tensor, b: list[float] | torch.Tensor) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32)
    if a.shape != b.shape:
        return float("nan")
    return float((a - b).abs().max()) if a.numel() else 0.0


def hooked(trainer: RLTrainer, samples: list[Sample]) -> list[tuple[str, torch.Tensor]]:
    """Every hooked module output of the trainer's forward on `samples`, in call order."""
    store: dict[str, list[torch.Tensor]] = collections.defaultdict(list)
    order: list[str] = []
    handles = record(trainer.compute, _Ordered(store, order))
    try:
        scores(trainer, samples)
    finally:
        for h in handles:
            h.remove()
    calls: dict[str, int] = collections.Counter()
    out = []
    for name in order:
        out.append((name, store[name][calls[name]]))
        calls[name] += 1
    return out


class _Ordered(dict):  # type: ignore[type-arg]
    """A defaultdict(list) that also logs the key of every append, in order."""

    def __init__(self, store: dict[str, list[torch.Tensor]], order: list[str]) -> None:
        super().__init__()
        self.store, self.order = store, order

    def __getitem__(self, name: str) -> Any:
        self.order.append(name)
        return self.store[name]


def sample_rows(t: torch.Tensor, b: int, batch: int, width: int) -> torch.Tensor | None:
    """Sample b's rows of a module output of a batch of `batch` rows, `width` positions each:
    [batch, ...] indexed, or [batch * width, ...] flattened; None when neither."""
    if t.dim() and t.shape[0] == batch:
        return t[b]
    if t.dim() and t.shape[0] == batch * width:
        return t.view(batch, width, *t.shape[1:])[b]
    return None


def bisect(trainer: RLTrainer, samples: list[Sample], b: int) -> list[dict[str, Any]]:
    """The modules whose output rows of sample b differ between the whole batch and b alone."""
    whole, alone = hooked(trainer, samples), hooked(trainer, [samples[b]])
    width = max(len(s.tokens) for s in samples) - 1
    rows = []
    for (name, a), (name_z, z) in zip(whole, alone, strict=False):
        if name != name_z:
            rows.append({"module": name, "note": f"call order differs: {name_z}"})
            break
        ra = sample_rows(a, b, len(samples), width)
        rz = sample_rows(z, 0, 1, len(samples[b].tokens) - 1)
        if ra is None or rz is None or ra.dim() == 0 or ra.shape[1:] != rz.shape[1:]:
            continue
        n = min(ra.shape[0], rz.shape[0])
        diff = (ra[:n].float() - rz[:n].float()).abs()
        if diff.numel() and diff.max() > 0:
            first = int(torch.nonzero(diff.flatten(1).amax(1) > 0)[0]) if diff.dim() > 1 else 0
            rows.append({"module": name, "shape": list(a.shape), "differ": int((diff > 0).sum()),
                         "of": diff.numel(), "max_abs": float(diff.max()), "first_row": first})
    return rows


def diagnose(trainer: RLTrainer, step: int, samples: list[Sample], train: torch.Tensor,
             per_step: int, bisect_first: bool) -> list[dict[str, Any]]:
    c = trainer.config
    seeds = request_seeds(c, step, len(samples))
    rows = []
    for b, s in enumerate(samples):
        t, r = response(train[b], s), torch.tensor(s.logprobs)
        if (t - r).abs().max() > 0:
            rows.append(b)
    events = []
    train_again = scores(trainer, samples)
    rerun = sample_again(trainer, samples, seeds)
    for b in rows[:per_step]:
        s = samples[b]
        t, r = response(train[b], s), torch.tensor(s.logprobs)
        d = (t - r).abs()
        g0 = b - b % c.group_size
        group = sample_again(trainer, samples[g0:g0 + c.group_size],
                             seeds[g0:g0 + c.group_size])[b - g0]
        alone = sample_again(trainer, [s], [seeds[b]])[0]
        out = s.tokens[s.prompt_len:]
        events.append({
            "step": step, "sample": b, "prompt_len": s.prompt_len, "response_len": len(out),
            "tokens_differing": int((d > 0).sum()), "positions": torch.nonzero(d > 0).flatten()
            .tolist(), "max_diff": float(d.max()),
            "train_alone_vs_train": gap(response(scores(trainer, [s])[0], s), t),
            "train_again_vs_train": gap(response(train_again[b], s), t),
            "engine_alone_vs_rollout": gap(alone[1], r),
            "engine_alone_same_tokens": alone[0] == out,
            "engine_alone_vs_train": gap(alone[1], t),
            "engine_group_vs_rollout": gap(group[1], r),
            "engine_group_same_tokens": group[0] == out,
            "engine_again_vs_rollout": gap(rerun[b][1], r)})
        if bisect_first and len(events) == 1:
            events[0]["bisect"] = bisect(trainer, samples, b)
    return events


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        config = RLConfig(model=args.model, out_dir=tmp, steps=args.steps, lr=args.lr,
                          group_size=args.group_size, prompts_per_step=args.prompts,
                          levels=tuple(args.levels), device=args.device, dtype=args.dtype,
                          kernel_backend=args.kernel_backend, formulation=args.formulation,
                          true_on_policy=True)
        trainer = RLTrainer(config)
        events: list[dict[str, Any]] = []
        nonzero = 0
        for step in range(args.steps):
            samples, _ = trainer.rollout()
            train = scores(trainer, samples)
            found = diagnose(trainer, step, samples, train, args.per_step,
                             args.bisect and not events)
            nonzero += bool(found)
            for e in found:
                print(json.dumps({k: v for k, v in e.items() if k != "bisect"}))
                for row in e.get("bisect", [])[:12]:
                    print("  bisect:", json.dumps(row))
            events += found
            batch = pack(samples, advantages_of(group_rewards(samples)), config.replay_routing,
                         config.replay_indexer).to(trainer.device)
            trainer.engine.release_memory()
            trainer._optimize(batch)
            trainer.engine.resume_memory()
            trainer.sync()
            trainer.step += 1
    return {"steps": args.steps, "samples_per_step": args.prompts * args.group_size,
            "nonzero_steps": nonzero, "events": events, "device": args.device,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "torch": torch.__version__}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(default_model_path()))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kernel-backend", default="triton")
    p.add_argument("--formulation", default="training", choices=["serving", "training"])
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--levels", type=int, nargs="+", default=[3, 4, 5, 6])
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--per-step", type=int, default=2, help="samples diagnosed per event step")
    p.add_argument("--bisect", action="store_true",
                   help="module-by-module, batch vs alone, for the first differing sample")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    result = run(args)
    print(json.dumps({k: v for k, v in result.items() if k != "events"}))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
