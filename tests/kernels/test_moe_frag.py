"""The routed experts' "frag" loop (`kernels/triton/moe_frag.py`: FP4 decoded into mma.sync
fragments) against the reference and the fma loop; helpers from test_moe_quant.py (whose GPU
Flash parity rows also run frag).

CPU (interpreter, the MMA emulated): a masked K tail (I = 96: the down launch's last step holds
3 of a quad's 4 groups), one expert holding every token, 1 and 2 warps across N, K split over
2 or 4 warps (bits equal), both epilogues, BLOCK_M 8 / 16 tiles (bits equal to BLOCK_M 1's); the
plan's knobs and refusals.
GPU (`-m gpu`): V4-Flash experts at N = 1, 8, 32 on every launch shape the sweep uses (bits
equal), rows independent of the batch.

    PYTHONPATH=src python -m pytest -q tests/kernels/test_moe_frag.py
    PYTHONPATH=src python -m pytest -q tests/kernels/test_moe_frag.py -m gpu   # on a CUDA machine
"""

from __future__ import annotations

import os

import torch

# NOTE: must precede the first `import triton` (tests/kernels/conftest.py may already do this).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from test_moe_quant import FLASH, check, make_routing, make_weights, randn  # noqa: E402

from dsv4.kernels.triton.moe import triton_routed_experts_quant  # noqa: E402
from dsv4.kernels.triton.moe_plan import VARIANTS, frag_warps, plan_moe  # noqa: E402


@pytest.mark.parametrize("N,k,block_n,warps", [(1, 2, 16, 4), (4, 1, 32, 4)])
def test_frag_ragged(N: int, k: int, block_n: int, warps: int) -> None:
    """E 8, every token on expert 5: N = 1, k 2 (one slot per program, WK 4) and N = 4, k 1 (a
    tile of 4 rows at the plan's BLOCK_M 8, WK 2); d = 64 (half a K step: 4 warps split it, 3
    idle), I = 96 (a masked K tail in the down launch and a row tail in gate/up at BLOCK_N 32).
    Against the reference (fp32 and bf16 x), the atomic and the row epilogue, and within 2e-3 of
    the fma loop (the same products and h rounding; only the fp32 summation order differs)."""
    wts = make_weights(8, 64, 96, "fp4", seed=23)
    idx, rw = make_routing(N, 8, k, seed=23, hot=5)
    x = randn(N, 64, seed=N).to(torch.bfloat16)
    rows = check(x, wts, idx, rw, 10.0, "fp4", variant="frag", block_n=block_n,
                 num_warps=warps, deterministic=True)
    added = check(x, wts, idx, rw, 10.0, "fp4", variant="frag", block_n=block_n,
                  num_warps=warps)
    fma = triton_routed_experts_quant(
        x, *wts[:2], *wts[2:], idx, rw, 10.0, "fp4", variant="fma")  # type: ignore[arg-type]
    for out in (rows, added):
        assert ((out - fma).abs().max() / fma.abs().max()).item() <= 2e-3


def test_frag_tiles() -> None:
    """BLOCK_M 8 and 16 (the tile map; each MMA's 8 columns are up to 8 rows of one expert, two
    MMAs per A fragment at 16): E 4, k 1, 9 tokens all on expert 1 (9 rows: at 8 a full tile and
    one of 1; at 16 one tile whose second column set holds 1 row; several experts per tiled
    launch: test_moe_quant.py's test_parity[fp4-E2-d64-I64-N9], test_deterministic_epilogue);
    d = I = 64 (half a K step). Against the reference, and the rows' bits equal to BLOCK_M 1's
    (the same MMAs in the same order: a column's sum never sees the others)."""
    wts = make_weights(4, 64, 64, "fp4", seed=29)
    idx, rw = make_routing(9, 4, 1, seed=29, hot=1)
    x = randn(9, 64, seed=9).to(torch.bfloat16)
    kw = {"variant": "frag", "block_n": 64, "num_warps": 8}   # one row block: few programs
    slots = triton_routed_experts_quant(
        x, *wts[:2], *wts[2:], idx, rw, 10.0, "fp4",  # type: ignore[arg-type]
        block_m=1, deterministic=True, **kw)
    for block_m in (8, 16):
        tiles = check(x, wts, idx, rw, 10.0, "fp4", block_m=block_m, deterministic=True, **kw)
        assert torch.equal(tiles, slots)
    # the weights' loads skipping L1 change no value (on the GPU: test_flash_frag)
    streamed = triton_routed_experts_quant(
        x, *wts[:2], *wts[2:], idx, rw, 10.0, "fp4",  # type: ignore[arg-type]
        block_m=16, deterministic=True, stream_weights=True, **kw)
    assert torch.equal(streamed, slots)


