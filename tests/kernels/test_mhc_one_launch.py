"""The one-launch split-K form of mHC pre / head (`kernels/triton/mhc_split.py`): the token tile's
last partial program finishes the tile, so there is no finish launch.

CPU (interpreter): one launch vs two launches bit-identical (h, post, comb; head y) for fp32 and
bf16 x, T in {1, 2, 5, 33}, n = 4, K not a multiple of BLOCK_K, one and several token tiles; the
invariant plan's one-launch form equals its two-launch form and a token alone equals its row in a
long call; repeated calls leave the counters zero (and equal outputs); the outputs match the
reference `mhc_pre` / `mhc_head`; the plan's default choice; counter-buffer validation.
GPU (`-m gpu`): V4-Flash shapes (n = 4, d = 4096), T in {1, 2, 8, 32}: one launch bit-identical
to the two-launch form with one d span (`d_spans=1`: the same tiles and warps), close to the
default two-launch plan and to the reference; the invariant plan bit-identical both ways; the
default plan picks one launch at decode; CUDA-graph replays.

    PYTHONPATH=src python -m pytest -q tests/kernels/test_mhc_one_launch.py         # interpreter
    PYTHONPATH=src python -m pytest -q -m gpu tests/kernels/test_mhc_one_launch.py  # CUDA
"""

from __future__ import annotations

import os
from typing import Any

import torch

# NOTE: must precede the first `import triton` (tests/kernels/conftest.py may already do this).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from test_mhc_triton import (  # noqa: E402
    BF16_REL,
    DEVICE,
    FP32_REL,
    HC_EPS,
    NORM_EPS,
    assert_close,
    make_params,
    make_x,
)

from dsv4.kernels.ref.mhc import mhc_head, mhc_pre  # noqa: E402
from dsv4.kernels.triton.mhc import (  # noqa: E402
    plan_one_launch,
    plan_pre,
    triton_mhc_head,
    triton_mhc_pre,
)

FLASH_D = 4096
Outs = tuple[torch.Tensor, ...]


@pytest.fixture
def poisoned_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.empty returns NaN-filled float tensors: a workspace read before it is written, or an
    output never written, shows (freed memory may otherwise still hold a previous call's values)."""
    empty = torch.empty

    def poisoned(*args: Any, **kwargs: Any) -> torch.Tensor:
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)


def pre(x: torch.Tensor, n: int, seed: int, **knobs: Any) -> Outs:
    fn, scale, base = make_params(n, x.shape[2], (2 + n) * n, 3, seed, str(x.device))
    return triton_mhc_pre(x, fn, scale, base, n, 20, HC_EPS, NORM_EPS, **knobs)


def head(x: torch.Tensor, seed: int, **knobs: Any) -> Outs:
    n = x.shape[1]
    fn, scale, base = make_params(n, x.shape[2], n, 1, seed, str(x.device))
    return (triton_mhc_head(x, fn, scale, base, HC_EPS, NORM_EPS, **knobs),)


def assert_equal(got: Outs, want: Outs) -> None:
    assert len(got) == len(want)
    for name, a, b in zip(("h", "post", "comb"), got, want, strict=False):
        assert torch.equal(a, b), f"{name}: max |diff| {(a.float() - b.float()).abs().max():.3e}"


def assert_reference(x: torch.Tensor, got: Outs, n: int, seed: int, weights_rel: float) -> None:
    fn, scale, base = make_params(n, x.shape[2], (2 + n) * n, 3, seed, str(x.device))
    want = mhc_pre(x, fn, scale, base, n, 20, HC_EPS, NORM_EPS)
    assert_close(got[0], want[0], FP32_REL if x.dtype == torch.float32 else BF16_REL, "h")
    assert_close(got[1], want[1], weights_rel, "post")
    assert_close(got[2], want[2], weights_rel, "comb")


# ---- CPU: interpreter ----------------------------------------------------------------------------

