"""Engine vs the full-sequence model recomputed from scratch at every step (greedy, fp32, CPU).

For mixed-length prompts (1, W-1, W, W+1, multiples of the compress ratios +- 1), at awkward
chunked-prefill budgets (1, 3, P-1, P+1) and two page sizes, with requests joining and leaving
mid-batch: the engine's greedy tokens equal full recomputation and its logits match to 1e-4.
Also: preemption under a too-small cache gives the same outputs, and every pool is back to its
initial free count with check_integrity() passing after the workload.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import write_checkpoint
from dsv4.config.model import ModelConfig
from dsv4.engine.engine import LLMEngine
from dsv4.engine.request import Request
from dsv4.engine.runner import ModelRunner
from dsv4.engine.sampler import SampleOutput
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM

TOL = 1e-4


def wide() -> ModelConfig:
    """The real window and C128 ratio (W = 128, m' = 128) on a tiny body."""
    return micro().replace(window=128, hca_ratio=128, max_position_embeddings=1024,
                           num_mtp_layers=0)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine")
    out = {}
    for name, cfg in (("tiny", micro()), ("wide", wide())):
        out[name] = root / name
        write_checkpoint(cfg, out[name], seed=2, tokenizer=False)
    return out


class LogitRecorder:
    """Wraps ModelRunner._sample to keep every sampled row's logits per request id."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rows: dict[str, list[torch.Tensor]] = {}
        original = ModelRunner._sample

        def wrapped(runner: ModelRunner, logits: torch.Tensor, reqs: list[Request],
                    steps: list[int], **kw: Any) -> SampleOutput:
            for req, row in zip(reqs, logits, strict=True):
                self.rows.setdefault(req.rid, []).append(row.clone())
            return original(runner, logits, reqs, steps, **kw)

        monkeypatch.setattr(ModelRunner, "_sample", wrapped)


def reference(model: DeepSeekV4ForCausalLM, prompt: list[int],
              n: int) -> tuple[list[int], list[torch.Tensor]]:
    ids, rows = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            row = model(torch.tensor([ids], device=model.embed.weight.device))[0, -1]
            rows.append(row)
            ids.append(int(row.argmax()))
    return ids[len(prompt):], rows


def prompts_for(cfg: ModelConfig, seed: int) -> list[list[int]]:
    W, m, M = cfg.window, cfg.csa_ratio, cfg.hca_ratio
    lengths = sorted({1, W - 1, W, W + 1, 2 * m - 1, 3 * m + 1, M - 1, M + 1, 2 * M + 3})
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lengths]


def run_staggered(engine: LLMEngine, prompts: list[list[int]],
                  max_tokens: list[int]) -> dict[str, Request]:
    """Requests join two at a time while others run; they leave when their own max_tokens is
    reached."""
    reqs: dict[str, Request] = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        for _ in range(2):
            if pending:
                i, p = pending.pop(0)
                params = SamplingParams(max_tokens=max_tokens[i], temperature=0.0, ignore_eos=True)
                reqs[str(i)] = engine.add_request(p, params, rid=str(i))
        engine.step()
    return reqs


def assert_matches(model: DeepSeekV4ForCausalLM, prompts: list[list[int]], reqs: dict[str, Request],
                   rec: LogitRecorder) -> None:
    for rid, req in reqs.items():
        prompt = prompts[int(rid)]
        tokens, rows = reference(model, prompt, len(req.output_ids))
        assert req.output_ids == tokens, f"request {rid} (prompt {len(prompt)} tokens) diverged"
        got = torch.stack(rec.rows[rid])
        assert got.shape == (len(tokens), model.config.vocab_size)
        assert (got - torch.stack(rows)).abs().max().item() <= TOL, f"request {rid}: logits differ"


def assert_pools_free(engine: LLMEngine) -> None:
    """No leak: once the prefix cache lets go of what it keeps, every page is free again."""
    table = engine.runner.table
    engine.check_integrity()
    engine.flush_cache()
    engine.check_integrity()
    assert table.full.num_free == table.full.num_usable
    assert table.swa.num_free == table.swa.num_usable
    assert table.num_free_slots == engine.config.max_running_requests


@pytest.mark.parametrize(("name", "page_size", "chunk"), [
    ("tiny", 16, 1), ("tiny", 16, 3), ("tiny", 32, 31), ("tiny", 32, 33),
    ("wide", 128, 127), ("wide", 256, 129),
])
def test_engine_equals_full_recompute(ckpts: dict[str, Path], name: str, page_size: int, chunk: int,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    rec = LogitRecorder(monkeypatch)
    llm = LLM(ckpts[name], dtype="float32", device="cpu", page_size=page_size,
              chunked_prefill_size=chunk, max_running_requests=6, max_total_tokens=4096)
    prompts = prompts_for(llm.model.config, seed=page_size + chunk)
    max_tokens = [3 + (7 * i) % 11 for i in range(len(prompts))]
    reqs = run_staggered(llm.engine, prompts, max_tokens)
    assert_matches(llm.model, prompts, reqs, rec)
    assert all(r.finish_reason == "length" for r in reqs.values())
    assert_pools_free(llm.engine)


def test_preemption_gives_identical_outputs(ckpts: dict[str, Path]) -> None:
    prompts = prompts_for(micro(), seed=5)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    big = LLM(ckpts["tiny"], dtype="float32", device="cpu", page_size=16, max_total_tokens=4096)
    expected = [o.token_ids for o in big.generate(prompt_token_ids=prompts, sampling_params=params,
                                                  use_tqdm=False)]
    small = LLM(ckpts["tiny"], dtype="float32", device="cpu", page_size=16, max_total_tokens=96,
                max_running_requests=8, chunked_prefill_size=64)
    got = small.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0, \
        "the pool was meant to be too small for the batch"
    assert [o.token_ids for o in got] == expected
    assert_pools_free(small.engine)


def test_abort_frees_everything(ckpts: dict[str, Path]) -> None:
    llm = LLM(ckpts["tiny"], dtype="float32", device="cpu", page_size=16, max_total_tokens=1024,
              chunked_prefill_size=8)
    engine = llm.engine
    prompts = prompts_for(micro(), seed=9)
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    for k in range(6):
        engine.step()
        engine.abort(reqs[k].rid)        # one waiting, prefilling or decoding request at a time
    for r in reqs:
        engine.abort(r.rid)
    assert not engine.has_unfinished()
    assert all(r.finish_reason == "abort" for r in reqs)
    assert_pools_free(engine)


def test_doubled_rings_and_backend_choice(ckpts: dict[str, Path],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """ring_multiplier=2 (the speculative-decoding ring size) changes nothing; unknown backends
    raise."""
    rec = LogitRecorder(monkeypatch)
    llm = LLM(ckpts["tiny"], dtype="float32", device="cpu", page_size=16, chunked_prefill_size=5,
              max_total_tokens=2048, ring_multiplier=2)
    assert llm.engine.runner.layout.ring_c4 == 16 and llm.engine.runner.layout.ring_c128 == 32
    prompts = prompts_for(llm.model.config, seed=3)
    reqs = run_staggered(llm.engine, prompts, [6] * len(prompts))
    assert_matches(llm.model, prompts, reqs, rec)
    with pytest.raises(ValueError,
                       match="kernel_backend='cutlass'.*allowed: \\['ref', 'triton'\\]"):
        LLM(ckpts["tiny"], dtype="float32", device="cpu", kernel_backend="cutlass")