def test_frag_launches() -> None:
    """A row's bits do not depend on the launch: WK 2 warps (two virtual K splits each) and WK 4
    (one each) give the same output bit for bit (4 warps across N: few interpreted programs; one
    slot, k 1). d = 384: 3 K steps, so split 3 has none; I = 160: the down launch's second step
    holds one group, and gate/up's last row block is partial."""
    wts = make_weights(8, 384, 160, "fp4", seed=31)
    idx, rw = make_routing(1, 8, 1, seed=31)
    x = randn(1, 384, seed=31).to(torch.bfloat16)
    outs = [check(x, wts, idx, rw, 10.0, "fp4", variant="frag", block_n=bn, num_warps=w,
                  deterministic=True) for bn, w in ((64, 8), (64, 16))]
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@pytest.mark.parametrize("N", [1, 9])
def test_frag_fp8(N: int) -> None:
    """e4m3 experts in the frag loop (the codes decoded into the MMA's A fragments as in
    `fp8_frag.py`, h stored in plain order): E 8, tokens on expert 3 (N = 1: k 2, two experts;
    N = 9: k 1, at BLOCK_M 8 a full tile and one of 1); d = 384 (3 K steps: the 4th split
    empty), I = 96 (the down step's last lane group past K: zeroed; and partial 128-row scale
    blocks). Against the reference; BLOCK_M 1 and 8 give the same bits (WK 2 x WN 8 warps: one
    gate/up row block with a row tail, 3 down ones), and so do WK 4 warps (on the CPU at N = 1
    only: the interpreter is slow on that launch at N = 9). d or I not a multiple of 32 is
    refused; the plan's default for FP8 with bf16 x is frag in its one-slot regime (mean rows
    per expert below 1/2), "scaled" from there."""
    wts = make_weights(8, 384, 96, "fp8", seed=41)
    idx, rw = make_routing(N, 8, 2 if N == 1 else 1, seed=41, hot=3)
    x = randn(N, 384, seed=41).to(torch.bfloat16)
    kw = {"variant": "frag", "deterministic": True}
    first = check(x, wts, idx, rw, 10.0, "fp8", block_m=1, block_n=128, num_warps=16, **kw)
    # the 4-warp-WK launch at every N on the GPU, at N = 1 only under the interpreter
    wk4 = (({"block_m": 1, "block_n": 64, "num_warps": 16},)
           if N == 1 or torch.cuda.is_available() else ())
    for knobs in ({"block_m": 8, "block_n": 128, "num_warps": 16}, *wk4):
        assert torch.equal(check(x, wts, idx, rw, 10.0, "fp8", **knobs, **kw), first), knobs
    cpu = torch.device("cpu")
    for nk, name in ((6, "frag"), (127, "frag"), (128, "scaled")):
        plan = plan_moe("fp8", None, torch.bfloat16, cpu, nk, 256, 2048, 4096)
        assert plan.variant == VARIANTS[name] and (name != "frag" or plan.block_m == 1), nk
    assert plan_moe("fp8", None, torch.float32, cpu, 6, 256, 2048, 4096).variant != \
        VARIANTS["frag"]
    odd = make_weights(8, 384, 80, "fp8", seed=41)
    with pytest.raises(ValueError, match="multiples of 32"):
        triton_routed_experts_quant(x, *odd, idx, rw, 10.0, "fp8",  # type: ignore[arg-type]
                                    **kw)


