"""The quantised routed experts through decoded bf16 chunks (`kernels/triton/moe_dequant.py`).

CPU (the interpreter, small shapes): the chunked path equals the bf16 loop on the dequantised
weights bit for bit with several chunks (two buffers in turn, each reused; FP8: a partial last
chunk) and with one chunk (more than E: clamped to E, one buffer), FP4 and FP8, with ragged
loads (experts with no token, one expert with every token); it stays within the quantised
loop's tolerance of the reference; the plan's default, the knob's validation, the scratch size,
and the backend's `invariant_plans` op never taking the path.
GPU (`-m gpu`): V4-Flash experts at N = 4096 and 8192 (where the plan takes the path): chunks of
DEQUANT_CHUNK equal the bf16 loop on the whole layer decoded at once, bit for bit, and agree with
the quantised loop.

    PYTHONPATH=src python -m pytest -q tests/kernels/test_moe_dequant.py
"""

from __future__ import annotations

import os

import torch

# NOTE: must precede the first `import triton` (tests/kernels/conftest.py may already do this).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from test_moe_quant import (  # noqa: E402
    DEVICE,
    FLASH,
    REL,
    Weights,
    check,
    make_routing,
    make_weights,
    randn,
)

from dsv4.kernels import registry  # noqa: E402
from dsv4.kernels.ref.moe import dequant_experts  # noqa: E402
from dsv4.kernels.triton import moe, moe_dequant, moe_mma, moe_plan  # noqa: E402
from dsv4.kernels.triton.moe import triton_routed_experts_quant  # noqa: E402

LIMIT = 10.0


def _bf16_loop(x: torch.Tensor, wts: Weights, idx: torch.Tensor, rw: torch.Tensor,
               fmt: str) -> torch.Tensor:
    """The bf16 loop on the layer dequantised by the reference codec, in one launch pair."""
    w1, w3, w2 = dequant_experts(*wts, fmt, torch.bfloat16)  # type: ignore[misc]
    w13 = torch.cat([w1, w3], dim=1).contiguous()
    return triton_routed_experts_quant(x, w13, None, w2.contiguous(), None, idx, rw, LIMIT,
                                       "bf16", deterministic=True)


def _chunked(x: torch.Tensor, wts: Weights, idx: torch.Tensor, rw: torch.Tensor, fmt: str,
             chunk: int | None) -> torch.Tensor:
    return triton_routed_experts_quant(x, *wts[:2], *wts[2:], idx, rw,  # type: ignore[arg-type]
                                       LIMIT, fmt, deterministic=True, dequant_chunk=chunk)


# (fmt, E, d, I): FP8 needs I whole 128-blocks on this path
SHAPES = [("fp4", 6, 64, 64), ("fp8", 5, 128, 128)]


@pytest.mark.parametrize("fmt,E,d,inter", SHAPES, ids=[s[0] for s in SHAPES])
def test_chunks_equal_the_bf16_loop_on_decoded_weights(fmt: str, E: int, d: int,
                                                       inter: int) -> None:
    wts = make_weights(E, d, inter, fmt, seed=3)
    # 9 tokens: expert 1 in every token, the other slot cycling over experts 0, 2, 3, so
    # experts 4 .. E-1 get no token
    _, rw = make_routing(9, E, 2, seed=4)
    idx = torch.stack([torch.ones(9, dtype=torch.int64),
                       torch.tensor([0, 2, 3] * 3)], dim=1).to(DEVICE)
    x = randn(9, d, seed=5).to(torch.bfloat16)
    want = _bf16_loop(x, wts, idx, rw, fmt)
    # chunk 1 runs the steps of 2 (three chunks here, the two buffers in turn, each reused);
    # chunk E those of E + 3 (clamped to E: one buffer)
    for chunk in (2, E + 3):
        got = _chunked(x, wts, idx, rw, fmt, chunk)
        assert torch.equal(got, want), chunk


@pytest.mark.parametrize("fmt,E,d,inter", SHAPES, ids=[s[0] for s in SHAPES])
def test_chunks_within_the_reference_tolerance(fmt: str, E: int, d: int, inter: int) -> None:
    wts = make_weights(E, d, inter, fmt, seed=6)
    idx, rw = make_routing(7, E, 2, seed=7)
    x = randn(7, d, seed=8).to(torch.bfloat16)
    check(x, wts, idx, rw, LIMIT, fmt, dequant_chunk=2)


def test_plan_default() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    E = 256
    rows = moe_plan.DEQUANT_MIN_MEAN_ROWS["fp4"]
    at = int(rows * E)
    assert moe_plan.dequant_chunk("fp4", cuda, at, E, pinned=False) == moe_plan.DEQUANT_CHUNK
    assert moe_plan.dequant_chunk("fp4", cuda, at - 1, E, pinned=False) == 0
    assert moe_plan.dequant_chunk("fp4", cuda, at, E, pinned=True) == 0
    assert moe_plan.dequant_chunk("fp4", cpu, at, E, pinned=False) == 0
    assert moe_plan.dequant_chunk("bf16", cuda, 10 * at, E, pinned=False) == 0
    for fmt in moe_plan.DEQUANT_MIN_MEAN_ROWS:
        assert fmt in moe_dequant.FMTS


