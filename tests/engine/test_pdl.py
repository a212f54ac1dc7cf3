"""Programmatic dependent launch (`kernels/triton/pdl.py`): off the GPU it is off; on an H200 the
same tokens and log-probs with PDL off, in WAIT and in EARLY mode, eagerly and through the decode
graphs (the same kernels on the same inputs: PDL changes when a kernel starts, never what it
reads), and a chain of PDL GEMVs and FP8 linears in a CUDA graph gives the bits of the plain
launches in every mode."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import write_checkpoint
from dsv4.kernels.triton import pdl
from dsv4.kernels.triton.pdl import (
    EARLY,
    ENV,
    OFF,
    WAIT,
    pdl_args,
    pdl_enabled,
    pdl_mode,
    pdl_scope,
)

_GPU = pytest.mark.skipif(not torch.cuda.is_available()
                          or torch.cuda.get_device_capability() < (9, 0),
                          reason="needs a CUDA GPU of compute capability >= 9.0")


def test_off_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off the GPU every mode is OFF."""
    for value in ("0", "1", "2"):
        monkeypatch.setenv(ENV, value)
        assert pdl_args(torch.device("cpu")) == {"PDL": OFF, "launch_pdl": False}
        assert not pdl_enabled(torch.device("cpu"))


def test_host_side_defines_no_kernel() -> None:
    """Importing `pdl.py` (the engine's tests do, before the kernel tests' conftest sets
    TRITON_INTERPRET) imports no Triton: a Triton function defined then would be compiled, not
    interpreted, and every interpreted kernel calling it would fail."""
    code = "import sys, dsv4.kernels.triton.pdl; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True,
                   env={**os.environ, "PYTHONPATH": str(Path(pdl.__file__).parents[3])})


def test_bad_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """A DSV4_PDL other than 0 / 1 / 2 is refused with the variable and the allowed values."""
    monkeypatch.setenv(ENV, "early")
    with pytest.raises(ValueError, match=r"DSV4_PDL must be one of \['0', '1', '2'\]"):
        pdl_mode(torch.device("cpu"))


def _fake_hopper(value: str | None, monkeypatch: pytest.MonkeyPatch) -> torch.device:
    """A Hopper GPU (faked: `_hopper` says yes) with DSV4_PDL = value (None: unset)."""
    monkeypatch.setattr(pdl, "_hopper", lambda index: True)
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    return torch.device("cuda", 0)