pytestmark = pytest.mark.usefixtures("poisoned_empty")
# the small shapes below give the two-launch finish 1 warp and the one launch 4: equal bits under
# the interpreter only (the GPU tests at the end compare V4-Flash shapes, where both run 4)
interpreter = pytest.mark.skipif(torch.cuda.is_available(),
                                 reason="interpreter bits: small shapes (GPU: the flash tests)")

CASES = [pytest.param(T, d, bt, id=f"T{T}-d{d}" + (f"-bt{bt}" if bt else ""))
         for T, d, bt in ((1, 40, None), (2, 40, None), (5, 40, None), (33, 40, None),
                          (33, 64, 16), (5, 64, None))]


@interpreter
@pytest.mark.parametrize("T,d,block_t", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_pre_one_launch_equals_two_launches(T: int, d: int, block_t: int | None,
                                            dtype: torch.dtype) -> None:
    """d = 40: K = 160 is not a multiple of BLOCK_K = 64 (nor d of the finish's BLOCK_D); T = 33
    with 16-token tiles: three tiles (three counters), the last partial; T = 33: finish tiles of
    8 tokens. The outputs also match the reference (a finish that ran early or summed wrong
    would not)."""
    x, counters = make_x(T, 4, d, dtype, T + d), torch.zeros(8, dtype=torch.int32, device=DEVICE)
    knobs = {"splits": 3, "block_t": block_t}
    one = pre(x, 4, d, one_launch=True, counters=counters, **knobs)
    assert_equal(one, pre(x, 4, d, one_launch=False, **knobs))
    assert_equal(one, pre(x, 4, d, one_launch=False, d_spans=1, **knobs))
    assert_reference(x, one, 4, d, FP32_REL)
    assert not counters.any()


@interpreter
@pytest.mark.parametrize("T", [1, 5, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_head_one_launch_equals_two_launches(T: int, dtype: torch.dtype) -> None:
    x = make_x(T, 4, 40, dtype, T)
    one = head(x, T, splits=3, one_launch=True)
    assert_equal(one, head(x, T, splits=3, one_launch=False))
    fn, scale, base = make_params(4, 40, 4, 1, T)
    assert_close(one[0], mhc_head(x, fn, scale, base, HC_EPS, NORM_EPS),
                 FP32_REL if dtype == torch.float32 else BF16_REL, "y")


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_invariant_one_launch(dtype: torch.dtype) -> None:
    """The invariant plan: one launch = two launches, and a token alone (one launch) = its row of
    a 33-token call (two launches)."""
    x = make_x(33, 4, 64, dtype, 3)
    full = pre(x, 4, 3, invariant=True, one_launch=False)
    assert_equal(pre(x, 4, 3, invariant=True, one_launch=True), full)
    for t in (0, 17, 32):
        alone = pre(x[t:t + 1], 4, 3, invariant=True, one_launch=True)
        assert_equal(alone, tuple(o[t:t + 1] for o in full))


def test_repeated_calls_leave_counters_zero() -> None:
    """Two calls on one counter buffer: the same outputs, the buffer zero after each. A counter
    left non-zero would make the next call's last arrival never match (outputs left unwritten)."""
    x, counters = make_x(2, 4, 64, torch.float32, 9), torch.zeros(4, dtype=torch.int32,
                                                                   device=DEVICE)
    first = pre(x, 4, 9, splits=4, one_launch=True, counters=counters)
    assert not counters.any()
    assert_equal(pre(x, 4, 9, splits=4, one_launch=True, counters=counters), first)
    assert not counters.any()
    assert_equal(pre(x, 4, 9, splits=4, one_launch=True), first)     # the held buffer, twice
    assert_equal(pre(x, 4, 9, splits=4, one_launch=True), first)


def test_plan_one_launch_default() -> None:
    """Two launches unless asked (the one launch is slower on the H200: `plan_one_launch`)."""
    cpu = torch.device("cpu")
    for T in (1, 2, 64):
        assert plan_one_launch(T, FLASH_D, 4, 256, 4, cpu) is None
    assert plan_one_launch(1, FLASH_D, 4, 256, 4, cpu, one_launch=True) == (1, FLASH_D, 2048, 64)
    assert plan_one_launch(1, FLASH_D, 4, 1, 4, cpu, one_launch=True) is None    # fused path
    assert plan_one_launch(1, 64, 4, 2, 4, cpu, one_launch=True) == (1, 64, 64, 2)
    assert plan_one_launch(1, FLASH_D, 4, 256, 4, cpu, one_launch=False) is None
    assert plan_one_launch(64, FLASH_D, 4, 32, 4, cpu, invariant=True, one_launch=True) == \
        (1, FLASH_D, 2048, 32)


@interpreter
def test_rejects_bad_counters() -> None:
    x = make_x(33, 4, 32, torch.float32, 0)
    for bad in (torch.zeros(2, dtype=torch.int32), torch.zeros(8, dtype=torch.int64),
                torch.zeros(8, 2, dtype=torch.int32)[:, 0]):
        with pytest.raises(ValueError, match="counters"):
            pre(x, 4, 0, splits=2, block_t=16, one_launch=True, counters=bad.to(DEVICE))


# ---- GPU: V4-Flash shapes ------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 8, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_one_launch_flash_cuda(T: int, dtype: torch.dtype) -> None:
    """Bit-identical to the two-launch form with the same finish tiles and warps (d_spans=1);
    within the bounds of the default two-launch plan (other reduction trees) and the reference."""
    x = make_x(T, 4, FLASH_D, dtype, T, "cuda")
    one = pre(x, 4, T, one_launch=True)
    assert_equal(one, pre(x, 4, T, one_launch=False, d_spans=1))
    two = pre(x, 4, T, one_launch=False)
    for name, a, b in zip(("h", "post", "comb"), one, two, strict=True):
        assert_close(a, b, FP32_REL if a.dtype == torch.float32 else BF16_REL, name)
    assert_reference(x, one, 4, T, 1e-4)
    y = head(x, T, one_launch=True)
    assert_equal(y, head(x, T, one_launch=False, d_spans=1))


@pytest.mark.gpu
def test_default_plan_is_two_launches_at_decode_cuda() -> None:
    cuda = torch.device("cuda")
    for T in (1, 2):
        _, S, _ = plan_pre(T, 4 * FLASH_D, cuda)
        assert S > 1 and plan_one_launch(T, FLASH_D, 4, S, 4, cuda) is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_invariant_one_launch_flash_cuda(dtype: torch.dtype) -> None:
    """Invariant plan: one launch = two launches (today's invariant bits), and a token alone
    (either form) = its row of a 64-token call."""
    x = make_x(64, 4, FLASH_D, dtype, 5, "cuda")
    full = pre(x, 4, 5, invariant=True, one_launch=False)
    assert_equal(pre(x, 4, 5, invariant=True, one_launch=True), full)
    for t in (0, 31, 63):
        for knob in (None, True):
            alone = pre(x[t:t + 1], 4, 5, invariant=True, one_launch=knob)
            assert_equal(alone, tuple(o[t:t + 1] for o in full))
    ys = head(x, 5, invariant=True, one_launch=False)
    assert_equal(head(x[:1], 5, invariant=True), (ys[0][:1],))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2])
def test_one_launch_cuda_graph_replays(T: int) -> None:
    """Captured with its own counters; five replays on fresh inputs, each bit-identical to an
    eager two-launch call (d_spans=1), the counters zero after each."""
    params = make_params(4, FLASH_D, 24, 3, 0, "cuda")
    x = make_x(T, 4, FLASH_D, torch.bfloat16, 0, "cuda")
    counters = torch.zeros(4, dtype=torch.int32, device="cuda")

    def run() -> Outs:
        return triton_mhc_pre(x, *params, 4, 20, HC_EPS, NORM_EPS, one_launch=True,
                              counters=counters)

    run()                                                               # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    for seed in range(1, 6):
        x.copy_(make_x(T, 4, FLASH_D, torch.bfloat16, seed, "cuda"))
        graph.replay()
        torch.cuda.synchronize()
        want = triton_mhc_pre(x, *params, 4, 20, HC_EPS, NORM_EPS, one_launch=False, d_spans=1)
        assert_equal(outs, want)
        assert not counters.any()
