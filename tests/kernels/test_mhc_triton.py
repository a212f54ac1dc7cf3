"""Parity of the fused mHC kernels (`triton_mhc_pre`, `triton_mhc_post`, `triton_mhc_head`) with
the references `mhc_pre`, `mhc_post`, `mhc_head` (spec §5), and of the references with the model
modules.

Reference: bit-equal (torch.equal, fp32 and bf16) to `HyperConnection.pre` / `.post` and
`HyperHead.forward` on [B, S, n, d] inputs flattened to tokens.
CPU: small shapes under the Triton interpreter: n = 4, d in {32, 64, 256}, T in {1, 3, 17, 64},
fp32 x to 1e-5 and bf16 x to 1e-2 relative (max |diff| / max |ref| per output), Sinkhorn iters 1, 2,
20; the fused path (splits = 1) and the split-K path (partial + finish launches) on the same inputs;
n = 3 / 8 (padded stream tiles), d = 40 (K not a multiple of BLOCK_K), partial token tiles, input
validation.
GPU (`-m gpu`): V4-Flash shapes (n = 4, d = 4096, bf16 x, fp32 params), T in {1, 8, 64, 512, 4096},
both paths, the fp32-x (tf32x3) path, CUDA-graph replay.
The split-K path's one-launch form (`mhc_split.py`) has its own file, test_mhc_one_launch.py (it
imports this file's helpers).

    PYTHONPATH=src python -m pytest -q tests/kernels/test_mhc_triton.py         # interpreter, CPU
    PYTHONPATH=src python -m pytest -q -m gpu tests/kernels/test_mhc_triton.py  # a CUDA machine
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

# NOTE: must precede the first `import triton` (tests/kernels/conftest.py may already do this).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from dsv4.checkpoint.presets import micro, tiny  # noqa: E402
from dsv4.config.model import ModelConfig  # noqa: E402
from dsv4.kernels.ref.mhc import mhc_head, mhc_post, mhc_pre  # noqa: E402
from dsv4.kernels.triton.mhc import (  # noqa: E402
    finish_warps,
    plan_finish,
    plan_pre,
    triton_mhc_head,
    triton_mhc_pre,
)
from dsv4.kernels.triton.mhc_post import triton_mhc_post  # noqa: E402
from dsv4.kernels.triton.mhc_split import plan_apart  # noqa: E402
from dsv4.model.hyper_connection import HyperConnection, HyperHead  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP32_REL = 1e-5     # max |diff| / max |ref|, per output
BF16_REL = 1e-2
HC_EPS = NORM_EPS = 1e-6

Params = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def make_params(n: int, d: int, rows: int, n_scale: int, seed: int, device: str = DEVICE) -> Params:
    """fn with mix ~ O(1) (so the sigmoids and the softmax are far from saturated), base with an
    identity-leaning comb (as train/init.py), scale near 1."""
    g = torch.Generator(device).manual_seed(seed)
    fn = torch.randn(rows, n * d, generator=g, device=device) * 2 * (n * d) ** -0.5
    base = torch.randn(rows, generator=g, device=device) * 0.5
    if rows > n:
        base[2 * n:].view(n, n).diagonal().add_(2.0)
    scale = 0.5 + torch.rand(n_scale, generator=g, device=device)
    return fn, scale, base


def make_x(T: int, n: int, d: int, dtype: torch.dtype, seed: int,
           device: str = DEVICE) -> torch.Tensor:
    g = torch.Generator(device).manual_seed(seed + 1000)
    # streams of unequal RMS
    streams = 1 + torch.arange(n, device=device, dtype=torch.float32)[:, None]
    return (torch.randn(T, n, d, generator=g, device=device) * streams).to(dtype)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape and out.dtype == ref.dtype, (
        out.shape, out.dtype, ref.shape, ref.dtype)
    if ref.numel() == 0:
        return 0.0
    return ((out.float() - ref.float()).abs().max()
            / ref.float().abs().max().clamp(min=1e-6)).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, limit: float, name: str) -> None:
    err = rel_error(out, ref)
    assert err <= limit, f"{name}: max |diff| / max |ref| = {err:.3e} > {limit:.0e}"


def check_pre(x: torch.Tensor, params: Params, n: int, iters: int, *,
              weights_rel: float = FP32_REL, **knobs: int) -> None:
    fn, scale, base = params
    got = triton_mhc_pre(x, fn, scale, base, n, iters, HC_EPS, NORM_EPS, **knobs)
    want = mhc_pre(x, fn, scale, base, n, iters, HC_EPS, NORM_EPS)
    assert_close(got[0], want[0], FP32_REL if x.dtype == torch.float32 else BF16_REL, "h")
    assert_close(got[1], want[1], weights_rel, "post")
    assert_close(got[2], want[2], weights_rel, "comb")


# ---- the references are the model modules' math --------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("config", [micro(), tiny()], ids=["micro", "tiny"])
def test_reference_bit_equals_model_modules(config: ModelConfig, dtype: torch.dtype) -> None:
    hc, head = HyperConnection(config), HyperHead(config)
    n, d = hc.n, hc.fn.shape[1] // hc.n
    with torch.no_grad():
        for module, seed in ((hc, 0), (head, 1)):
            fn, scale, base = make_params(n, d, module.fn.shape[0], module.scale.shape[0], seed,
                                          "cpu")
            module.fn.copy_(fn)
            module.scale.copy_(scale)
            module.base.copy_(base)
        x = make_x(2 * 5, n, d, dtype, 2, "cpu").view(2, 5, n, d)
        f = torch.randn(2, 5, d).to(dtype)
        h, post, comb = hc.pre(x)
        flat = x.flatten(0, 1)
        got = mhc_pre(flat, hc.fn, hc.scale, hc.base, n, hc.iters, hc.hc_eps, hc.norm_eps)
        for a, b in zip(got, (h, post, comb), strict=True):
            assert torch.equal(a, b.flatten(0, 1))
        assert torch.equal(mhc_post(f.flatten(0, 1), flat, got[1], got[2]),
                           HyperConnection.post(f, x, post, comb).flatten(0, 1))
        assert torch.equal(mhc_head(flat, head.fn, head.scale, head.base, head.hc_eps,
                                    head.norm_eps), head(x).flatten(0, 1))


# ---- CPU: interpreter parity ---------------------------------------------------------------------

SHAPES = [pytest.param(d, T, id=f"d{d}-T{T}") for d in (32, 64, 256) for T in (1, 3, 17, 64)]


@pytest.mark.parametrize("d,T", SHAPES)
def test_pre_fp32_both_paths(d: int, T: int) -> None:
    x, params = make_x(T, 4, d, torch.float32, d + T), make_params(4, d, 24, 3, d + T)
    check_pre(x, params, 4, 20, splits=1)
    check_pre(x, params, 4, 20, splits=3)


@pytest.mark.parametrize("d,T", [pytest.param(d, T, id=f"d{d}-T{T}")
                                 for d, T in ((32, 1), (64, 17), (256, 64))])
def test_pre_bf16_both_paths(d: int, T: int) -> None:
    """bf16 x: the bf16x3 projection (pieces upcast under the interpreter); post / comb stay
    fp32-accurate."""
    x, params = make_x(T, 4, d, torch.bfloat16, d + T), make_params(4, d, 24, 3, d + T)
    check_pre(x, params, 4, 20, splits=1)
    check_pre(x, params, 4, 20, splits=2)


@pytest.mark.parametrize("iters", [1, 2, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_pre_sinkhorn_iters(iters: int, dtype: torch.dtype) -> None:
    x, params = make_x(5, 4, 64, dtype, iters), make_params(4, 64, 24, 3, iters)
    check_pre(x, params, 4, iters, splits=1)
    check_pre(x, params, 4, iters, splits=4)


@pytest.mark.parametrize("n,d,T,knobs", [
    # padded streams; K = 120: masked k tiles
    pytest.param(3, 40, 5, {"splits": 1}, id="n3-d40-fused"),
    pytest.param(3, 40, 5, {"splits": 2, "block_k": 32}, id="n3-d40-split"),
    pytest.param(8, 32, 4, {"splits": 1}, id="n8-d32-fused"),          # NP = 8: 64-wide operands
    # 3 tiles, the last partial
    pytest.param(4, 64, 40, {"splits": 1, "block_t": 16}, id="n4-T40-tiles16"),
    pytest.param(4, 64, 40, {"splits": 1000, "block_k": 16}, id="n4-splits-clipped"),
    pytest.param(4, 512, 1, {"splits": 4}, id="n4-d512-T1-two-d-spans"),
])
def test_pre_odd_geometry(n: int, d: int, T: int, knobs: dict[str, int]) -> None:
    x = make_x(T, n, d, torch.float32, n * d)
    params = make_params(n, d, (2 + n) * n, 3, n * d)
    check_pre(x, params, n, 20, **knobs)


def test_plan_paths() -> None:
    cpu = torch.device("cpu")
    assert plan_pre(256, 256, cpu) == (64, 1, 256)          # 4 tiles >= 2 per SM (1 SM): fused
    assert plan_pre(64, 256, cpu) == (64, 2, 128)           # 1 tile: split in two
    assert plan_pre(1, 16384, cpu, splits=132) == (16, 128, 128)  # 256 blocks over 132: 2 each
    assert plan_pre(3, 120, cpu, block_k=32, splits=2) == (16, 2, 64)  # 4 blocks, last partial


def test_plan_finish() -> None:
    cpu = torch.device("cpu")                                       # 4 programs wanted (1 SM)
    assert plan_finish(1, 512, 4, 4, cpu) == (1, 256, 256, 4)       # two d spans
    assert plan_finish(17, 64, 4, 3, cpu) == (4, 64, 64, 4)         # token tiles, the last partial
    assert plan_finish(64, 256, 4, 128, cpu) == (16, 256, 128, 4)   # whole rows, 2 inner chunks


def test_finish_sums_three_chunks() -> None:
    """171 splits: the finish sums its partials in chunks of 64, two per round trip, the last
    round with one chunk; the values are the reference's either way (apart and together)."""
    x, params = make_x(1, 4, 2048, torch.float32, 3), make_params(4, 2048, 24, 3, 3)
    assert plan_pre(1, 4 * 2048, torch.device("cpu"), block_k=16, splits=200)[1] == 171
    for apart in (True, False):
        check_pre(x, params, 4, 20, block_k=16, splits=200, weights_apart=apart)


