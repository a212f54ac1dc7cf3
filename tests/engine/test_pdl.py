"""Programmatic dependent launch (`kernels/triton/pdl.py`): off the GPU it is off; on an H200 the
same tokens and log-probs with PDL on and off, eagerly and through the decode graphs (the same
kernels on the same inputs: PDL changes when a kernel starts, never what it reads), and a chain of
PDL GEMVs in a CUDA graph gives the bits of the plain launches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import write_checkpoint
from dsv4.kernels.triton import pdl
from dsv4.kernels.triton.pdl import ENV, pdl_args, pdl_enabled

_GPU = pytest.mark.skipif(not torch.cuda.is_available()
                          or torch.cuda.get_device_capability() < (9, 0),
                          reason="needs a CUDA GPU of compute capability >= 9.0")


def test_off_the_gpu() -> None:
    assert pdl_args(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}
    assert not pdl_enabled(torch.device("cpu"))


@pytest.mark.parametrize("capability,hip,on", [((9, 0), None, True), ((10, 0), None, True),
                                               ((8, 0), None, False), ((9, 4), "6.2", False)])
def test_device_rule(capability: tuple[int, int], hip: str | None, on: bool,
                     monkeypatch: pytest.MonkeyPatch) -> None:
    """On for NVIDIA GPUs of capability >= 9.0 (whatever this machine has: the query is faked),
    off for older ones and for ROCm devices, and off with DSV4_PDL=0."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.delenv(ENV, raising=False)
    pdl._hopper.cache_clear()
    try:
        assert pdl_enabled(torch.device("cuda", 0)) is on
        monkeypatch.setenv(ENV, "0")
        assert not pdl_enabled(torch.device("cuda", 0))
    finally:
        pdl._hopper.cache_clear()


@pytest.mark.gpu
@_GPU
def test_env_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = torch.device("cuda")
    monkeypatch.delenv(ENV, raising=False)
    assert pdl_args(dev) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv(ENV, "0")
    assert pdl_args(dev) == {"PDL": False, "launch_pdl": False}


def _gemv_chain(ws: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    from dsv4.kernels.triton.gemv import triton_linear

    for w in ws:
        x = triton_linear(x, w)
    return x


@pytest.mark.gpu
@_GPU
def test_gemv_chain_in_a_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """32 dependent GEMVs captured with and without PDL: the same bits, replay after replay."""
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [torch.randn(1024, 1024, device="cuda", generator=g).bfloat16() / 32 for _ in range(32)]
    x = torch.randn(1, 1024, device="cuda", generator=g).bfloat16()
    outs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv(ENV, flag)
        _gemv_chain(ws, x)                      # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = _gemv_chain(ws, x)
        replays = []
        for _ in range(5):
            graph.replay()
            replays.append(y.clone())
        torch.cuda.synchronize()
        assert all(torch.equal(r, replays[0]) for r in replays)
        outs[flag] = replays[0]
    assert torch.equal(outs["0"], outs["1"])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pdl") / "micro"
    write_checkpoint(micro(), path, seed=4, tokenizer=True)
    return path


def _generate(ckpt: Path, dtype: str, graphs: bool) -> list[tuple[list[int], list[float]]]:
    llm = LLM(ckpt, dtype=dtype, device="cuda", kernel_backend="triton", page_size=16,
              max_total_tokens=8192, max_running_requests=8, chunked_prefill_size=64,
              disable_cuda_graph=not graphs, warmup="none")
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, micro().vocab_size, (n,), generator=g).tolist()
               for n in (9, 150, 333, 41)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [(o.token_ids, o.logprobs) for o in outs]


@pytest.mark.gpu
@_GPU
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("graphs", [False, True])
def test_same_outputs_on_and_off(ckpt: Path, dtype: str, graphs: bool,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "0")
    off = _generate(ckpt, dtype, graphs)
    monkeypatch.setenv(ENV, "1")
    on = _generate(ckpt, dtype, graphs)
    assert on == off
