"""Where the trainer's forward first differs from the engine's prefill, module by module (issue 18).

    PYTHONPATH=src python3 benchmarks/values_bisect.py --preset tiny --prompt-len 100

Random weights of `--preset` (bf16, CUDA). One prompt is prefilled by an engine on the triton
backend with token-count-invariant plans (one step of `--prompt-len` tokens, routing and indexer
captured) and decoded for `--decode` more tokens (eager, one token per step); then the
full-sequence forward on the same tokens runs with the trainer's mode (values from the engine's
kernels, the recorded selections replayed). Forward hooks on every submodule record each call's
tensor output; each module's prefill rows and each decode step's row are compared with the
trainer's rows at those positions, bit for bit, in call order. `--batch-invariant`: both sides
under `batch_invariant()` (fixed-tile GEMMs and reductions). Prints the first differing modules
of the prefill and of the decode steps, and one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import json
from contextlib import nullcontext
from typing import Any

import torch

from dsv4.checkpoint.presets import get_preset
from dsv4.checkpoint.writer import random_model
from dsv4.config.engine import EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.kernels.ref.batch_invariant import batch_invariant
from dsv4.model.compressor import Compressor
from dsv4.model.forward_mode import INFERENCE, Replay
from dsv4.rl.batch import pack
from dsv4.rl.rollout import sample_token_ids


def record(model: torch.nn.Module, store: dict[str, list[torch.Tensor]]) -> list[Any]:
    """Forward hooks on every submodule of the blocks, and each compressor's projections (its
    `project` method, which both paths call) under `NAME.project.kv` / `.score`."""
    handles: list[Any] = []
    for name, mod in model.named_modules():
        if not name.startswith("layers."):
            continue
        if isinstance(mod, Compressor):
            handles.append(_record_project(mod, name, store))

        def hook(_m: Any, _i: Any, out: Any, name: str = name) -> None:
            if isinstance(out, torch.Tensor):
                store[name].append(out.detach().clone())
        handles.append(mod.register_forward_hook(hook))
    return handles


class _Restore:
    def __init__(self, mod: Compressor) -> None:
        self.mod = mod

    def remove(self) -> None:
        del self.mod.project


def _record_project(mod: Compressor, name: str, store: dict[str, list[torch.Tensor]]) -> _Restore:
    bound = mod.project

    def project(x: torch.Tensor, positions: torch.Tensor,
                ops: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        kv, score = bound(x, positions, ops)
        store[f"{name}.project.kv"].append(kv.detach().clone())
        store[f"{name}.project.score"].append(score.detach().clone())
        return kv, score
    mod.project = project  # type: ignore[method-assign]
    return _Restore(mod)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--decode", type=int, default=3)
    p.add_argument("--batch-invariant", action="store_true")
    args = p.parse_args()
    config = get_preset(args.preset)
    model = random_model(config, torch.bfloat16, torch.device("cuda"), seed=args.seed)
    engine = LLMEngine(model, EngineConfig(
        page_size=256, max_running_requests=1, max_total_tokens=4096, kernel_backend="triton",
        capture_routing=True, disable_prefix_cache=True, disable_cuda_graph=True,
        invariant_plans=True, chunked_prefill_size=8192, batch_invariant=args.batch_invariant))
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(2, config.vocab_size, (args.prompt_len,), generator=gen).tolist()
    eng: dict[str, list[torch.Tensor]] = collections.defaultdict(list)
    handles = record(model, eng)
    samples = sample_token_ids(engine, [prompt], 1, 1.0, args.decode + 1, seed=0)
    for h in handles:
        h.remove()
    batch = pack(samples, torch.zeros(1), routing=True, indexer=True).to("cuda")
    assert batch.replay is not None
    mode = INFERENCE.with_replay(Replay(batch.replay.experts, batch.replay.indexer),
                                 args.batch_invariant)
    mode = mode.with_values(engine.runner.ops)
    tr: dict[str, list[torch.Tensor]] = collections.defaultdict(list)
    handles = record(model, tr)
    with torch.no_grad(), (batch_invariant() if args.batch_invariant else nullcontext()):
        model(batch.inputs, mode)
    for h in handles:
        h.remove()
    P, rows = args.prompt_len, []
    for name, outs in eng.items():
        if name not in tr:
            continue
        b = tr[name][0]
        b = b.reshape(-1, b.shape[-1]) if b.dim() > 1 else b
        for call, a in enumerate(outs):
            a = a.reshape(-1, a.shape[-1]) if a.dim() > 1 else a
            ref = b[:P] if call == 0 else b[P - 1 + call:P + call]
            if a.shape != ref.shape:
                continue
            diff = (a.float() - ref.float()).abs()
            rows.append({"module": name, "call": call, "differ": int((diff > 0).sum()),
                         "of": a.numel(), "max_abs": float(diff.max())})
    for phase in ("prefill", "decode"):
        bad = [r for r in rows if r["differ"] and (r["call"] == 0) == (phase == "prefill")]
        bad.sort(key=lambda r: r["call"])
        print(phase, "first differing:", bad[:6])
    print(json.dumps({"preset": args.preset, "prompt_len": args.prompt_len, "rows": rows}))


if __name__ == "__main__":
    main()