def test_plan_apart() -> None:
    """post / comb get programs of their own when d is in spans of one tile each (decode), not
    for the head, whole-row tiles or when turned off."""
    assert plan_apart(False, 512, (1, 256, 256, 4))                  # two spans
    assert not plan_apart(True, 512, (1, 256, 256, 4))               # head: no post / comb
    assert not plan_apart(False, 512, (1, 256, 256, 4), apart=False)
    assert not plan_apart(False, 256, (16, 256, 128, 4))             # a span of 2 tiles
    assert not plan_apart(False, 256, (1, 256, 256, 4))              # one span
    assert plan_apart(False, 256, (1, 256, 256, 4), apart=True)      # forced


@pytest.mark.parametrize("T,d,d_spans,dtype", [
    pytest.param(1, 512, None, torch.float32, id="T1-d512-plan"),
    pytest.param(1, 512, None, torch.bfloat16, id="T1-d512-plan-bf16"),
    pytest.param(3, 64, 2, torch.float32, id="T3-two-spans"),
    pytest.param(2, 72, 2, torch.bfloat16, id="T2-d72-uneven"),
    pytest.param(1, 256, 1, torch.float32, id="T1-one-span-forced"),
])
def test_finish_weights_apart_same_bits(T: int, d: int, d_spans: int | None,
                                        dtype: torch.dtype) -> None:
    """The finish's weights programs (`plan_apart`) write the bits span 0 writes without them."""
    x, (fn, scale, base) = make_x(T, 4, d, dtype, d), make_params(4, d, 24, 3, d)
    knobs = {"splits": 4, "d_spans": d_spans}
    apart = triton_mhc_pre(x, fn, scale, base, 4, 20, HC_EPS, NORM_EPS, weights_apart=True,
                           **knobs)
    together = triton_mhc_pre(x, fn, scale, base, 4, 20, HC_EPS, NORM_EPS, weights_apart=False,
                              **knobs)
    # the plan's choice is one of the two: both against the reference as `check_pre` compares it
    want = mhc_pre(x, fn, scale, base, 4, 20, HC_EPS, NORM_EPS)
    limits = (FP32_REL if dtype == torch.float32 else BF16_REL, FP32_REL, FP32_REL)
    for name, a, b, w, limit in zip(("h", "post", "comb"), apart, together, want, limits,
                                    strict=True):
        assert torch.equal(a, b), name
        assert_close(a, w, limit, name)


