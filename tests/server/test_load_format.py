"""`dsv4 serve --load-format dummy` (vLLM's and SGLang's name): a checkpoint directory with only
config.json and a tokenizer (`dsv4 init --no-weights`) served with random weights built in memory.
The server's greedy tokens equal `LLM` on `random_model` of the same config and seed; bad
combinations are refused at the edge."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from tokenizers import Tokenizer

from dsv4 import LLM, EngineConfig, SamplingParams
from dsv4.checkpoint.presets import get_preset
from dsv4.checkpoint.writer import random_model, write_checkpoint
from dsv4.config.model import ModelConfig
from dsv4.config.server import ServerConfig
from dsv4.engine.engine import LLMEngine
from dsv4.model.quant_experts import QuantExperts
from dsv4.model.quant_linear import QuantLinear

from .conftest import running_server

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


def test_dummy_weights_equal_random_model(tmp_path: Path) -> None:
    model_dir = tmp_path / "micro"
    write_checkpoint(get_preset("micro"), model_dir, weights=False)
    assert not list(model_dir.glob("*.safetensors"))
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}
    with running_server(tmp_path, "--model", str(model_dir), "--load-format", "dummy",
                        "--seed", "3", "--torch-threads", "1") as srv:
        got = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60.0).json()
        models = httpx.get(f"{srv.url}/v1/models").json()["data"][0]
    assert models["random_weights"] is True
    config = ModelConfig.from_hf(model_dir)
    model = random_model(config, torch.float32, torch.device("cpu"), seed=3)
    engine = LLMEngine(model, EngineConfig(page_size=16))
    req = engine.add_request(PROMPT, SamplingParams(max_tokens=8, temperature=0.0,
                                                    ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    want = Tokenizer.from_file(str(model_dir / "tokenizer.json")).decode(req.output_ids)
    assert got["usage"]["completion_tokens"] == 8
    assert got["choices"][0]["text"] == want, (got, req.output_ids)


def test_llm_dummy_equals_random_model(tmp_path: Path) -> None:
    """`LLM(path, load_format="dummy")` builds the same weights as `random_model` with its seed."""
    write_checkpoint(get_preset("micro"), tmp_path, weights=False)
    llm = LLM(tmp_path, load_format="dummy", seed=5, page_size=16)
    want = random_model(ModelConfig.from_hf(tmp_path), torch.float32, torch.device("cpu"), seed=5)
    for (name, p), q in zip(llm.model.named_parameters(), want.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_dummy_in_checkpoint_precision(tmp_path: Path) -> None:
    """`load_format="dummy"` with `weight_format="checkpoint"`: the routed experts are random FP4
    codes and UE8M0 scales (the FP8 linears random e4m3 codes and scales, the compressor
    projections bf16) built in place (seeded like `random_model`), decoding to weights of
    rms about 1 / sqrt(fan_in); the model serves them, and its logits equal those of the same
    model with the experts decoded to float (what the codes mean)."""
    write_checkpoint(get_preset("micro"), tmp_path, weights=False)
    llm = LLM(tmp_path, load_format="dummy", weight_format="checkpoint", seed=5, page_size=16)
    config = ModelConfig.from_hf(tmp_path)
    want = random_model(config, torch.float32, torch.device("cpu"), seed=5,
                        weight_format="checkpoint")
    coded = [m for m in llm.model.modules() if isinstance(m, QuantExperts)]
    assert len(coded) == config.num_layers + config.num_mtp_layers
    for (name, b), c in zip(llm.model.named_buffers(), want.buffers(), strict=True):
        assert torch.equal(b, c), name
    for experts in coded:
        w1, w2, _ = experts.dequantized(torch.float32)
        for w, fan_in in ((w1, experts.d), (w2, experts.inter)):
            rms = w.square().mean().sqrt().item()
            assert 0.5 < rms * fan_in ** 0.5 < 2.0, rms
    decoded = random_model(config, torch.float32, torch.device("cpu"), seed=5)
    for module, experts in zip((m for m in decoded.modules() if hasattr(m, "experts")),
                               coded, strict=True):
        w1, w2, w3 = experts.dequantized(torch.float32)
        module.experts.w1.data.copy_(w1)
        module.experts.w2.data.copy_(w2)
        module.experts.w3.data.copy_(w3)
    for name, m in llm.model.named_modules():     # the FP8 linears: random codes too
        if isinstance(m, QuantLinear):
            decoded.get_submodule(name).weight.data.copy_(m.dequantized(torch.float32))
    for name, p in llm.model.named_parameters():  # the compressor projections: bf16, as stored
        if name.endswith(("compressor.wkv.weight", "compressor.wgate.weight")):
            assert p.dtype == torch.bfloat16, name
            decoded.get_parameter(name).data.copy_(p)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        got, ref = llm.model(ids), decoded(ids)
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4), (got - ref).abs().max()
    out = llm.generate(sampling_params=SamplingParams(max_tokens=4, temperature=0.0,
                                                      ignore_eos=True),
                       prompt_token_ids=[PROMPT], use_tqdm=False)
    assert len(out[0].token_ids) == 4


def test_dummy_refuses_what_it_cannot_build() -> None:
    with pytest.raises(ValueError, match="load_format='lazy' is invalid"):
        ServerConfig(model="x", load_format="lazy")
    ServerConfig(model="x", load_format="dummy", weight_format="checkpoint", tp_size=2)


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "fmt"), [({"tensor_parallel_size": 2,
                                               "expert_parallel_size": 2}, "checkpoint"),
                                             ({"data_parallel_size": 2}, "bf16")],
                         ids=["tp2-ep2-checkpoint", "dp2"])
def test_dummy_across_ranks_equals_one_process(tmp_path: Path, layout: dict[str, int],
                                               fmt: str) -> None:
    """`load_format="dummy"` with several ranks (the in-memory source of real-scale geometries
    across GPUs): each rank draws only its shard (`distributed/dummy.py`), and the greedy tokens
    and log-probs equal one process's on the same seed."""
    write_checkpoint(get_preset("micro"), tmp_path, weights=False)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    prompts = [PROMPT, PROMPT[:3] + [40, 41]]
    kw = dict(load_format="dummy", weight_format=fmt, seed=5, page_size=16, device="cpu")
    want = LLM(tmp_path, **kw).generate(prompt_token_ids=prompts,  # type: ignore[arg-type]
                                        sampling_params=params, use_tqdm=False)
    with LLM(tmp_path, **layout, **kw) as llm:  # type: ignore[arg-type]
        got = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs, strict=True)) <= 1e-5
