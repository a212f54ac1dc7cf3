"""`LLM(..., tensor_parallel_size=2)`: rank 0 in this process, rank 1 spawned (gloo on CPU),
rank 0's engine calls mirrored to rank 1 each step (`engine/parallel.py`; issue 22).

Greedy and seeded-sampling outputs equal one process's, with TP 2 + EP 2 (FP4 experts in
checkpoint encoding), across chunked prefill, preemption (a small KV cache) and a second round
served from the prefix cache; structured output (TP 2 + EP 2, DP 2) gives one process's texts;
a dead rank is an error at the next step, not a hang; bad layouts are refused at the edge."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dsv4 import LLM, SamplingParams
from dsv4.assets import default_model_path
from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import write_checkpoint
from dsv4.engine.request import RequestOutput
from dsv4.engine.sampling_params import StructuredOutput

KW: dict[str, object] = dict(dtype="float32", device="cpu", page_size=16, max_total_tokens=160,
                             chunked_prefill_size=24, max_running_requests=4)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tp") / "micro"
    write_checkpoint(micro(), path, seed=4, tokenizer=False)
    return path


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 512, (n,), generator=gen).tolist() for n in (37, 5, 50, 21)]
    params = [SamplingParams(max_tokens=20, temperature=0.0 if i % 2 else 1.0, seed=i,
                             ignore_eos=True, logprobs=0) for i in range(len(prompts))]
    return prompts, params


def run(llm: LLM) -> list[tuple[list[int], list[float], int]]:
    prompts, params = workload()
    outs = []
    for _ in range(2):                                  # the second round hits the prefix cache
        outs += llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [(o.token_ids, o.logprobs, o.cached_tokens) for o in outs]


@pytest.mark.slow
def test_tensor_and_expert_parallel_llm_equals_one_process_and_a_dead_rank_is_an_error(
        tmp_path: Path) -> None:
    """TP 2 + EP 2 through the mirrored engine equals one process, with FP4 experts kept in
    checkpoint encoding (`weight_format="checkpoint"`) split by id: each rank loads only its
    experts' codes and scales, and the outputs equal one process's in the same format. Then rank
    1 is killed and the next step is an error naming it, not a hang. Bf16 experts split by id
    through this mirror are `test_structured_output_across_ranks_equals_one_process[tp2-ep2]`'s
    (dsv4-tiny, dequantised) and `test_tp.py`'s tp2-ep2 row's on the engine. TP 2 alone (experts
    cut by TP) is the same mirror over the sharding that `test_tp.py`'s tp2 row checks on the
    engine (chunked prefill, a prefix-cache hit, preemptions) and `--tp-size 2` serves in
    `test_tensor_parallel.py`."""
    path = tmp_path / "micro-fp4"
    write_checkpoint(micro(), path, seed=4, weight_quant="fp8+fp4", tokenizer=False)
    want = run(LLM(path, weight_format="checkpoint", **KW))  # type: ignore[arg-type]
    assert any(c for _, _, c in want[4:]), "the second round never hit the prefix cache"
    with LLM(path, tensor_parallel_size=2, expert_parallel_size=2, weight_format="checkpoint",
             **KW) as llm:  # type: ignore[arg-type]
        got = run(llm)
        assert type(llm.model.layers[2].ffn.experts).__name__ == "LocalQuantExperts"
        assert llm.engine.scheduler.num_preemptions > 0
        worker = llm.engine.workers[0]
        worker.kill()
        worker.join()
        with pytest.raises(RuntimeError, match=r"rank\(s\) died: \[\('dsv4-rank-1'"):
            llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(
                max_tokens=2), use_tqdm=False)
    assert [g[0] for g in got] == [w[0] for w in want], "tokens differ"
    assert [g[2] for g in got] == [w[2] for w in want]
    for (_, a, _), (_, b, _) in zip(got, want, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-5


SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0,
                                                      "maximum": 99}}, "required": ["answer"]}
SPECS = [StructuredOutput("json_schema", json.dumps(SCHEMA)),
         StructuredOutput("regex", r"[0-9]{1,3} apples"), StructuredOutput("json_object")]
PROMPTS = ["What is 12+7?", "How many apples?", "Describe a cat.", "What is 3*4?"]


def structured_params() -> list[SamplingParams]:
    """Greedy and seeded-sampling requests, each under one of SPECS."""
    return [SamplingParams(max_tokens=32, temperature=0.0 if i % 2 else 1.0, seed=i,
                           structured=SPECS[i % len(SPECS)]) for i in range(len(PROMPTS))]


TINY_KW: dict[str, object] = dict(dtype="float32", device="cpu", page_size=128)


@pytest.fixture(scope="module")
def structured_one_process() -> list[RequestOutput]:
    """One process's outputs of the structured requests: the reference of every layout."""
    return LLM(default_model_path(), **TINY_KW).generate(  # type: ignore[arg-type]
        PROMPTS, structured_params(), use_tqdm=False)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2, "expert_parallel_size": 2},
                                    {"data_parallel_size": 2}], ids=["tp2-ep2", "dp2"])
def test_structured_output_across_ranks_equals_one_process(
        layout: dict[str, int], structured_one_process: list[RequestOutput]) -> None:
    """JSON schema, regex and JSON object requests, greedy and sampled, on dsv4-tiny: every rank
    compiles a request's grammar before adding it (so all admit it at the same step) and masks
    alike, giving one process's texts; a spec that does not compile is refused on rank 0."""
    want = structured_one_process
    with LLM(default_model_path(), **layout, **TINY_KW) as llm:  # type: ignore[arg-type]
        got = llm.generate(PROMPTS, structured_params(), use_tqdm=False)
        with pytest.raises(ValueError, match="structured.spec does not compile"):
            llm.engine.add_request([5, 6], SamplingParams(
                max_tokens=2, structured=StructuredOutput("regex", "(")))
    assert [g.text for g in got] == [w.text for w in want]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert isinstance(json.loads(got[0].text)["answer"], int)


@pytest.mark.parametrize(("kw", "field"), [
    (dict(tensor_parallel_size=0), "tensor_parallel_size=0"),
    (dict(tensor_parallel_size=2, expert_parallel_size=3), "expert_parallel_size=3"),
    (dict(tensor_parallel_size=3), "does not divide num_heads=4"),
])
def test_bad_layouts_are_refused(ckpt: Path, kw: dict, field: str) -> None:
    """Refused before any rank starts: no child process, no process group left behind."""
    with pytest.raises(ValueError, match=field):
        LLM(ckpt, **KW, **kw)  # type: ignore[arg-type]
    assert not multiprocessing.active_children() and not dist.is_initialized()