def test_finish_warps() -> None:
    """One warp for a decode token's small tile, more for larger tiles; the T-invariant plan's
    tiles (and so its warps) are the same at every T."""
    assert finish_warps(1, 4, 256) == 1 and finish_warps(1, 4, 512) == 2
    assert finish_warps(16, 4, 128) == 4
    cpu = torch.device("cpu")
    plans = {plan_finish(T, 4096, 4, 32, cpu, invariant=True) for T in (1, 64, 4096)}
    assert len(plans) == 1
    bt, _, bd, _ = plans.pop()
    assert finish_warps(bt, 4, bd) == 4


def test_comb_is_column_stochastic() -> None:
    x, params = make_x(6, 4, 32, torch.float32, 7), make_params(4, 32, 24, 3, 7)
    _, post, comb = triton_mhc_pre(x, *params, 4, 20, HC_EPS, NORM_EPS)
    # columns, after the last step
    assert torch.allclose(comb.sum(dim=1), torch.ones_like(post), atol=1e-4)
    assert (post > 0).all() and (post < 2).all()


# post's grid is one program per token and d chunk (one chunk for d <= 256), so T = 17 and 64 only
# add programs to the T = 3 grid of the same kernel
@pytest.mark.parametrize("d,T", [pytest.param(d, T, id=f"d{d}-T{T}") for d in (32, 64, 256)
                                 for T in (1, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_post(d: int, T: int, dtype: torch.dtype) -> None:
    x, f = make_x(T, 4, d, dtype, d), torch.randn(T, d, device=DEVICE).to(dtype)
    _, post, comb = mhc_pre(x, *make_params(4, d, 24, 3, d), 4, 20, HC_EPS, NORM_EPS)
    assert_close(triton_mhc_post(f, x, post, comb), mhc_post(f, x, post, comb),
                 FP32_REL if dtype == torch.float32 else BF16_REL, "x'")


def test_post_chunks_and_strided_f() -> None:
    """Several d chunks, the last partial (d = 40, block_d = 16); f a row-strided view; n = 3."""
    x = make_x(3, 3, 40, torch.float32, 3)
    f = torch.randn(3, 64, device=DEVICE)[:, 8:48]
    _, post, comb = mhc_pre(x, *make_params(3, 40, 15, 3, 3), 3, 20, HC_EPS, NORM_EPS)
    assert_close(triton_mhc_post(f, x, post, comb, block_d=16), mhc_post(f, x, post, comb),
                 FP32_REL, "x'")


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("d,T,dtype", [pytest.param(32, 1, torch.float32, id="d32-T1-fp32"),
                                       pytest.param(256, 17, torch.float32, id="d256-T17-fp32"),
                                       pytest.param(64, 64, torch.bfloat16, id="d64-T64-bf16")])
def test_head(d: int, T: int, dtype: torch.dtype, splits: int) -> None:
    x, (fn, scale, base) = make_x(T, 4, d, dtype, T), make_params(4, d, 4, 1, T)
    assert_close(triton_mhc_head(x, fn, scale, base, HC_EPS, NORM_EPS, splits=splits),
                 mhc_head(x, fn, scale, base, HC_EPS, NORM_EPS),
                 FP32_REL if dtype == torch.float32 else BF16_REL, "y")


def test_empty() -> None:
    x, params = make_x(0, 4, 32, torch.float32, 0), make_params(4, 32, 24, 3, 0)
    h, post, comb = triton_mhc_pre(x, *params, 4, 20, HC_EPS, NORM_EPS)
    assert h.shape == (0, 32) and post.shape == (0, 4) and comb.shape == (0, 4, 4)
    assert triton_mhc_post(torch.zeros(0, 32, device=DEVICE), x, post, comb).shape == (0, 4, 32)
    assert triton_mhc_head(x, *make_params(4, 32, 4, 1, 0), HC_EPS, NORM_EPS).shape == (0, 32)


def test_rejects_bad_inputs() -> None:
    x, (fn, scale, base) = make_x(2, 4, 32, torch.float32, 0), make_params(4, 32, 24, 3, 0)
    bad_pre = {
        "x 2-D": (x[0], fn, scale, base, 4),
        "n mismatch": (x, fn, scale, base, 3),
        "fn bf16": (x, fn.bfloat16(), scale, base, 4),
        "fn rows": (x, fn[:20], scale, base, 4),
        "x not contiguous": (x.transpose(1, 2).contiguous().transpose(1, 2), fn, scale, base, 4),
        "x int8": (x.to(torch.int8), fn, scale, base, 4),
        "scale length": (x, fn, scale[:1], base, 4),
    }
    for name, (xx, ff, ss, bb, n) in bad_pre.items():
        with pytest.raises(ValueError):
            triton_mhc_pre(xx, ff, ss, bb, n, 20, HC_EPS, NORM_EPS)
            pytest.fail(f"accepted {name}")
    with pytest.raises(ValueError, match="block_t"):
        triton_mhc_pre(x, fn, scale, base, 4, 20, HC_EPS, NORM_EPS, block_t=8)
    _, post, comb = mhc_pre(x, fn, scale, base, 4, 20, HC_EPS, NORM_EPS)
    f = torch.randn(2, 32, device=DEVICE)
    bad_post = {"f width": (f[:, :16], x, post, comb), "post bf16": (f, x, post.bfloat16(), comb),
                "comb shape": (f, x, post, comb[:, :2]),
                "f col stride": (f.t().contiguous().t(), x, post, comb)}
    for name, args in bad_post.items():
        with pytest.raises(ValueError):
            triton_mhc_post(*args)
            pytest.fail(f"accepted {name}")
    with pytest.raises(ValueError):
        triton_mhc_head(x, fn, scale, base, HC_EPS, NORM_EPS)     # fn has 24 rows, head needs 4


# ---- GPU: V4-Flash shapes ------------------------------------------------------------------------

FLASH_D = 4096


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 64, 512, 4096])
def test_pre_flash_cuda(T: int) -> None:
    """bf16 x, default plan plus the other path forced; post / comb checked tighter than the bf16
    bound (the bf16x3 projection is fp32-accurate)."""
    x = make_x(T, 4, FLASH_D, torch.bfloat16, T, "cuda")
    params = make_params(4, FLASH_D, 24, 3, T, "cuda")
    _, splits, _ = plan_pre(T, 4 * FLASH_D, x.device)
    check_pre(x, params, 4, 20, weights_rel=1e-4)
    check_pre(x, params, 4, 20, weights_rel=1e-4, splits=8 if splits == 1 else 1)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 8])
