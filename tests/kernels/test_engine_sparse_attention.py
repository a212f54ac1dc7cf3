"""The engine with `triton_sparse_attention` as its `KernelOps.sparse_attention` (a copy of the triton backend; the
registry itself is untouched) gives the reference backend's greedy tokens and logprobs on the micro preset
(SWA, CSA and HCA layers; chunked prefill, decode, a prefix-cache hit). Runs the Triton interpreter on CPU.

    PYTHONPATH=src python3 -m pytest -q tests/kernels/test_engine_sparse_attention.py
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import write_checkpoint
from dsv4.kernels.registry import create_kernels


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs a CUDA GPU or the Triton interpreter")
def test_sparse_attention_kernel_matches_ref_engine(tmp_path: Path) -> None:
    from dsv4.kernels.triton.sparse_attention import triton_sparse_attention

    write_checkpoint(micro(), tmp_path, seed=11, tokenizer=False)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(2, 512, (29,), generator=g).tolist()
    prompts = [shared, torch.randint(2, 512, (7,), generator=g).tolist()]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
    calls = {"n": 0}

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls["n"] += 1
        return triton_sparse_attention(*args, **kwargs)  # type: ignore[arg-type]

    outs = {}
    for backend in ("ref", "kernel"):
        llm = LLM(tmp_path, dtype="float32", device=device, page_size=16, max_total_tokens=1024,
                  chunked_prefill_size=16, kernel_backend="ref" if backend == "ref" else "triton")
        if backend == "kernel":
            llm.engine.runner.ops = replace(create_kernels("triton"), sparse_attention=counted)
        outs[backend] = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        hit = llm.generate(prompt_token_ids=[shared + [5, 6, 7]], sampling_params=params, use_tqdm=False)
        assert hit[0].cached_tokens >= 16, "the third request was meant to hit the prefix cache"
        outs[backend] += hit
    assert calls["n"] > 0, "the kernel was never called"
    for a, b in zip(outs["ref"], outs["kernel"], strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-4)
