"""`SamplingParams.prompt_logprobs`: every prompt token's log-prob (and top-k) equals the
full-sequence model's log_softmax at that position (fp32, <= 1e-5), across chunked prefill, a
prompt whose prefix is cached (it is computed again), a batch mixing requests with and without
them, and preemption mid-prefill; the generated tokens do not change."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import write_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plp") / "micro"
    write_checkpoint(micro(), path, seed=4, tokenizer=False)
    return path


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    base = torch.randint(2, 512, (70,), generator=g).tolist()
    return [base, base[:50] + [7, 8, 9], torch.randint(2, 512, (23,), generator=g).tolist()]


def _reference(llm: LLM, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = llm.model(torch.tensor([prompt]))[0]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize(("chunk", "max_total"), [(2048, 4096), (16, 4096), (24, 96)])
def test_prompt_logprobs_equal_the_full_sequence_model(ckpt: Path, chunk: int,
                                                       max_total: int) -> None:
    llm = LLM(ckpt, dtype="float32", device="cpu", page_size=16, chunked_prefill_size=chunk,
              max_total_tokens=max_total, max_running_requests=4)
    prompts = _prompts()
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=greedy,
                                              use_tqdm=False)]
    params = [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, prompt_logprobs=3),
              SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, prompt_logprobs=0),
              greedy]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    assert outs[2].prompt_logprobs is None
    for out, prompt, k in zip(outs[:2], prompts[:2], (3, 0), strict=True):
        ref = _reference(llm, prompt)
        lps = out.prompt_logprobs
        assert lps is not None and len(lps) == len(prompt) and lps[0] is None
        want_lp = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        assert (torch.tensor(lps[1:]) - want_lp).abs().max().item() <= 1e-5
        tops = out.prompt_top_logprobs
        assert tops is not None and all(len(t) == k for t in tops[1:])
        if k:
            pos = len(prompt) // 2
            best = ref[pos - 1].topk(k)
            assert list(tops[pos]) == best.indices.tolist()
    assert outs[1].cached_tokens == 0, "a request owing prompt log-probs computes its prompt"
    if max_total < 1000:
        assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to preempt"


def test_prompt_logprobs_are_validated_and_refused_under_speculation(ckpt: Path) -> None:
    with pytest.raises(ValueError, match="^prompt_logprobs=21 is invalid"):
        SamplingParams(prompt_logprobs=21)
    spec = LLM(ckpt, dtype="float32", device="cpu", page_size=16, max_total_tokens=1024,
               speculative_num_steps=2)
    with pytest.raises(ValueError, match="prompt_logprobs is not supported with speculative"):
        spec.generate(prompt_token_ids=[[1, 2, 3]],
                      sampling_params=SamplingParams(prompt_logprobs=1), use_tqdm=False)


def test_only_requests_that_ask_owe_prompt_logprobs() -> None:
    from dsv4.engine.request import Request

    plain = Request("a", [1, 2, 3], SamplingParams(), seed=0)
    asks = Request("b", [1, 2, 3], SamplingParams(prompt_logprobs=0), seed=0)
    assert not plain.wants_prompt_logprobs and asks.wants_prompt_logprobs
    assert asks.prompt_logprobs == [None] and plain.prompt_logprobs == []
