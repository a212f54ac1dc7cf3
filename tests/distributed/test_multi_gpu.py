"""Issue 22's GPU equivalence lines on 2 CUDA GPUs (NCCL; skipped without them): dsv4-tiny in fp32
served with TP 2, TP 2 + EP 2 and DP attention 2 + EP 2 (CUDA graphs and the engine's defaults:
the collectives inside the captured decode graphs) gives one GPU's greedy and seeded tokens, and
log-probs within 1e-5 (summation order); a weight update from another checkpoint reaches both
ranks; `load_format="dummy"` draws the same random model on each rank's GPU as on one GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.assets import default_model_path
from dsv4.checkpoint.presets import get_preset
from dsv4.checkpoint.writer import write_checkpoint

pytestmark = pytest.mark.multi_gpu

LAYOUTS = {"tp2": {"tensor_parallel_size": 2},
           "tp2-ep2": {"tensor_parallel_size": 2, "expert_parallel_size": 2},
           "dp2-ep2": {"data_parallel_size": 2, "expert_parallel_size": 2}}
KW: dict[str, object] = dict(dtype="float32", device="cuda", page_size=128,
                             max_total_tokens=8192, max_running_requests=8)


def run(llm: LLM) -> list[tuple[list[int], list[float]]]:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 4096, (n,), generator=g).tolist() for n in (300, 17, 129, 64)]
    params = [SamplingParams(max_tokens=24, temperature=0.0 if i % 2 else 0.8, seed=i,
                             ignore_eos=True, logprobs=0) for i in range(len(prompts))]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [(o.token_ids, o.logprobs) for o in outs]


def assert_same(got: list[tuple[list[int], list[float]]],
                want: list[tuple[list[int], list[float]]]) -> None:
    assert [g for g, _ in got] == [w for w, _ in want]
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-5


@pytest.fixture(scope="module")
def one_gpu() -> list[tuple[list[int], list[float]]]:
    return run(LLM(default_model_path(), **KW))  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp32_tiny_equals_one_gpu(one_gpu: list[tuple[list[int], list[float]]],
                                  layout: str) -> None:
    with LLM(default_model_path(), **LAYOUTS[layout], **KW) as llm:  # type: ignore[arg-type]
        assert_same(run(llm), one_gpu)


def test_weight_update_reaches_both_gpus(tmp_path: Path,
                                         one_gpu: list[tuple[list[int], list[float]]]) -> None:
    other = tmp_path / "other"
    write_checkpoint(get_preset("tiny"), other, seed=11, tokenizer=False,
                     weight_quant="fp8+fp4")
    want = run(LLM(other, **KW))  # type: ignore[arg-type]
    with LLM(default_model_path(), **LAYOUTS["tp2-ep2"], **KW) as llm:  # type: ignore[arg-type]
        llm.engine.load_weights_from_dir(other)
        assert_same(run(llm), want)
        llm.engine.load_weights_from_dir(default_model_path())
        assert_same(run(llm), one_gpu)


def test_dummy_weights_across_gpus_equal_one_gpu(tmp_path: Path) -> None:
    write_checkpoint(get_preset("tiny"), tmp_path, weights=False, tokenizer=False)
    kw = {**KW, "load_format": "dummy", "seed": 5}
    want = run(LLM(tmp_path, **kw))  # type: ignore[arg-type]
    with LLM(tmp_path, **LAYOUTS["tp2-ep2"], **kw) as llm:  # type: ignore[arg-type]
        assert_same(run(llm), want)
