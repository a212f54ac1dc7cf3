"""The engine with kernel_backend='triton' (Flash Compressor + Lightning TopK + indexer-score kernels; under the
Triton interpreter on CPU) gives the same greedy tokens and logits as the reference backend."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import write_checkpoint


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs a CUDA GPU or the Triton interpreter")
def test_triton_backend_matches_ref(tmp_path: Path) -> None:
    write_checkpoint(micro(), tmp_path, seed=9, tokenizer=False)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (5, 23, 41)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5)
    outs = {}
    for backend in ("ref", "triton"):
        llm = LLM(tmp_path, dtype="float32", device=device, page_size=16, max_total_tokens=1024,
                  chunked_prefill_size=16, kernel_backend=backend)
        assert llm.engine.runner.ops.name == backend
        if backend == "triton":
            from dsv4.kernels.triton.compressor import triton_compress_cached
            assert llm.engine.runner.ops.compress is triton_compress_cached
        outs[backend] = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for a, b in zip(outs["ref"], outs["triton"], strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-4)
