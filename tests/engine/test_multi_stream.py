"""Multi-stream branches (`EngineConfig.multi_stream`, `model/streams.py`): the config, its
resolution, and on a GPU the same tokens and log-probs with the side stream on and off (the same
kernels on the same inputs), eagerly and through the decode graphs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import random_model, write_checkpoint
from dsv4.config.engine import EngineConfig
from dsv4.config.engine_defaults import (
    resolve_multi_stream,
    resolve_shared_expert_beside_max_tokens,
)
from dsv4.engine.engine import LLMEngine
from dsv4.model.streams import join, side


def test_config_validation() -> None:
    with pytest.raises(ValueError, match=r"multi_stream='on' is invalid; allowed: None, True or "
                                         r"False"):
        EngineConfig(multi_stream="on")  # type: ignore[arg-type]
    assert EngineConfig().multi_stream is None
    EngineConfig(multi_stream=True, enable_hisparse=True)   # the HotSet's work is a side branch
    EngineConfig(multi_stream=False, enable_hisparse=True)


def test_resolution() -> None:
    """Unset: on with CUDA; an explicit choice wins; True needs CUDA."""
    assert resolve_multi_stream(None, "cuda")
    assert not resolve_multi_stream(None, "cpu")
    assert not resolve_multi_stream(False, "cuda")
    with pytest.raises(ValueError, match=r"multi_stream=True needs a CUDA device; this engine "
                                         r"runs on 'cpu' \(allowed: multi_stream=False or None\)"):
        resolve_multi_stream(True, "cpu")
    model = random_model(micro(), torch.float32, torch.device("cpu"))
    engine = LLMEngine(model, EngineConfig(page_size=16, max_total_tokens=512))
    assert engine.runner.config.multi_stream is False and engine.runner.side_stream is None


def test_shared_expert_beside_resolution() -> None:
    """Unset: forwards of up to 8 tokens run the shared expert beside the routed experts with
    checkpoint-format experts, none with float ones (the engine reads the model's modules); an
    explicit bound wins; bad values name the field."""
    assert resolve_shared_expert_beside_max_tokens(None, quant_experts=True) == 8
    assert resolve_shared_expert_beside_max_tokens(None, quant_experts=False) == 0
    assert resolve_shared_expert_beside_max_tokens(0, quant_experts=True) == 0
    assert resolve_shared_expert_beside_max_tokens(32, quant_experts=False) == 32
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match=r"shared_expert_beside_max_tokens=.* is invalid; "
                                             r"allowed: None \(by the weights' format\) or an "
                                             r"integer >= 0"):
            EngineConfig(shared_expert_beside_max_tokens=bad)  # type: ignore[arg-type]
    for fmt, want in (("bf16", 0), ("checkpoint", 8)):
        model = random_model(micro(), torch.float32, torch.device("cpu"), weight_format=fmt)
        runner = LLMEngine(model, EngineConfig(page_size=16, max_total_tokens=512)).runner
        assert runner.config.shared_expert_beside_max_tokens == want
        assert runner.shared_beside_max_tokens == want


def test_no_stream_is_program_order() -> None:
    """Without a stream the fork and join do nothing: the block runs where it is written."""
    out = []
    with side(None):
        out.append(1)
    join(None)
    out.append(2)
    assert out == [1, 2]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("multi_stream") / "micro"
    write_checkpoint(micro(), path, seed=3, tokenizer=True)
    return path


def _generate(ckpt: Path, dtype: str, multi: bool, graphs: bool, beside: int | None = None,
              weight_format: str = "bf16") -> list[tuple[list[int], list[float]]]:
    llm = LLM(ckpt, dtype=dtype, device="cuda", kernel_backend="triton", page_size=16,
              max_total_tokens=8192, max_running_requests=8, chunked_prefill_size=64,
              multi_stream=multi, disable_cuda_graph=not graphs, warmup="none",
              fuse_projections=False, shared_expert_beside_max_tokens=beside,
              weight_format=weight_format)
    assert llm.engine.runner.config.multi_stream is multi
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, micro().vocab_size, (n,), generator=g).tolist()
               for n in (7, 150, 333, 40)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [(o.token_ids, o.logprobs) for o in outs]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("graphs", [False, True])
def test_gpu_same_outputs_on_and_off(ckpt: Path, dtype: str, graphs: bool) -> None:
    """micro (SWA, CSA and HCA layers) on CUDA: greedy tokens and their log-probs are the same
    bits with the side stream on and off, prefill chunks and decode steps (graphs or eager).
    Projections unfused in both (multi-stream changes which groups fuse, and a fused GEMM may
    round differently)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    off = _generate(ckpt, dtype, False, graphs)
    on = _generate(ckpt, dtype, True, graphs)
    assert on == off


@pytest.mark.gpu
@pytest.mark.parametrize("weight_format", ["bf16", "checkpoint"])
@pytest.mark.parametrize("graphs", [False, True])
def test_gpu_shared_expert_beside_same_outputs(ckpt: Path, weight_format: str,
                                               graphs: bool) -> None:
    """The shared expert beside the gate (bound 0) or beside the routed experts (every forward,
    and decode steps only): the same kernels on the same inputs, so the same tokens and log-probs
    (bf16, prefill chunks and decode steps)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gate = _generate(ckpt, "bfloat16", True, graphs, 0, weight_format)
    for bound in (8, 1 << 20):
        assert _generate(ckpt, "bfloat16", True, graphs, bound, weight_format) == gate