def test_validation() -> None:
    wts = make_weights(4, 64, 96, "fp8", seed=1)          # I = 96: not whole FP8 blocks
    idx, rw = make_routing(3, 4, 2)
    x = randn(3, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 128"):
        _chunked(x, wts, idx, rw, "fp8", 2)
    wts = make_weights(4, 64, 64, "fp4", seed=1)
    with pytest.raises(ValueError, match="no loop or tile knob"):
        triton_routed_experts_quant(x, *wts[:2], *wts[2:], idx, rw,  # type: ignore[arg-type]
                                    LIMIT, "fp4", variant="scaled", dequant_chunk=2)
    plain = make_weights(4, 64, 64, "bf16", seed=1)
    with pytest.raises(ValueError, match="quantised experts"):
        _chunked(x, plain, idx, rw, "bf16", 2)
    with pytest.raises(ValueError, match=">= 1"):
        moe_dequant.check_dequant("fp4", 64, -1)
    # 0: the quantised loop, never the chunks (33 tokens: the plan's "words" MMA loop)
    idx, rw = make_routing(33, 4, 2)
    x = randn(33, 64).to(torch.bfloat16)
    loop = triton_routed_experts_quant(x, *wts[:2], *wts[2:], idx, rw,  # type: ignore[arg-type]
                                       LIMIT, "fp4", deterministic=True)
    assert torch.equal(_chunked(x, wts, idx, rw, "fp4", 0), loop)


def test_scratch_bytes() -> None:
    per_expert = 3 * FLASH["inter"] * FLASH["d"] * 2
    assert moe_dequant.scratch_bytes(32, 256, FLASH["inter"], FLASH["d"]) == 64 * per_expert
    assert moe_dequant.scratch_bytes(300, 256, FLASH["inter"], FLASH["d"]) == 256 * per_expert


def test_invariant_plans_keep_the_quantised_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `invariant_plans` a token's expert rows may not depend on the token count, so the
    backend's op never takes the chunked path; the default op takes it where the plan says
    (33 tokens: the quantised loop is the plan's "words" MMA loop)."""
    calls: list[int] = []

    def spy(*args: object) -> None:
        calls.append(int(args[5]))   # type: ignore[call-overload]
        real(*args)                   # type: ignore[arg-type]
    real = moe_dequant.dequant_chunks
    monkeypatch.setattr(moe_mma, "dequant_chunks", spy)
    monkeypatch.setattr(moe, "default_dequant_chunk", lambda *a: 2)
    wts = make_weights(4, 64, 64, "fp4", seed=2)
    idx, rw = make_routing(33, 4, 2)
    x = randn(33, 64).to(torch.bfloat16)
    args = (x, *wts[:2], *wts[2:], idx, rw, LIMIT, "fp4")
    invariant = registry.create_kernels("triton", invariant_plans=True).routed_experts_quant
    invariant(*args)  # type: ignore[arg-type]
    assert calls == []
    registry.create_kernels("triton").routed_experts_quant(*args)  # type: ignore[arg-type]
    assert calls == [2]


# ---- GPU: V4-Flash experts -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def flash_fp4() -> Weights:
    return make_weights(FLASH["E"], FLASH["d"], FLASH["inter"], "fp4")


@pytest.mark.gpu
@pytest.mark.parametrize("N", [4096, 8192])
def test_flash_chunks(flash_fp4: Weights, N: int) -> None:
    """Chunks of DEQUANT_CHUNK (the plan's own choice at N = 8192) equal the bf16 loop on the whole
    layer decoded at once (one chunk of E), bit for bit, and the quantised loop's within REL."""
    nk, E = N * FLASH["k"], FLASH["E"]
    picked = moe_plan.dequant_chunk("fp4", torch.device(DEVICE), nk, E, pinned=False)
    assert picked == (moe_plan.DEQUANT_CHUNK
                      if nk >= moe_plan.DEQUANT_MIN_MEAN_ROWS["fp4"] * E else 0)
    idx, rw = make_routing(N, E, FLASH["k"], seed=N)
    idx[: N // 2, 0] = 7                      # a hot expert: half the tokens
    idx[:, 1:] = torch.where(idx[:, 1:] == 7, (idx[:, 1:] + 1) % E, idx[:, 1:])
    idx = torch.where(idx == 3, torch.full_like(idx, 11), idx)    # expert 3 empty
    x = randn(N, FLASH["d"], seed=N + 1).to(torch.bfloat16)
    got = _chunked(x, flash_fp4, idx, rw, "fp4", moe_plan.DEQUANT_CHUNK)
    if picked:
        assert torch.equal(got, triton_routed_experts_quant(
            x, *flash_fp4[:2], *flash_fp4[2:], idx, rw,  # type: ignore[arg-type]
            LIMIT, "fp4", deterministic=True))
    whole = _chunked(x, flash_fp4, idx, rw, "fp4", E)
    assert torch.equal(got, whole)
    loop = _chunked(x, flash_fp4, idx, rw, "fp4", 0)
    err = ((got - loop).abs().max() / loop.abs().max()).item()
    assert err <= REL, f"max |diff| / max |loop| = {err:.3e}"
