"""The engine's fused projections (`model/fused_projections.py`) on the triton backend (the
interpreter on CPU), micro preset, fp32: greedy tokens and sampled logits equal the unfused
engine's through chunked prefill, requests joining mid-decode and decode batches (within 1e-5: a
GEMM of another width may sum in another order, cuBLAS on a GPU and, on some CPUs, the BLAS under
F.linear and the interpreter's tl.dot; bit-equal on others), and the kernels get the
fused GEMMs' column slices as they are (row-strided, no copy before the op): `q_norm_rope`,
`kv_norm_rope_store`, `rope`, `rms_norm`, `swiglu` and `compress_pair` / `compress`.

    PYTHONPATH=src python3 -m pytest -q tests/kernels/test_fused_projections_triton.py
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import random_model
from dsv4.config.engine import EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.engine.request import Request
from dsv4.engine.runner import ModelRunner
from dsv4.engine.sampler import SampleOutput
from dsv4.engine.sampling_params import SamplingParams
from dsv4.kernels.ref.compressor import CompressTarget

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
STRIDED_OPS = ("qkv_norm_rope", "rope", "rms_norm", "swiglu", "compress", "compress_pair")


def _spy(op: Callable[..., Any], name: str, seen: set[str]) -> Callable[..., Any]:
    """`op`, noting `name` in `seen` when a tensor argument (or a compress target's kv / score)
    arrives with rows that are not contiguous."""
    def call(*args: Any, **kwargs: Any) -> Any:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        tensors += [t for a in args if isinstance(a, CompressTarget) for t in (a.kv, a.score)]
        if any(t.dim() >= 2 and t.shape[-2] > 1 and not t.is_contiguous() for t in tensors):
            seen.add(name)
        return op(*args, **kwargs)
    return call


@pytest.mark.slow  # two engines under the Triton interpreter: ~60 s on a 2-core CPU
@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs a CUDA GPU or the Triton interpreter")
def test_triton_fused_equals_unfused(monkeypatch: pytest.MonkeyPatch) -> None:
    rows: dict[bool, dict[str, list[torch.Tensor]]] = {True: {}, False: {}}
    original = ModelRunner._sample

    def recorded(runner: ModelRunner, logits: torch.Tensor, reqs: list[Request],
                 steps: list[int], **kw: Any) -> SampleOutput:
        for req, row in zip(reqs, logits, strict=True):
            rows[runner.config.fuse_projections].setdefault(req.rid, []).append(row.clone())
        return original(runner, logits, reqs, steps, **kw)

    monkeypatch.setattr(ModelRunner, "_sample", recorded)
    # micro cut to three layers, one per attention type (a hash MoE, then routed ones): every
    # projection group that its five layers fuse
    cfg = micro().replace(num_layers=3, attn_types=("swa", "csa", "hca"),
                          moe_types=("hash", "routed", "routed"))
    g = torch.Generator().manual_seed(0)
    # steps of 9 tokens: 2 + 7, then a decode + 8 (the second request's 20 tokens are still in
    # chunked prefill when the third joins), then a decode + 5 + 1, then a decode batch (the first
    # request samples 3 tokens, the others 2); 20 tokens pass the window (8), complete an HCA window
    # (16) and give 5 CSA entries (more than index_topk = 4)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (2, 20, 1)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 2, 2)]
    outs, strided = {}, {}
    for fuse in (True, False):
        model = random_model(cfg, torch.float32, torch.device(DEVICE), seed=4)
        # multi-stream off: with it (CUDA's default) the q_lat group stays apart (its indexer
        # query runs on the side stream), so qkv_norm_rope and rope would see no strided rows
        engine = LLMEngine(model, EngineConfig(page_size=16, max_total_tokens=1024,
                                               chunked_prefill_size=9, kernel_backend="triton",
                                               disable_cuda_graph=True, fuse_projections=fuse,
                                               multi_stream=False))
        seen: set[str] = set()
        runner = engine.runner
        runner.ops = dataclasses.replace(runner.ops, **{
            name: _spy(getattr(runner.ops, name), name, seen) for name in STRIDED_OPS})
        reqs = [engine.add_request(p, params[i], rid=str(i)) for i, p in enumerate(prompts[:2])]
        engine.step()
        reqs.append(engine.add_request(prompts[2], params[2], rid="2"))   # joins mid-prefill
        while engine.has_unfinished():
            engine.step()
        outs[fuse], strided[fuse] = [r.output_ids for r in reqs], seen
    assert outs[True] == outs[False]
    assert strided[True] == set(STRIDED_OPS) and not strided[False]
    for rid, fused in rows[True].items():
        got, want = torch.stack(fused), torch.stack(rows[False][rid])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=f"request {rid}: logits")