@pytest.mark.parametrize("value,mode", [("0", OFF), ("1", WAIT), ("2", EARLY), (None, WAIT)])
def test_modes(value: str | None, mode: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """DSV4_PDL picks the mode on a Hopper GPU (faked), WAIT by default."""
    dev = _fake_hopper(value, monkeypatch)
    assert pdl_args(dev) == {"PDL": mode, "launch_pdl": mode != OFF}
    assert pdl_enabled(dev) is (mode != OFF)


@pytest.mark.parametrize("value", ["1", "2", None])
def test_scope(value: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """`pdl_scope` sets the mode of the launches inside it (nested: the innermost), None keeps
    DSV4_PDL's, and it is restored on exit, also after an error; DSV4_PDL=0 and devices
    without PDL stay off inside."""
    dev = _fake_hopper(value, monkeypatch)
    outside = pdl_mode(dev)
    with pdl_scope(EARLY):
        assert pdl_mode(dev) == EARLY and pdl_args(dev) == {"PDL": EARLY, "launch_pdl": True}
        with pdl_scope(WAIT):
            assert pdl_mode(dev) == WAIT
        with pdl_scope(None):
            assert pdl_mode(dev) == EARLY
        assert pdl_mode(torch.device("cpu")) == OFF
        monkeypatch.setenv(ENV, "0")
        assert pdl_mode(dev) == OFF
        monkeypatch.setenv(ENV, value or "1")
    assert pdl_mode(dev) == outside
    with pytest.raises(RuntimeError), pdl_scope(EARLY):
        raise RuntimeError("restored after an error")
    assert pdl_mode(dev) == outside
    with pytest.raises(ValueError, match="pdl_scope mode must be"), pdl_scope(OFF):
        pass


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
    assert pdl_args(dev) == {"PDL": WAIT, "launch_pdl": True}
    monkeypatch.setenv(ENV, "2")
    assert pdl_args(dev) == {"PDL": EARLY, "launch_pdl": True}
    monkeypatch.setenv(ENV, "0")
    assert pdl_args(dev) == {"PDL": OFF, "launch_pdl": False}


def _chain(ws: list[torch.Tensor], codes: list[tuple[torch.Tensor, torch.Tensor]],
           x: torch.Tensor) -> torch.Tensor:
    """GEMVs and FP8 linears in turn, each reading the one before's output."""
    from dsv4.kernels.triton.fp8_linear import triton_fp8_linear
    from dsv4.kernels.triton.gemv import triton_linear

    for w, (c, s) in zip(ws, codes, strict=True):
        x = triton_fp8_linear(triton_linear(x, w), c, s)
    return x


@pytest.mark.gpu
@_GPU
def test_chain_in_a_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """16 GEMVs and 16 FP8 linears (both split-K at M = 1), each reading the one before's output,
    captured with PDL off, in WAIT and in EARLY mode: the same bits, replay after replay."""
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [torch.randn(4096, 1024, device="cuda", generator=g).bfloat16() / 32 for _ in range(16)]
    # [1024, 4096] codes (K 4096: split-K at M = 1), every block scaled by 2^-9: outputs ~ 1
    codes = [((torch.randn(1024, 4096, device="cuda", generator=g) * 8).to(torch.float8_e4m3fn),
              torch.full((8, 32), 118, dtype=torch.uint8, device="cuda")) for _ in range(16)]
    x = torch.randn(1, 1024, device="cuda", generator=g).bfloat16()
    outs = {}
    for flag in ("0", "1", "2"):
        monkeypatch.setenv(ENV, flag)
        _chain(ws, codes, x)                    # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = _chain(ws, codes, x)
        replays = []
        for _ in range(5):
            graph.replay()
            replays.append(y.clone())
        torch.cuda.synchronize()
        assert all(torch.equal(r, replays[0]) for r in replays)
        outs[flag] = replays[0]
    assert torch.equal(outs["0"], outs["1"]) and torch.equal(outs["0"], outs["2"])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pdl") / "micro"
    write_checkpoint(micro(), path, seed=4, tokenizer=True)
    return path


def _generate(ckpt: Path, dtype: str, graphs: bool,
              early_max_batch: int = 0) -> list[tuple[list[int], list[float]]]:
    llm = LLM(ckpt, dtype=dtype, device="cuda", kernel_backend="triton", page_size=16,
              max_total_tokens=8192, max_running_requests=8, chunked_prefill_size=64,
              disable_cuda_graph=not graphs, warmup="none", pdl_early_max_batch=early_max_batch)
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
@pytest.mark.parametrize("mode", ["1", "2"])
def test_same_outputs_on_and_off(ckpt: Path, dtype: str, graphs: bool, mode: str,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """micro's greedy tokens and log-probs with PDL off and in WAIT / EARLY mode: equal."""
    monkeypatch.setenv(ENV, "0")
    off = _generate(ckpt, dtype, graphs)
    monkeypatch.setenv(ENV, mode)
    on = _generate(ckpt, dtype, graphs)
    assert on == off


@pytest.mark.gpu
@_GPU
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_early_graph_buckets_same_outputs(ckpt: Path, dtype: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Graphs of buckets up to 2 in EARLY mode (`pdl_early_max_batch`), the rest in WAIT: the
    outputs of every graph in WAIT. The 4 requests finish one by one, so buckets 4, 2 and 1 run."""
    monkeypatch.setenv(ENV, "1")
    assert _generate(ckpt, dtype, True, early_max_batch=2) == _generate(ckpt, dtype, True)