def test_frag_plan() -> None:
    """The plan: frag (fp4, bf16 x), one slot per program, gate/up 4 warps, down 2 (knobs pin
    both); (WK, WN) from block_n and num_warps (WK 2 or 4); other knobs refused."""
    cpu = torch.device("cpu")
    p = plan_moe("fp4", "frag", torch.bfloat16, cpu, 6, 256, 2048, 4096)
    assert (p.variant, p.block_m, p.gate_up.block_n, p.gate_up.num_warps, p.down.block_n,
            p.down.num_warps) == (VARIANTS["frag"], 1, 16, 4, 16, 2)
    p = plan_moe("fp4", "frag", torch.bfloat16, cpu, 6, 256, 2048, 4096, block_n=32, num_warps=8)
    assert p.gate_up == p.down and (p.gate_up.block_n, p.gate_up.num_warps) == (32, 8)
    assert frag_warps(32, 8) == (4, 2) and frag_warps(16, 2) == (2, 1)
    assert not p.stream_weights
    assert plan_moe("fp4", "frag", torch.bfloat16, cpu, 6, 256, 2048, 4096,
                    stream_weights=True).stream_weights
    with pytest.raises(ValueError, match="stream_weights is a knob of variant 'frag'"):
        plan_moe("fp4", "words", torch.bfloat16, cpu, 6, 256, 2048, 4096, stream_weights=True)
    assert plan_moe("fp4", "frag", torch.bfloat16, cpu, 6, 256, 2048, 4096,
                    block_m=8).block_m == 8
    for kw in ({"block_n": 24}, {"block_n": 64, "num_warps": 2}, {"num_warps": 3},
               {"num_warps": 1}, {"num_warps": 8}, {"block_n": 128, "num_warps": 32},
               {"block_m": 4}, {"block_k": 256}, {"prefetch": True}):
        with pytest.raises(ValueError, match="frag"):
            plan_moe("fp4", "frag", torch.bfloat16, cpu, 6, 256, 2048,  # type: ignore[arg-type]
                     4096, **kw)
    for fmt, dtype in (("fp8", torch.float32), ("fp4", torch.float32)):
        with pytest.raises(ValueError, match="bf16 activations"):
            plan_moe(fmt, "frag", dtype, cpu, 6, 256, 2048, 4096)


@pytest.fixture(scope="module")
def flash_fp4() -> tuple[torch.Tensor, ...]:
    return make_weights(FLASH["E"], FLASH["d"], FLASH["inter"], "fp4")  # type: ignore[return-value]


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 8, 32])
def test_flash_frag(flash_fp4: tuple[torch.Tensor, ...], N: int) -> None:
    """V4-Flash experts on the GPU (the inline-PTX MMA), every launch shape the sweep uses, and the
    weights' loads skipping L1: against the reference, the same bits on every launch, and the
    deterministic rows of a token the same alone as in the batch."""
    idx, rw = make_routing(N, FLASH["E"], FLASH["k"], seed=N)
    x = randn(N, FLASH["d"]).to(torch.bfloat16)
    first = None
    for block_n, warps in ((16, 2), (16, 4), (32, 4), (32, 8), (64, 8), (64, 16)):
        kw = {"variant": "frag", "block_n": block_n, "num_warps": warps, "deterministic": True}
        out = check(x, flash_fp4, idx, rw, 10.0, "fp4", **kw)
        first = out if first is None else first
        assert torch.equal(out, first), (block_n, warps)
        alone = triton_routed_experts_quant(
            x[:1], *flash_fp4, idx[:1], rw[:1], 10.0, "fp4", **kw)  # type: ignore[arg-type]
        assert torch.equal(alone[0], out[0])
    streamed = check(x, flash_fp4, idx, rw, 10.0, "fp4", variant="frag", deterministic=True,
                     stream_weights=True)
    assert torch.equal(streamed, first)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [8, 32, 128, 512])
def test_flash_frag_tiles(flash_fp4: tuple[torch.Tensor, ...], N: int) -> None:
    """BLOCK_M 8 and 16 on the GPU: against the reference, and the same bits as BLOCK_M 1 (the
    inline MMA's columns are independent)."""
    idx, rw = make_routing(N, FLASH["E"], FLASH["k"], seed=N + 1)
    x = randn(N, FLASH["d"]).to(torch.bfloat16)
    kw = {"variant": "frag", "deterministic": True}
    slots = triton_routed_experts_quant(
        x, *flash_fp4, idx, rw, 10.0, "fp4", block_m=1, **kw)  # type: ignore[arg-type]
    for block_m in (8, 16):
        assert torch.equal(check(x, flash_fp4, idx, rw, 10.0, "fp4", block_m=block_m, **kw),
                           slots)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 8, 32])
def test_flash_frag_fp8(N: int) -> None:
    """V4-Flash e4m3 experts in the frag loop on the GPU: against the reference; the plan's
    launches, the other WK and BLOCK_M 8 give the same bits."""
    wts = make_weights(FLASH["E"], FLASH["d"], FLASH["inter"], "fp8")
    idx, rw = make_routing(N, FLASH["E"], FLASH["k"], seed=N + 2)
    x = randn(N, FLASH["d"]).to(torch.bfloat16)
    kw = {"variant": "frag", "deterministic": True}
    first = check(x, wts, idx, rw, 10.0, "fp8", block_m=1, **kw)
    for knobs in ({"block_m": 1, "block_n": 16, "num_warps": 2}, {"block_m": 8}):
        out = triton_routed_experts_quant(x, *wts, idx, rw, 10.0, "fp8",  # type: ignore[arg-type]
                                          **knobs, **kw)
        assert torch.equal(out, first), knobs
