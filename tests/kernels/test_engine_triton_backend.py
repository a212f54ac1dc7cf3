"""The engine with kernel_backend='triton' — every op a Triton kernel (Flash Compressor, indexer
scores, Lightning TopK, hybrid sparse attention, grouped routed experts, fused mHC pre / post /
head; the interpreter on CPU) — gives the reference backend's greedy tokens and logprobs on the
micro preset (SWA, CSA and HCA layers, hash and routed MoE; chunked prefill, decode, a prefix-cache
hit), fp32. Both backends run model-dtype indexer keys (their defaults differ on CUDA), so only
the kernels differ; FP8 keys are tests/engine/test_index_cache_fp8.py's.

    PYTHONPATH=src python3 -m pytest -q tests/kernels/test_engine_triton_backend.py
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from dsv4 import LLM, EngineConfig, SamplingParams
from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import random_model, write_checkpoint
from dsv4.engine.engine import LLMEngine
from dsv4.model.moe import Experts
from dsv4.model.quant_experts import QuantExperts, quantize_experts_


@pytest.mark.slow  # every kernel of the engine under the Triton interpreter: ~35 s on a 2-core CPU
@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs a CUDA GPU or the Triton interpreter")
def test_triton_backend_matches_ref(tmp_path: Path) -> None:
    write_checkpoint(micro(), tmp_path, seed=9, tokenizer=False)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(2, 512, (29,), generator=g).tolist()
    # the longest prompt spans three 16-token chunks (chunked_prefill_size 16)
    prompts = [shared] + [torch.randint(2, 512, (n,), generator=g).tolist() for n in (5, 33)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=5)
    outs = {}
    for backend in ("ref", "triton"):
        llm = LLM(tmp_path, dtype="float32", device=device, page_size=16, max_total_tokens=1024,
                  chunked_prefill_size=16, kernel_backend=backend, index_cache_dtype="model")
        ops = llm.engine.runner.ops
        assert ops.name == backend
        if backend == "triton":
            ref_modules = [f.name for f in dataclasses.fields(ops) if f.name != "name" and not
                           getattr(ops, f.name).__module__.startswith("dsv4.kernels.triton")]
            assert not ref_modules, f"ops still on the reference: {ref_modules}"
        outs[backend] = llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                     use_tqdm=False)
        hit = llm.generate(prompt_token_ids=[shared + [5, 6, 7]], sampling_params=params,
                           use_tqdm=False)
        assert hit[0].cached_tokens >= 16, "the last request was meant to hit the prefix cache"
        outs[backend] += hit
    for a, b in zip(outs["ref"], outs["triton"], strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0,
                                   atol=1e-4)


@pytest.mark.slow  # the FP4 expert kernels under the Triton interpreter: ~15 s on a 2-core CPU
@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs a CUDA GPU or the Triton interpreter")
def test_triton_fp4_experts_match_dequantised_ref() -> None:
    """The triton backend's `routed_experts_quant` (FP4 dequantised in registers) vs the ref backend
    on the dequantised model, micro preset in fp32: greedy tokens equal, log-probs within 1e-4."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = random_model(micro(), torch.float32, torch.device(device), seed=5)
    quantize_experts_(model, "fp4")
    dense = random_model(micro(), torch.float32, torch.device(device), seed=5)
    pairs = zip([m for m in dense.modules() if isinstance(m, Experts)],
                [m for m in model.modules() if isinstance(m, QuantExperts)], strict=True)
    for d, q in pairs:
        d.w1.data, d.w2.data, d.w3.data = q.dequantized(torch.float32)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (9, 17)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = []
    for m, backend in ((dense, "ref"), (model, "triton")):
        engine = LLMEngine(m, EngineConfig(page_size=16, max_total_tokens=512,
                                           kernel_backend=backend, index_cache_dtype="model"))
        reqs = [engine.add_request(p, params) for p in prompts]
        while engine.has_unfinished():
            engine.step()
        outs.append(reqs)
    for a, b in zip(*outs, strict=True):
        assert a.output_ids == b.output_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= 1e-4
