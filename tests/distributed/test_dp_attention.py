"""`LLM(..., data_parallel_size=2)`: data-parallel attention over 2 gloo ranks (rank 0 in this
process), each serving its own requests with the MoE layers over both ranks' tokens
(`distributed/dp.py`, `engine/parallel.py::DataParallelEngine`; issue 22).

Greedy and seeded-sampling tokens of `micro` and the shipped dsv4-tiny equal one process's, their
log-probs within 1e-5, over an odd number of prompts of different lengths (the ranks get 3 and 2
requests, and a one-prompt round leaves rank 1 idle throughout), chunked prefill, preemption on
rank 0 (a small KV cache per rank) and a second round that the ranks serve partly from their own
prefix caches; with expert parallelism (micro) and without (tiny). Unsupported settings are
refused at the edge."""

from __future__ import annotations

import dataclasses
import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_llm_parallel import KW

from dsv4 import LLM, SamplingParams
from dsv4.assets import default_model_path
from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import write_checkpoint
from dsv4.distributed.group import join_default_group
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)
Result = list[tuple[list[int], list[float], int, str | None]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    path = tmp_path_factory.mktemp("dp") / "micro"
    write_checkpoint(micro(), path, seed=4, tokenizer=False)
    return {"micro": path, "tiny": default_model_path()}



# dsv4-tiny: pages of 128 tokens (its HCA ratio), so prefix hits need prompts over 128 tokens
TINY_KW: dict[str, object] = {**KW, "page_size": 128, "max_total_tokens": 768,
                              "chunked_prefill_size": 96}
SETUPS: dict[str, tuple[dict[str, object], tuple[int, ...]]] = {
    "micro": (KW, (37, 5, 50, 21, 60)), "tiny": (TINY_KW, (250, 20, 245, 60, 240))}


def workload(lens: tuple[int, ...]) -> tuple[list[list[int]], list[SamplingParams]]:
    """Up to 5 prompts (one per length): rank 0 gets 0, 2, 4 (more KV than its pool: preempted),
    rank 1 gets 1, 3 (3 decodes longest, so rank 0 idles at the end of a round)."""
    gen = torch.Generator().manual_seed(1)
    max_tokens = (8, 6, 8, 20, 6)
    prompts = [torch.randint(2, 512, (n,), generator=gen).tolist() for n in lens]
    params = [SamplingParams(max_tokens=m, temperature=0.0 if i % 2 else 1.0, seed=i,
                             ignore_eos=True, logprobs=0) for i, m in enumerate(max_tokens)]
    return prompts, params[:len(prompts)]


def run(llm: LLM, lens: tuple[int, ...], full: bool = True) -> Result:
    """The workload's round; with `full`, a second (prefix-cache hits) and a one-request round."""
    prompts, params = workload(lens)
    outs = []
    for _ in range(2 if full else 1):   # the second round hits the (per-rank) prefix caches
        outs += llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    if full:    # one request: rank 1 has nothing to run in any step of this round
        one = dataclasses.replace(params[3], max_tokens=8)
        outs += llm.generate(prompt_token_ids=prompts[3:4], sampling_params=one, use_tqdm=False)
    return [(o.token_ids, o.logprobs, o.cached_tokens, o.finish_reason) for o in outs]


def count_steps(llm: LLM) -> list[int]:
    """Wrap the engine's `step` to count the calls (all ranks step on each)."""
    calls = [0]
    step = llm.engine.step

    def counted() -> Any:
        calls[0] += 1
        return step()

    llm.engine.step = counted  # type: ignore[method-assign]
    return calls


def assert_same(got: Result, want: Result, what: str) -> float:
    """Tokens and finish reasons equal; returns the largest log-prob difference (asserted
    <= 1e-5). Cached-token counts may differ: each rank's prefix cache holds only its own
    requests and evicts under its own pressure."""
    assert [g[0] for g in got] == [w[0] for w in want], f"{what}: tokens differ"
    assert [g[3] for g in got] == [w[3] for w in want], f"{what}: finish reasons differ"
    diff = max(abs(x - y) for (_, a, _, _), (_, b, _, _) in zip(got, want, strict=True)
               for x, y in zip(a, b, strict=True))
    assert diff <= 1e-5, f"{what}: log-probs differ by {diff}"
    return diff


def abort_on_rank_1(llm: LLM) -> None:
    """An abort reaches the owning rank: the request stops there at once (its mirror on rank 0
    too) and the engine drains; the rid is free again after `pop`."""
    engine = llm.engine
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    local, remote = (engine.add_request([5, 6, 7, 8], params) for _ in range(2))
    for _ in range(3):
        engine.step()
    engine.abort(remote.rid)
    assert remote.is_finished and remote.finish_reason == "abort"
    num = len(remote.output_ids)
    while engine.has_unfinished():
        engine.step()
    assert len(remote.output_ids) == num < 10 and len(local.output_ids) == 10
    assert engine.pop(remote.rid) is remote and engine.pop(local.rid) is local


@pytest.mark.slow
@pytest.mark.parametrize(("name", "ep"), [("micro", 2), ("tiny", 1)])
def test_dp_attention_equals_one_process(checkpoints: dict[str, Path], name: str,
                                         ep: int) -> None:
    """Each layout of the MoE layers once: experts split by id (EP 2) on micro, replicated on
    every rank (EP 1) on dsv4-tiny."""
    path, (kw, lens) = checkpoints[name], SETUPS[name]
    want = run(LLM(path, **kw), lens)  # type: ignore[arg-type]
    assert any(c for _, _, c, _ in want[5:10]), "the second round never hit the prefix cache"
    with LLM(path, data_parallel_size=2, expert_parallel_size=ep,
             **kw) as llm:  # type: ignore[arg-type]
        calls = count_steps(llm)
        got = run(llm, lens)
        rank0 = llm.engine.engine
        assert rank0.scheduler.num_preemptions > 0, "rank 0 was never preempted"
        assert rank0.steps < calls[0], "rank 0 never ran an idle step"
        assert not llm.engine.has_unfinished() and not rank0.requests
        abort_on_rank_1(llm)
    assert any(c for _, _, c, _ in got[5:10]), "no rank's prefix cache was ever hit"
    diff = assert_same(got, want, f"{name} ep={ep}")
    logger.info("%s ep=%d: max log-prob difference %.3g", name, ep, diff)


@pytest.mark.slow
def test_dp_attention_checkpoint_format_equals_one_process(
        checkpoints: dict[str, Path]) -> None:
    """dsv4-tiny in checkpoint precision (FP4 experts, FP8 linears) under DP 2 with EP 2: each
    rank reads only its experts (`load_dp_shard`), keeps them as FP4 codes and cuts the FP8
    shared experts, dequantised; the outputs equal one process in checkpoint precision (one
    round of the workload's first 3 prompts, 2 on rank 0 and 1 on rank 1: the preemption,
    prefix-cache and idle-rank rounds are the bf16 test's)."""
    path, (kw, lens) = checkpoints["tiny"], SETUPS["tiny"]
    fmt = {**kw, "weight_format": "checkpoint"}
    want = run(LLM(path, **fmt), lens[:3], full=False)  # type: ignore[arg-type]
    with LLM(path, data_parallel_size=2, expert_parallel_size=2,
             **fmt) as llm:  # type: ignore[arg-type]
        got = run(llm, lens[:3], full=False)
    diff = assert_same(got, want, "tiny checkpoint ep=2")
    logger.info("tiny checkpoint ep=2: max log-prob difference %.3g", diff)


def conversations(llm: LLM) -> Result:
    """Two conversations of two turns; the second turns in the other order, so that the shortest
    queue sends each to the rank that did not serve its first turn."""
    gen = torch.Generator().manual_seed(3)
    firsts = [torch.randint(2, 512, (40,), generator=gen).tolist() for _ in range(2)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompt_token_ids=firsts, sampling_params=params, use_tqdm=False)
    seconds = [firsts[i] + outs[i].token_ids + [7, 8, 9] for i in (1, 0)]
    outs += llm.generate(prompt_token_ids=seconds, sampling_params=params, use_tqdm=False)
    return [(o.token_ids, o.logprobs, o.cached_tokens, o.finish_reason) for o in outs]


@pytest.mark.slow
def test_cache_aware_routing_sends_a_conversation_back(checkpoints: dict[str, Path]) -> None:
    """`load_balance_method="cache_aware"`: each second turn goes to the rank that served its
    first and reads its prompt's pages from that rank's prefix cache, where the shortest queue
    misses both; the outputs are the same either way. One pair of ranks serves both: first
    without its router (what "shortest_queue" builds), then, the prefix caches flushed on every
    rank, with it (its view still empty, as at start)."""
    kw = {**KW, "max_total_tokens": 1024}
    runs = {}
    with LLM(checkpoints["micro"], data_parallel_size=2, load_balance_method="cache_aware",
             **kw) as llm:  # type: ignore[arg-type]
        router, llm.engine.router = llm.engine.router, None
        runs["shortest_queue"] = conversations(llm)
        llm.engine.flush_cache()
        llm.engine.router = router
        runs["cache_aware"] = conversations(llm)
    assert_same(runs["cache_aware"], runs["shortest_queue"], "cache_aware")
    assert [r[2] for r in runs["shortest_queue"][2:]] == [0, 0]
    assert all(r[2] >= 32 for r in runs["cache_aware"][2:]), runs["cache_aware"]


@pytest.mark.parametrize(("kw", "field"), [
    (dict(data_parallel_size=0), "data_parallel_size=0"),
    (dict(data_parallel_size=2, tensor_parallel_size=2), "tensor_parallel_size=2 with"),
    (dict(data_parallel_size=2, expert_parallel_size=3), "expert_parallel_size=3"),
    (dict(data_parallel_size=2, overlap_schedule=True), "overlap_schedule=True"),
])
def test_unsupported_dp_settings_are_refused(checkpoints: dict[str, Path], kw: dict,
                                             field: str) -> None:
    """Refused before any rank starts: no child process, no process group left behind."""
    with pytest.raises(ValueError, match=field):
        LLM(checkpoints["micro"], **{**KW, **kw})  # type: ignore[arg-type]
    assert not multiprocessing.active_children() and not dist.is_initialized()


def test_one_count_exchange_per_forward(checkpoints: dict[str, Path], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The counts are gathered once per forward (by the first MoE layer; a host sync each), not
    once per MoE layer, and the layers after it read them: on one gloo rank the DP model's
    logits equal the plain model's."""
    from dsv4.distributed import dp as dp_module
    from dsv4.distributed.dp import DPGroup, enable_dp_attention
    from dsv4.model.forward_mode import INFERENCE
    from dsv4.model.loader import load_model

    calls: list[int] = []
    gather = dp_module.gather_counts

    def counted(n: int, group: DPGroup, device: torch.device) -> list[int]:
        calls.append(n)
        return gather(n, group, device)

    monkeypatch.setattr(dp_module, "gather_counts", counted)
    ids = torch.randint(2, 512, (1, 23), generator=torch.Generator().manual_seed(0))
    plain = load_model(checkpoints["micro"], "float32", progress=False)
    join_default_group("gloo", f"file://{tmp_path / 'store'}", 0, 1)
    try:
        model = enable_dp_attention(load_model(checkpoints["micro"], "float32", progress=False),
                                    DPGroup(0, 1))
        with torch.no_grad():
            got, want = model(ids, INFERENCE), plain(ids, INFERENCE)
            model(ids[:, :7], INFERENCE)
    finally:
        dist.destroy_process_group()
    assert calls == [23, 7], calls
    assert torch.equal(got, want)
