"""Acceptance of MTP speculative decoding against the drafter's offline per-position accuracy.

    PYTHONPATH=src python benchmarks/spec_acceptance.py [--prompts 32 --output-len 32]

On the same prompts (held-out arithmetic problems, greedy, fp32) and for each N:
- offline: the speculative engine is fed one token per step (its drafts are recorded after every
  step, then dropped, so no step verifies anything): at every position the MTP chain drafts N
  tokens from the true context. r = the number of leading drafts equal to the true greedy
  continuation. Per-position accuracy a_j = P(r >= j | r >= j - 1); predicted tokens per verify
  pass L = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_N (= 1 + E[r]).
- measured: the same engine speculating normally; L = tokens emitted per verify pass.
Both engines must emit the plain greedy tokens (asserted). Prints a table per N, then one JSON
line (also written to --out).
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path
from typing import Any

import torch

from dsv4 import LLM, SamplingParams
from dsv4.assets import default_model_path
from dsv4.engine.request import Request
from dsv4.engine.step_output import StepResult
from dsv4.rl.rewards import ArithmeticTask


def offline_runs(llm: LLM, texts: list[str], params: SamplingParams,
                 truth: list[list[int]]) -> list[int]:
    """r per drafting position (module docstring), teacher-free: the engine's own greedy tokens
    are the truth (asserted equal to the plain engine's)."""
    engine = llm.engine
    recorded: dict[str, list[tuple[int, list[int]]]] = {}
    original = engine._process

    def process(result: StepResult) -> list[Request]:
        updated = original(result)
        for req in engine.scheduler.running:
            if req.draft_ids:
                recorded.setdefault(req.rid, []).append((len(req.output_ids), req.draft_ids))
                req.draft_ids = []
        return updated
    engine._process = process  # type: ignore[method-assign]
    try:
        outs = llm.generate(texts, params, use_tqdm=False)
    finally:
        engine._process = original  # type: ignore[method-assign]
    runs = []
    for out, want in zip(outs, truth, strict=True):
        assert out.token_ids == want, "one-token steps changed the greedy tokens"
        for n_out, drafts in recorded.get(out.request_id, []):
            nxt = want[n_out:n_out + len(drafts)]        # the tokens after the pending one
            if len(nxt) < len(drafts):
                continue                                   # too close to the end to score
            r = 0
            while r < len(drafts) and drafts[r] == nxt[r]:
                r += 1
            runs.append(r)
    return runs


def predicted(runs: list[int], N: int) -> tuple[list[float], float]:
    """(a_1..a_N, 1 + sum of their running products)."""
    alphas, total, alive = [], 1.0, 1.0
    for j in range(1, N + 1):
        reach = sum(1 for r in runs if r >= j - 1)
        a = sum(1 for r in runs if r >= j) / reach if reach else 0.0
        alphas.append(a)
        alive *= a
        total += alive
    return alphas, total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(default_model_path()))
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--steps", default="1,2,3,4")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    levels = (3, 4, 5, 6)
    held = ArithmeticTask(levels).heldout_prompts(-(-args.prompts // len(levels)))
    texts = [q.text for q in random.Random(0).sample(held, args.prompts)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    kw: dict[str, Any] = dict(dtype="float32", device="cpu", page_size=128,
                              max_total_tokens=args.prompts * 4 * 128,
                              max_running_requests=args.prompts)
    truth = [o.token_ids for o in LLM(args.model, **kw).generate(texts, params, use_tqdm=False)]
    rows = []
    for N in (int(n) for n in args.steps.split(",")):
        runs = offline_runs(LLM(args.model, speculative_num_steps=N, **kw), texts, params, truth)
        alphas, want = predicted(runs, N)
        spec = LLM(args.model, speculative_num_steps=N, **kw)
        outs = spec.generate(texts, params, use_tqdm=False)
        assert [o.token_ids for o in outs] == truth, "speculation changed the greedy tokens"
        got = spec.engine.mean_acceptance_length()
        assert got is not None
        rows.append({"N": N, "positions": len(runs), "alphas": alphas, "predicted": want,
                     "measured": got, "verify_passes": sum(spec.engine.spec_accept_hist),
                     "rel_diff": got / want - 1})
        print(f"N={N}  a = {' '.join(f'{a:.3f}' for a in alphas)}  predicted {want:.3f}  "
              f"measured {got:.3f}  ({(got / want - 1) * 100:+.1f}%, {len(runs)} positions, "
              f"{rows[-1]['verify_passes']} verify passes)", flush=True)
    result = {"bench": "spec_acceptance", "model": args.model, "prompts": args.prompts,
              "output_len": args.output_len, "torch": torch.__version__, "rows": rows}
    print(json.dumps(result))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
