"""`EngineConfig.decode_gemv` (`model/decode_gemv.py`): the decode path's 16-bit projections get
their own split-K counters and run through the triton backend's `linear` op, and the MoE gates
through its `moe_gate_logits` op; off, in the invariant modes and for float32 weights they run
F.linear (the gates: F.linear of fp32 casts) as before.

    TRITON_INTERPRET=1 PYTHONPATH=src python3 -m pytest -q tests/engine/test_decode_gemv.py
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import random_model
from dsv4.config.engine import EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.engine.sampling_params import SamplingParams
from dsv4.model.attention import Attention
from dsv4.model.decode_gemv import attach_decode_gemv
from dsv4.model.fused_projections import fuse_projections
from dsv4.model.moe import MLP, Gate
from dsv4.model.quant_linear import GEMV_COUNTERS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _sites(model: nn.Module) -> int:
    """Call sites `attach_decode_gemv` serves: 4 attention linears, 2 indexer ones, 3 per MLP
    (shared experts, MTP blocks' too), the MoE gates, and the 16-bit fused groups (x, q,
    w1 | w3)."""
    attn = [m for m in model.modules() if isinstance(m, Attention)]
    mlps = [m for m in model.modules() if isinstance(m, MLP)]
    gates = [m for m in model.modules() if isinstance(m, Gate)]
    groups = [g for a in attn for g in (a.fused_x, a.fused_q)] + [m.fused_w13 for m in mlps]
    return (4 * len(attn) + 2 * sum(a.indexer is not None for a in attn) + 3 * len(mlps)
            + len(gates) + sum(g is not None for g in groups))


def test_attach_and_detach() -> None:
    model = random_model(micro(), torch.bfloat16, torch.device("cpu"))
    assert attach_decode_gemv(model) == _sites(model)
    holders = [m for m in model.modules() if getattr(m, GEMV_COUNTERS, None) is not None]
    assert holders and all(not getattr(m, GEMV_COUNTERS).any() for m in holders)
    assert not any(GEMV_COUNTERS in k for k in model.state_dict()), "counters are not weights"
    assert fuse_projections(model) > 0
    assert attach_decode_gemv(model) == _sites(model)
    assert all(a.fused_x is None or a.fused_x.counters is not None
               for a in model.modules() if isinstance(a, Attention))
    assert attach_decode_gemv(model, on=False) == 0
    assert not any(getattr(m, GEMV_COUNTERS, None) is not None for m in model.modules())
    fp32 = random_model(micro(), torch.float32, torch.device("cpu"))
    assert attach_decode_gemv(fp32) == 0


@pytest.mark.slow  # two bf16 engines under the Triton interpreter
@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs a CUDA GPU or the Triton interpreter")
def test_engine_tokens_equal_with_decode_gemv_on_and_off() -> None:
    # micro cut to three layers, one per attention type (a hash MoE, then routed ones): every
    # kind of call site that its five layers have
    cfg = micro().replace(num_layers=3, attn_types=("swa", "csa", "hca"),
                          moe_types=("hash", "routed", "routed"))
    g = torch.Generator().manual_seed(0)
    # short prompts: the prefill's 5 rows run F.linear both ways (more rows than the decode GEMV
    # takes); each of the two decode steps runs every call site on two rows, and the second reads
    # the KV the first wrote through them
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (2, 3)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = {}
    for on in (True, False):
        model = random_model(cfg, torch.bfloat16, torch.device(DEVICE), seed=4)
        engine = LLMEngine(model, EngineConfig(page_size=16, max_total_tokens=1024,
                                               kernel_backend="triton", disable_cuda_graph=True,
                                               decode_gemv=on))
        sites = sum(getattr(m, GEMV_COUNTERS, None) is not None for m in model.modules())
        assert (sites > 0) == on
        reqs = [engine.add_request(p, params, rid=str(i)) for i, p in enumerate(prompts)]
        while engine.has_unfinished():
            engine.step()
        outs[on] = [(r.output_ids, list(r.logprobs)) for r in reqs]
    for (ids_on, lp_on), (ids_off, lp_off) in zip(outs[True], outs[False], strict=True):
        assert ids_on == ids_off
        torch.testing.assert_close(torch.tensor(lp_on), torch.tensor(lp_off), rtol=0,
                                   atol=0.05)