def test_finish_weights_apart_flash_cuda(T: int) -> None:
    """V4-Flash decode: the plan's finish (post / comb programs apart) against span 0 writing
    them, bit for bit."""
    x = make_x(T, 4, FLASH_D, torch.bfloat16, T, "cuda")
    params = make_params(4, FLASH_D, 24, 3, T, "cuda")
    got = triton_mhc_pre(x, *params, 4, 20, HC_EPS, NORM_EPS)
    want = triton_mhc_pre(x, *params, 4, 20, HC_EPS, NORM_EPS, weights_apart=False)
    for name, a, b in zip(("h", "post", "comb"), got, want, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize("T", [100, 200])
def test_finish_prefill_plans_compile_in_seconds_cuda(T: int, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """V4-Flash pre at T = 67..264 plans one-token finish tiles of 64 splits and BLOCK_D 1024 /
    2048 with the weights apart: a compile of ~90 s on the H100 (triton 3.6) while stream
    weights were [BLOCK_T] slices converted at every multiply. Cold compile (fresh cache, the
    kernels' in-memory caches dropped) well under that, and the values against the reference."""
    from dsv4.kernels.triton import mhc_split

    x = make_x(T, 4, FLASH_D, torch.bfloat16, T, "cuda")
    params = make_params(4, FLASH_D, 24, 3, T, "cuda")
    S = plan_pre(T, 4 * FLASH_D, x.device)[1]
    tiles = plan_finish(T, FLASH_D, 4, S, x.device)
    assert tiles[0] == 1 and tiles[3] >= 32 and plan_apart(False, FLASH_D, tiles), tiles
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    for kernel in (mhc_split._mhc_partial_kernel, mhc_split._mhc_finish_kernel):
        kernel.device_caches.clear()
    start = time.perf_counter()
    triton_mhc_pre(x, *params, 4, 20, HC_EPS, NORM_EPS)
    torch.cuda.synchronize()
    assert time.perf_counter() - start < 30.0
    check_pre(x, params, 4, 20)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 512])
