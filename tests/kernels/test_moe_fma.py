"""The routed experts' "fma" inner loop (`kernels/triton/moe_fma.py`, no tl.dot) against the
reference and the MMA loops; helpers from test_moe_quant.py (whose GPU Flash parity rows also
run fma).

CPU (interpreter): FP4 / FP8, BLOCK_M 1, 2, 4 with one expert holding every token, a masked K
tail, fp32 activations (no rounding: fp32-exact), rows independent of the batch and of BLOCK_M.

    PYTHONPATH=src python -m pytest -q tests/kernels/test_moe_fma.py
"""

from __future__ import annotations

import os

import torch

# NOTE: must precede the first `import triton` (tests/kernels/conftest.py may already do this).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from test_moe_quant import check, make_routing, make_weights, randn, reference  # noqa: E402

from dsv4.kernels.triton.moe import triton_routed_experts_quant  # noqa: E402
from dsv4.kernels.triton.moe_fma import act_shift, chunk, fma_activations  # noqa: E402


@pytest.mark.parametrize("fmt,block_k", [(2, 256), (2, 64), (1, 128), (1, 32)])
def test_fma_activations_order(fmt: int, block_k: int) -> None:
    """The activations' copy: within each BLOCK_K block, k = CHUNK c + P j + q (P = CHUNK / 4)
    sits at 4C q + 4c + j, times 2^act_shift; d = 320 is not whole blocks at BLOCK_K 256 / 128, so
    the last block is zero-padded."""
    step, d = chunk(fmt), 320
    x = torch.arange(2 * d, dtype=torch.float32).view(2, d) + 1
    out = fma_activations(x, fmt, block_k)
    blocks, C, P = -(-d // block_k), block_k // step, step // 4
    assert out.shape == (2, blocks * block_k)
    want = torch.zeros_like(out)
    for k in range(d):
        b, r = divmod(k, block_k)
        c, j, q = r // step, (r % step) // P, r % P
        want[:, b * block_k + 4 * C * q + 4 * c + j] = x[:, k] * 2.0 ** act_shift(fmt)
    assert torch.equal(out, want)


@pytest.mark.parametrize("N,k,block_m", [(1, 2, 1), (3, 1, 2), (6, 1, 4)])
@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_fma_ragged(fmt: str, N: int, k: int, block_m: int) -> None:
    """The "fma" loop (no tl.dot): E 8, every token on expert 5 (N = 1: k 2, one slot per
    program; then k 1: one expert holds N rows, two tiles at BLOCK_M < N, the last one partial;
    most experts idle), I = 96 (a masked K tail in the down launch, BLOCK_K 256 / 128 > K),
    BLOCK_N 16. Against the reference (fp32 and bf16 x), and within 2e-3 of the "scaled" MMA
    loop (the same h rounding, only the fp32 summation order differs)."""
    wts = make_weights(8, 128, 96, fmt, seed=23)
    idx, rw = make_routing(N, 8, k, seed=23, hot=5)
    x = randn(N, 128, seed=N).to(torch.bfloat16)
    out = check(x, wts, idx, rw, 10.0, fmt, variant="fma", block_m=block_m, block_n=16)
    mma = triton_routed_experts_quant(x, *wts, idx, rw, 10.0, fmt,
                                      variant="scaled")
    assert ((out - mma).abs().max() / mma.abs().max()).item() <= 2e-3


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_fma_fp32_x_exact(fmt: str) -> None:
    """fp32 activations: no bf16 rounding anywhere (h stays fp32), so the fma loop equals the
    fp32 reference up to fp32 summation order; also with BLOCK_K 32 / 16 (one chunk a step).
    BLOCK_N 64: one gate/up row block."""
    wts = make_weights(6, 128, 64, fmt, seed=29)
    idx, rw = make_routing(2, 6, 2, seed=29)
    x = randn(2, 128, seed=29) * 3
    ref = reference(x, wts, idx, rw, 10.0, fmt)
    for bk in (None, 32 if fmt == "fp4" else 16):
        out = triton_routed_experts_quant(x, *wts, idx, rw, 10.0, fmt,
                                          variant="fma", block_n=64, block_k=bk)
        assert ((out - ref).abs().max() / ref.abs().max()).item() <= 2e-6


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_fma_prefetch_same_bits(fmt: str) -> None:
    """The register prefetch (each K step issues the next step's loads before it decodes its
    own) changes when words are loaded, never the sums: bit-equal to the plain loop at BLOCK_M 1
    and 4, over a one-step masked loop (the plan's BLOCK_K > K: BLOCK_K None), several whole
    steps (EVEN_K: the last prefetch is clamped to the last step; BLOCK_K 64's gate/up launch,
    d 128 in 2 steps) and several steps with a masked tail (the prefetch past K reads nothing;
    BLOCK_K 64's down launch, I 96 in 2 steps). 3 tokens, k 1, all on expert 1 (a partial 4-row
    tile); BLOCK_N 128: one row block per launch (the prefetch does not depend on it)."""
    wts = make_weights(8, 128, 96, fmt, seed=37)
    idx, rw = make_routing(3, 8, 1, seed=37, hot=1)
    x = randn(3, 128, seed=37).to(torch.bfloat16)
    for bk in (None, 64):
        for bm in (1, 4):
            plain, pre = (triton_routed_experts_quant(x, *wts, idx, rw, 10.0, fmt, variant="fma",
                                                      block_m=bm, block_n=128, block_k=bk,
                                                      prefetch=pf, deterministic=True)
                          for pf in (False, True))
            assert torch.equal(plain, pre), (bk, bm)


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_fma_rows_independent(fmt: str) -> None:
    """A token's output bits do not depend on the batch around it nor on BLOCK_M (each row is
    computed alone in a fixed k order): tokens 0, 3, 5 alone equal their rows of a batch of 6 at
    BLOCK_M 1 and 4 (E 4, k 2: experts shared; token 0 sits at row 0 of 4-row tiles, tokens 3
    and 5 at rows 1-3), BLOCK_N 64 (one row block per launch)."""
    wts = make_weights(4, 64, 64, fmt, seed=31)
    idx, rw = make_routing(6, 4, 2, seed=31)
    x = randn(6, 64, seed=31).to(torch.bfloat16)

    def run(t: slice, bm: int) -> torch.Tensor:
        return triton_routed_experts_quant(x[t], *wts, idx[t], rw[t],
                                           10.0, fmt, variant="fma", block_m=bm, block_n=64,
                                           deterministic=True)

    batch = [run(slice(0, 6), bm) for bm in (1, 4)]
    for t in (0, 3, 5):
        alone = run(slice(t, t + 1), 1)[0]
        assert all(torch.equal(alone, b[t]) for b in batch)


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_fma_with_the_combine(fmt: str, deterministic: bool) -> None:
    """The fma plan goes through the op's combine like the MMA loops: `shared` added, `out_dtype`
    cast and `wait_shared` called once (the fma launches once returned before it). fp32 out: the
    plain result + shared exactly; bf16 out: its cast (bit-equal on a GPU; the interpreter's
    fp32 -> bf16 cast truncates, so there within one bf16 ulp). One token, k 2."""
    wts = make_weights(8, 64, 64, fmt, seed=31)
    idx, rw = make_routing(1, 8, 2, seed=31)
    x = randn(1, 64, seed=31).to(torch.bfloat16)
    sh = randn(1, 64, seed=32).to(torch.bfloat16)
    calls: list[int] = []

    def run(**kw: object) -> torch.Tensor:
        return triton_routed_experts_quant(x, *wts, idx, rw, 10.0, fmt,
                                           variant="fma", deterministic=deterministic, **kw)

    plain = run()
    assert torch.equal(run(shared=sh), plain + sh.float())
    got = run(shared=sh, out_dtype=torch.bfloat16, wait_shared=lambda: calls.append(1))
    assert got.dtype == torch.bfloat16 and calls == [1]
    want = (plain + sh.float()).to(torch.bfloat16)
    if x.is_cuda:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=0)
