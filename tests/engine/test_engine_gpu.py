"""The engine on a CUDA GPU: greedy tokens and logits equal the full-sequence model recomputed on
the GPU (fp32), with the prefix cache on, chunked prefill and two page sizes, and with FP8
indexer keys. Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_engine_equivalence import LogitRecorder, assert_pools_free, prompts_for, reference

from dsv4 import LLM, SamplingParams
from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import write_checkpoint

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("page_size", "chunk", "index_cache_dtype"),
                         [(16, 7, "model"), (32, 33, "model"), (16, 7, "fp8")])
def test_engine_on_gpu_equals_full_recompute(tmp_path: Path, page_size: int, chunk: int,
                                             index_cache_dtype: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    write_checkpoint(micro(), tmp_path, seed=2, tokenizer=False)
    rec = LogitRecorder(monkeypatch)
    llm = LLM(tmp_path, dtype="float32", device="cuda", page_size=page_size,
              chunked_prefill_size=chunk, max_total_tokens=4096,
              index_cache_dtype=index_cache_dtype)  # type: ignore[arg-type]
    prompts = prompts_for(llm.model.config, seed=1)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    # now cached
    outs += llm.generate(prompt_token_ids=prompts[-3:], sampling_params=params, use_tqdm=False)
    for out, prompt in zip(outs, prompts + prompts[-3:], strict=True):
        tokens, rows = reference(llm.model, prompt, len(out.token_ids))
        assert out.token_ids == tokens
        got = torch.stack(rec.rows[out.request_id])
        assert (got - torch.stack(rows)).abs().max().item() <= 1e-4
    assert sum(o.cached_tokens for o in outs[-3:]) > 0, "repeated prompts hit the prefix cache"
    assert_pools_free(llm.engine)


def test_cuda_defaults_are_triton_graphs_and_a_memory_fraction(tmp_path: Path) -> None:
    """`LLM(model)` on CUDA with no engine arguments: the triton backend, FP8 indexer keys, CUDA
    graphs, and a KV
    budget of mem_fraction_static of the GPU less the weights (capped by what the requests can
    use)."""
    write_checkpoint(micro(), tmp_path, seed=2, tokenizer=False)
    llm = LLM(tmp_path, device="cuda")
    runner = llm.engine.runner
    assert runner.config.kernel_backend == "triton" and runner.ops.name == "triton"
    assert runner.config.index_cache_dtype == "fp8"
    assert all(c.index_keys.dtype == torch.float8_e4m3fn for c in runner.pools.layers
               if c.index_keys is not None)
    assert runner.graphs is not None
    total = torch.cuda.get_device_properties(0).total_memory
    assert runner.config.kv_cache_memory_gb is not None
    assert 0 < runner.config.kv_cache_memory_gb * 2**30 <= 0.88 * total
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=params, use_tqdm=False)
    assert runner.graphs.replays > 0