def test_pre_fp32_tf32x3_cuda(T: int) -> None:
    x = make_x(T, 4, FLASH_D, torch.float32, T, "cuda")
    params = make_params(4, FLASH_D, 24, 3, T, "cuda")
    check_pre(x, params, 4, 20)
    check_pre(x, params, 4, 20, splits=1)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 64, 512, 4096])
def test_post_and_head_flash_cuda(T: int) -> None:
    x = make_x(T, 4, FLASH_D, torch.bfloat16, T, "cuda")
    f = torch.randn(T, FLASH_D, device="cuda").bfloat16()
    _, post, comb = mhc_pre(x, *make_params(4, FLASH_D, 24, 3, T, "cuda"), 4, 20, HC_EPS, NORM_EPS)
    assert_close(triton_mhc_post(f, x, post, comb), mhc_post(f, x, post, comb), BF16_REL, "x'")
    fn, scale, base = make_params(4, FLASH_D, 4, 1, T, "cuda")
    want = mhc_head(x, fn, scale, base, HC_EPS, NORM_EPS)
    for splits in (None, 1, 8):          # default plan, fused, split-K
        assert_close(triton_mhc_head(x, fn, scale, base, HC_EPS, NORM_EPS, splits=splits), want,
                     BF16_REL, "y")


@pytest.mark.gpu
@pytest.mark.parametrize("T,splits", [(8, None), (4096, 1)], ids=["split", "fused"])
def test_cuda_graph_replay_matches_reference(T: int, splits: int | None) -> None:
    x = make_x(T, 4, FLASH_D, torch.bfloat16, 0, "cuda")
    params = make_params(4, FLASH_D, 24, 3, 0, "cuda")
    f = torch.randn(T, FLASH_D, device="cuda").bfloat16()
    # compile
    triton_mhc_post(f, x, *triton_mhc_pre(x, *params, 4, 20, HC_EPS, NORM_EPS, splits=splits)[1:])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h, post, comb = triton_mhc_pre(x, *params, 4, 20, HC_EPS, NORM_EPS, splits=splits)
        out = triton_mhc_post(f, x, post, comb)
    x.copy_(make_x(T, 4, FLASH_D, torch.bfloat16, 1, "cuda"))
    graph.replay()
    want = mhc_pre(x, *params, 4, 20, HC_EPS, NORM_EPS)
    assert_close(h, want[0], BF16_REL, "h")
    assert_close(comb, want[2], 1e-4, "comb")
    assert_close(out, mhc_post(f, x, want[1], want[2]), BF16_REL, "x'")
