"""Routed experts kept in checkpoint encoding (`weight_format="checkpoint"`,
`model/quant_experts.py`).

The shipped dsv4-tiny checkpoint stores its experts in FP4: loaded with
`weight_format="checkpoint"` the codes and scales sit in `QuantExperts` buffers exactly as in the
files, dequantise to the bf16-format model's expert weights bit for bit, and serving gives the same
greedy tokens and log-probs as the dequantised model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dsv4 import LLM, SamplingParams
from dsv4.assets import default_model_path
from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import write_checkpoint
from dsv4.model.loader import load_model
from dsv4.model.moe import Experts
from dsv4.model.quant_experts import QuantExperts, quantize_experts_
from dsv4.model.weights import CheckpointError, official_state_dict, shard_files

TINY = default_model_path()


def _experts(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, Experts | QuantExperts)]


def test_checkpoint_format_keeps_file_codes_and_dequantises_exactly() -> None:
    dense = load_model(TINY, dtype="float32", progress=False)
    packed = load_model(TINY, dtype="float32", progress=False, weight_format="checkpoint")
    pairs = list(zip(_experts(dense), _experts(packed), strict=True))
    assert pairs and all(isinstance(q, QuantExperts) and q.fmt == "fp4" for _, (_, q) in pairs)
    assert sum(p.numel() for p in packed.parameters()) < sum(p.numel() for p in dense.parameters())
    for (name, d), (_, q) in pairs:
        w1, w2, w3 = q.dequantized(torch.float32)
        assert torch.equal(w1, d.w1) and torch.equal(w2, d.w2) and torch.equal(w3, d.w3), name
    name, q = pairs[0][1]
    key = f"{name}.3.w3"
    with safe_open(str(next(f for f in shard_files(TINY)
                            if key + ".weight" in safe_open(str(f), "pt").keys())), "pt") as f:
        codes, scale = f.get_tensor(key + ".weight"), f.get_tensor(key + ".scale")
    inter = q.inter
    assert torch.equal(q.w13[3, inter:], codes.view(torch.uint8))
    assert torch.equal(q.w13_scale[3, inter:], scale.view(torch.uint8))


def test_checkpoint_format_serves_like_dequantised() -> None:
    prompts = ["def add(a, b):", "12+7="]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    outs = [LLM(TINY, dtype="float32", device="cpu", weight_format=fmt, page_size=128,
                kv_cache_memory_gb=0.25).generate(prompts, params, use_tqdm=False)
            for fmt in ("bf16", "checkpoint")]
    for a, b in zip(*outs, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_quantize_is_lossless_for_fp4_weights_and_export_refuses() -> None:
    model = load_model(TINY, dtype="float32", progress=False)
    before = [(m.w1.clone(), m.w2.clone(), m.w3.clone()) for _, m in _experts(model)]
    quantize_experts_(model, "fp4")
    for (w1, w2, w3), (_, q) in zip(before, _experts(model), strict=True):
        got = q.dequantized(torch.float32)
        assert torch.equal(got[0], w1) and torch.equal(got[1], w2) and torch.equal(got[2], w3)
    with pytest.raises(ValueError, match="weight_format='bf16'"):
        official_state_dict(model)  # type: ignore[arg-type]


def test_missing_expert_tensor_is_named(tmp_path: Path) -> None:
    write_checkpoint(micro(), tmp_path, seed=2, tokenizer=False, weight_quant="fp8+fp4")
    shard = shard_files(tmp_path)[0]
    with safe_open(str(shard), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    victim = next(k for k in tensors if k.endswith("ffn.experts.1.w2.scale"))
    del tensors[victim]
    from safetensors.torch import save_file
    save_file(tensors, str(shard))
    with pytest.raises(CheckpointError, match=victim.replace(".", r"\.")):
        load_model(tmp_path, dtype="float32", progress=False, weight_format="checkpoint")


def test_float_expert_weight_is_encoded_and_wide_scale_refused() -> None:
    """A dequantised (float) expert weight, as transformers-layout files hold, is encoded
    losslessly; a scale that is not one byte per element is refused with the tensor's name instead
    of being misread."""
    from dsv4.model.weights import WeightLoader

    dense = load_model(TINY, dtype="float32", progress=False)
    packed = load_model(TINY, dtype="float32", progress=False, weight_format="checkpoint")
    (name, d), (_, q) = _experts(dense)[0], _experts(packed)[0]
    loader = WeightLoader(packed)  # type: ignore[arg-type]
    q.w13[1].zero_()
    loader.add(f"{name}.1.w1.weight", d.w1[1].clone())
    assert torch.equal(q.dequantized(torch.float32)[0][1], d.w1[1])
    with pytest.raises(CheckpointError, match=rf"{name}\.2\.w3\.scale"):
        loader.add(f"{name}.2.w3.scale", torch.ones(q.inter, q.d // 32))
