"""`benchmarks/engine_backend_check.py`'s teacher forcing really forces: the forced engine ends
with the forced tokens, and its choice at each position is the greedy token after the forced
context (checked against a plain engine run on prompt + forced prefix). micro preset, ref backend,
CPU."""

from __future__ import annotations

import torch
from bench_script import load_benchmark

from dsv4 import SamplingParams
from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import random_model


def test_teacher_forcing_feeds_forced_tokens() -> None:
    check = load_benchmark("engine_backend_check")
    model = random_model(micro(), torch.float32, torch.device("cpu"), seed=3)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (21, 34)]
    forced = [torch.randint(2, 512, (4,), generator=g).tolist() for _ in prompts]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)
    free, _ = check.generate(model, "ref", prompts, params, 16)
    reqs, chosen = check.generate(model, "ref", prompts, params, 16, forced=forced)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        assert reqs[i].output_ids == forced[i]
        assert chosen[i][0] == free[i].output_ids[0]
        # the choice after n forced tokens = greedy continuation of prompt + forced[:n]
        for n in (1, 3):
            want, _ = check.generate(model, "ref", [prompt + forced[i][:n]], one, 16)
            assert chosen[i][n] == want[0].output_ids[0]
    result = check.compare(free, free, [r.output_ids for r in free], free)
    assert (result["identical_tokens"] == result["total_tokens"] == 8
            and result["teacher_forced_agreement"] == 1.0)
    assert check.compare(free, free, forced, reqs)["teacher_forced_agree"] == sum(
        a == b for r, f in zip(free, forced, strict=True)
        for a, b in zip(r.output_ids, f, strict=True))
