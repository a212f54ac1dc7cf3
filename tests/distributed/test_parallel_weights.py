"""Weight updates through tensor / expert / data-parallel engines (`engine/parallel_weights.py`,
issues 22 and 24): rank 0 takes full tensors, every rank applies its part.

Two checkpoints of one geometry (seeds 4 and 5). A parallel `LLM` loaded from the first and
updated from the second (`load_weights_from_dir`) gives the greedy and seeded-sampling tokens and
log-probs of one process loaded from the second: TP 2 + EP 2 with FP4 experts and FP8 linears
kept in checkpoint encoding (their cuts whole scale blocks, so each rank re-encodes its
cut to the full load's codes), and DP attention 2 + EP 2. A refused update (non-finite values in
rank 1's part only, a split dimension of the wrong size) changes no rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fp8_geometry import micro_blocks

from dsv4 import LLM, SamplingParams
from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import write_checkpoint

KW: dict[str, object] = dict(dtype="float32", device="cpu", page_size=16, max_total_tokens=256,
                             chunked_prefill_size=32, max_running_requests=4)
LAYOUTS = {"tp2-ep2-fp8": dict(tensor_parallel_size=2, expert_parallel_size=2,
                               weight_format="checkpoint"),
           "dp2-ep2": dict(data_parallel_size=2, expert_parallel_size=2)}

Outputs = list[tuple[list[int], list[float]]]


def run(llm: LLM) -> Outputs:
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 512, (n,), generator=gen).tolist() for n in (37, 5, 21)]
    params = [SamplingParams(max_tokens=12, temperature=0.0 if i % 2 else 1.0, seed=i,
                             ignore_eos=True, logprobs=0) for i in range(len(prompts))]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [(o.token_ids, o.logprobs) for o in outs]


def assert_same(got: Outputs, want: Outputs) -> None:
    assert [g for g, _ in got] == [w for w, _ in want]
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_update_reaches_every_rank(tmp_path: Path, layout: str) -> None:
    fp8 = layout.endswith("fp8")
    config, quant = (micro_blocks(), "fp8+fp4") if fp8 else (micro(), "none")
    old, new = tmp_path / "old", tmp_path / "new"
    for path, seed in ((old, 4), (new, 5)):
        write_checkpoint(config, path, seed=seed, tokenizer=False, weight_quant=quant)
    fmt = {"weight_format": "checkpoint"} if fp8 else {}
    want = run(LLM(new, **fmt, **KW))  # type: ignore[arg-type]
    with LLM(old, **LAYOUTS[layout], **KW) as llm:  # type: ignore[arg-type]
        before = run(llm)
        assert [t for t, _ in before] != [t for t, _ in want], "the seeds give the same tokens"
        model = llm.engine.runner.model
        head = model.head.weight
        rows = head.shape[0] * (2 if layout.startswith("tp") else 1)   # vocab-parallel under TP
        bad = torch.zeros(rows, head.shape[1])
        bad[-1, 0] = float("nan")              # in the last rank's rows only
        with pytest.raises(ValueError, match="non-finite"):
            llm.engine.update_weights({"head.weight": bad})
        with pytest.raises(ValueError, match="shape"):
            llm.engine.update_weights({"head.weight": bad[:-2]})
        assert_same(run(llm), before)          # refused: every rank kept its weights
        assert llm.engine.load_weights_from_dir(new) > 0
        assert llm.engine.weight_version == 1
        assert_same(run(llm), want)
