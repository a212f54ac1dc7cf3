"""The engine with kernel_backend='triton' — every op a Triton kernel (Flash Compressor, indexer
scores, Lightning TopK, hybrid sparse attention, grouped routed experts, FP4 routed experts
dequantised in registers, fused mHC pre / post / head; the interpreter on CPU) — gives the
reference backend's greedy tokens and logprobs on the micro preset (SWA, CSA and HCA layers, hash
and routed MoE; chunked prefill, decode, a prefix-cache hit), fp32. One routed layer keeps its
experts as FP4 codes (`routed_experts_quant`), the others as floats (`routed_experts`); the
reference runs the model with those codes dequantised. Both backends run model-dtype indexer keys
(their defaults differ on CUDA), so only the kernels differ; FP8 keys are
tests/engine/test_index_cache_fp8.py's.

    PYTHONPATH=src python3 -m pytest -q tests/kernels/test_engine_triton_backend.py
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from dsv4 import EngineConfig, SamplingParams
from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import random_model
from dsv4.config.engine import KernelBackend
from dsv4.engine.engine import LLMEngine
from dsv4.engine.request import Request
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.model.moe import Experts
from dsv4.model.quant_experts import QuantExperts, quantize_experts_

FP4_LAYER = 3      # micro: a CSA layer with routed MoE


def serve(model: DeepSeekV4ForCausalLM, backend: KernelBackend,
          prompts: list[tuple[list[int], int]]) -> tuple[LLMEngine, list[Request]]:
    """All `prompts` (token ids, max_tokens) queued at once and stepped to the end: 16-token
    chunks of prefill, decode and prefill chunks sharing steps."""
    engine = LLMEngine(model, EngineConfig(page_size=16, max_total_tokens=1024,
                                           chunked_prefill_size=16, kernel_backend=backend,
                                           index_cache_dtype="model"))
    reqs = [engine.add_request(ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                                   logprobs=5))
            for ids, n in prompts]
    while engine.has_unfinished():
        engine.step()
    return engine, reqs


@pytest.mark.slow  # every kernel of the engine under the Triton interpreter: ~40 s on a 2-core CPU
@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs a CUDA GPU or the Triton interpreter")
def test_triton_backend_matches_ref() -> None:
    """Four steps: a 21-token prompt's first chunk; its last chunk beside a 5-token prompt and
    the first 6 new tokens of a request that extends it by 3 (its first page a prefix-cache hit;
    5 CSA entries: top-k selects); both first requests decoding beside that request's last
    chunk; two requests decoding. Greedy tokens equal, log-probs within 1e-4."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = random_model(micro(), torch.float32, device, seed=5)
    quantize_experts_(model.layers[FP4_LAYER], "fp4")
    dense = random_model(micro(), torch.float32, device, seed=5)
    q = model.get_submodule(f"layers.{FP4_LAYER}.ffn.experts")
    d = dense.get_submodule(f"layers.{FP4_LAYER}.ffn.experts")
    assert isinstance(q, QuantExperts) and isinstance(d, Experts)
    d.w1.data, d.w2.data, d.w3.data = q.dequantized(torch.float32)
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(2, 512, (21,), generator=g).tolist()
    prompts = [(shared, 2), (torch.randint(2, 512, (5,), generator=g).tolist(), 3),
               (shared + [5, 6, 7], 2)]
    _, ref = serve(dense, "ref", prompts)
    engine, out = serve(model, "triton", prompts)
    ops = engine.runner.ops
    assert ops.name == "triton"
    ref_modules = [f.name for f in dataclasses.fields(ops) if f.name != "name" and not
                   getattr(ops, f.name).__module__.startswith("dsv4.kernels.triton")]
    assert not ref_modules, f"ops still on the reference: {ref_modules}"
    for reqs in (ref, out):
        assert [r.cached_tokens for r in reqs] == [0, 0, 16], "meant: the last one hits the cache"
    for a, b in zip(ref, out, strict=True):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0,
                                   atol=1e-4)
