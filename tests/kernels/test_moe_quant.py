"""Parity of `triton_routed_experts_quant` with the reference `routed_experts_quant` (spec §8, §12).

CPU: small shapes under the Triton interpreter: fp4 / fp8 / bf16 expert weights, every inner
loop (`variant`: split, scaled, dot_scaled, words, planes; fma in test_moe_fma.py, frag in
test_moe_frag.py and here as FP4's default plan) of the quantised formats, N = 1, 5, 9, 33, 40
tokens, k = 2, experts with no tokens, every token on one expert (several tiles), K tiles wider
than K (masked), I not a multiple of 128 (partial fp8 blocks), fp32 and bf16 activations, a clamp
that bites, the deterministic epilogue, the FP4 decodes at the edges of the scale range, the
launch plan, the device tile map, input validation.
GPU (`-m gpu`): V4-Flash shapes (E 256, d 4096, I 2048, k 6; N = 1, 8, 64, 512) per variant,
graph capture, rows independent of the batch, bit-reproducible deterministic path.

    PYTHONPATH=src python -m pytest -q tests/kernels/test_moe_quant.py          # interpreter on CPU
    PYTHONPATH=src python -m pytest -q tests/kernels/test_moe_quant.py -m gpu   # on a CUDA machine
"""

from __future__ import annotations

import os

import torch

# NOTE: must precede the first `import triton` (tests/kernels/conftest.py may already do this).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from dsv4.kernels.ref.moe import pack_w13, routed_experts, routed_experts_quant  # noqa: E402
from dsv4.kernels.triton.moe import (  # noqa: E402
    tile_map,
    triton_routed_experts,
    triton_routed_experts_quant,
    triton_routed_experts_quant_deterministic,
)
from dsv4.kernels.triton.moe_fp4 import fp4_tile, fp4_tile_words  # noqa: E402
from dsv4.kernels.triton.moe_plan import VARIANTS, plan_moe  # noqa: E402

REL = 1e-2          # max |diff| / max |ref| against the fp32-activation reference
# ... against the reference run in bf16 (its own roundings add ~6e-3, up to ~1.1e-2 seen)
REL_BF16_REF = 2e-2
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# w8a8 (FP8 activations): test_moe_w8a8.py; frag (FP4, bf16 x, one slot per program):
# test_moe_frag.py
WEIGHT_ONLY = [v for v in VARIANTS if v not in ("w8a8", "frag")]
Weights = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]


def _quantise(w: torch.Tensor, fmt: str,
              g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Random checkpoint-format codes for an [E, out, in] float weight (kept fast: no exact amax
    fitting)."""
    E, n_out, n_in = w.shape
    if fmt == "bf16":
        return w.to(torch.bfloat16), None
    if fmt == "fp4":      # random nibbles, per-32 scales ~ the weight's std / e2m1 rms (~3.2)
        packed = torch.randint(0, 256, (E, n_out, n_in // 2), generator=g, device=w.device,
                               dtype=torch.uint8)
        base = 127 - 2 - round(0.5 * torch.log2(torch.tensor(float(n_in))).item())
        codes = torch.randint(base - 1, base + 2, (E, n_out, n_in // 32), generator=g,
                              device=w.device)
        return packed, codes.to(torch.uint8).view(torch.float8_e8m0fnu)
    # fp8: per-block power-of-two scales, values in e4m3 range
    blocks = (E, -(-n_out // 128), -(-n_in // 128))
    codes = torch.randint(123, 127, blocks, generator=g, device=w.device)
    scale = torch.exp2(codes.float() - 127)
    full = scale.repeat_interleave(128, 1)[:, :n_out].repeat_interleave(128, 2)[:, :, :n_in]
    return ((w / full).clamp(-448, 448).to(torch.float8_e4m3fn),
            codes.to(torch.uint8).view(torch.float8_e8m0fnu))


def randn(*shape: int, seed: int = 7) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator(DEVICE).manual_seed(seed), device=DEVICE)


def make_weights(E: int, d: int, inter: int, fmt: str, seed: int = 0,
                 device: str = DEVICE) -> Weights:
    """(w13, w13_scale, w2, w2_scale) in `fmt`'s layout, w13 = pack_w13(w1, s1, w3, s3)."""
    g = torch.Generator(device).manual_seed(seed)
    w1, s1 = _quantise(torch.randn(E, inter, d, generator=g, device=device) * d ** -0.5, fmt, g)
    w3, s3 = _quantise(torch.randn(E, inter, d, generator=g, device=device) * d ** -0.5, fmt, g)
    w2, s2 = _quantise(torch.randn(E, d, inter, generator=g, device=device) * inter ** -0.5,
                       fmt, g)
    w13, s13 = pack_w13(w1, s1, w3, s3)
    return w13, s13, w2, s2


def make_routing(N: int, E: int, k: int, seed: int = 0, device: str = DEVICE,
                 hot: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct top-k experts per token (hot: expert every token uses), weights normalised like the
    gate."""
    g = torch.Generator(device).manual_seed(seed + 1)
    r = torch.rand(N, E, generator=g, device=device)
    if hot is not None:
        r[:, hot] = -1.0                                  # sorts first: every token picks it
    idx = r.argsort(dim=1)[:, :k]
    w = torch.rand(N, k, generator=g, device=device) + 0.1
    return idx.contiguous(), (w / w.sum(dim=1, keepdim=True) * 1.5).contiguous()


def reference(x: torch.Tensor, wts: Weights, idx: torch.Tensor, rw: torch.Tensor, limit: float,
              fmt: str) -> torch.Tensor:
    """`routed_experts_quant` restricted to the experts hit (same result; Flash-size tests stay
    cheap)."""
    hit = idx.unique()
    sub = [t[hit] if t is not None else None for t in wts]
    return routed_experts_quant(x, sub[0], sub[1], sub[2], sub[3],  # type: ignore[arg-type]
                                torch.searchsorted(hit, idx), rw, limit, fmt)


def check(x: torch.Tensor, wts: Weights, idx: torch.Tensor, rw: torch.Tensor, limit: float,
          fmt: str, **kw: object) -> torch.Tensor:
    """Against the reference on fp32 x (exact products of the same codes): only the kernel's bf16 h
    rounding differs, ~4e-3. Against the reference in x's dtype (it also rounds gate, up and y to
    bf16): REL_BF16_REF."""
    out = triton_routed_experts_quant(
        x, *wts[:2], *wts[2:], idx, rw, limit, fmt, **kw)  # type: ignore[arg-type]
    for ref, rel in ((reference(x.float(), wts, idx, rw, limit, fmt), REL),
                     (reference(x, wts, idx, rw, limit, fmt), REL_BF16_REF)):
        assert out.dtype == torch.float32 and out.shape == ref.shape
        err = ((out - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item()
        assert err <= rel, f"max |diff| / max |ref| = {err:.3e} > {rel:.0e}"
    return out


CASES = [  # (E, d, I, N)
    (4, 64, 64, 1),
    (6, 128, 96, 5),
    (8, 128, 128, 33),
]
# FP4 with bf16 x defaults to "frag": its BLOCK_M 8 plan (CASES' N 1 and 5; launches (32, 4))
# runs in test_deterministic_epilogue (the default plan, k 2, both epilogues) and
# test_moe_frag.py::test_frag_ragged[4-1-32-4] (I = 96: a masked K tail); its BLOCK_M 16 plan
# (NT 2, atomic) here, 9 rows on each of 2 experts
PARITY = [pytest.param(fmt, E, d, inter, N, id=f"{fmt}-E{E}-d{d}-I{inter}-N{N}")
          for fmt in ("fp8", "bf16") for E, d, inter, N in CASES]
PARITY.append(pytest.param("fp4", 2, 64, 64, 9, id="fp4-E2-d64-I64-N9"))


@pytest.mark.parametrize("fmt,E,d,inter,N", PARITY)
def test_parity(fmt: str, E: int, d: int, inter: int, N: int) -> None:
    wts = make_weights(E, d, inter, fmt)
    idx, rw = make_routing(N, E, 2)
    x = randn(N, d).to(torch.bfloat16)
    check(x, wts, idx, rw, 10.0, fmt)


# FP8's split / words / planes run its scaled loop (`tile_dot` tells only dot_scaled apart);
# fma: test_moe_fma.py::test_fma_ragged runs both formats on these shapes (N 1, then one
# expert's rows in tiles of 4, the last partial)
RAGGED = ([("fp4", v) for v in WEIGHT_ONLY if v != "fma"]
          + [("fp8", "scaled"), ("fp8", "dot_scaled")])


@pytest.mark.parametrize("fmt,variant", RAGGED)
def test_variants_ragged(fmt: str, variant: str) -> None:
    """Every inner loop on bf16 x: N = 1 (E 8, k 2: six experts idle; K tiles wider than d = 128
    and I = 96, so masked) at BLOCK_N 16 (one warp), then 40 tokens (k 1) all on expert 3, its
    rows spanning three BLOCK_M 16 tiles, the last partial, at BLOCK_N 32."""
    wts = make_weights(8, 128, 96, fmt, seed=13)
    idx, rw = make_routing(1, 8, 2, seed=13)
    check(randn(1, 128).to(torch.bfloat16), wts, idx, rw, 10.0, fmt, variant=variant,
          block_n=16)
    idx, rw = make_routing(40, 8, 1, seed=14, hot=3)
    check(randn(40, 128).to(torch.bfloat16), wts, idx, rw, 10.0, fmt, variant=variant,
          block_m=16, block_n=32)


# fma: test_moe_fma.py::test_fma_fp32_x_exact runs it on fp32 x (FP4 and FP8)
@pytest.mark.parametrize("variant", ["split", "scaled", "words", "planes"])
def test_variants_fp32_x(variant: str) -> None:
    """fp32 activations run fp32 dots in every tl.dot loop but dot_scaled, which refuses them."""
    wts = make_weights(6, 128, 64, "fp4", seed=15)
    idx, rw = make_routing(5, 6, 2, seed=15)
    check(randn(5, 128) * 2, wts, idx, rw, 10.0, "fp4", variant=variant)
    with pytest.raises(ValueError, match="bf16 activations"):
        triton_routed_experts_quant(randn(5, 128), *wts[:2], *wts[2:], idx, rw,  # type: ignore[arg-type]
                                    10.0, "fp4", variant="dot_scaled")


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_planes_prefill_tiles(x_dtype: torch.dtype) -> None:
    """FP4 "planes" at a wgmma-sized BLOCK_M 64 with BLOCK_K 64 (so d = 128 is two permuted blocks
    and the gate/up epilogue stores h in the down launch's planes order across I = 64): 40 tokens,
    all on one expert, plus spread rows; a BLOCK_K that does not divide d and I is refused."""
    wts = make_weights(4, 128, 64, "fp4", seed=23)
    idx, rw = make_routing(40, 4, 2, seed=23, hot=1)
    check(randn(40, 128).to(x_dtype), wts, idx, rw, 10.0, "fp4", variant="planes", block_m=64,
          block_k=64)
    wts = make_weights(4, 128, 96, "fp4", seed=24)
    with pytest.raises(ValueError, match="must divide d"):
        triton_routed_experts_quant(randn(3, 128), *wts[:2], *wts[2:],  # type: ignore[arg-type]
                                    *make_routing(3, 4, 2, seed=24), 10.0, "fp4",
                                    variant="planes", block_k=64)


@triton.jit
def _fp4_tile_kernel(w_ptr, s_ptr, out_ptr, K, WORDS: tl.constexpr,  # type: ignore[no-untyped-def]
                     FP32: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rows = tl.arange(0, BN)
    if WORDS:
        w = fp4_tile_words(w_ptr, s_ptr, 0, rows, 0, K, rows < BN, 0, K // 2, 0, K // 32, FP32, BK)
    else:
        w = fp4_tile(w_ptr, s_ptr, 0, rows, 0, K, rows < BN, 0, K // 2, 0, K // 32, FP32, BK)
    tl.store(out_ptr + rows[None, :] * BK + tl.arange(0, BK)[:, None], w.to(tl.float32))


def _word_order(k: int) -> torch.Tensor:
    """The k held at each position of an `fp4_tile_words` tile: 4h + 2u + v at 4v + 2u + h."""
    q = torch.arange(k) % 8
    return torch.arange(k) - q + 4 * (q % 2) + 2 * ((q // 2) % 2) + q // 4


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("words", [False, True], ids=["tile", "words"])
@pytest.mark.parametrize("fp32", [True, pytest.param(False, marks=pytest.mark.gpu)],
                         ids=["fp32", "bf16"])
def test_fp4_tile_scale_codes(fp32: bool, words: bool) -> None:
    """The folded FP4 decodes (`fp4_tile`, `fp4_tile_words`: e2m1 bits as v * 2^-126, times
    2^(s - 1)) equal the reference dequantisation exactly for every nibble and scale codes 2..128;
    a code above 128 gives inf / NaN, never a wrong finite value. The bf16 multiply (the GPU's
    path, inline PTX for `fp4_tile_words`; the interpreter multiplies bf16 as integers) runs on a
    GPU only."""
    from dsv4.kernels.ref.quant import dequant_fp4_group

    g = torch.Generator(DEVICE).manual_seed(18)
    packed = torch.randint(0, 256, (16, 128), generator=g, device=DEVICE, dtype=torch.uint8)
    packed[0, :8] = torch.arange(0, 256, 32, dtype=torch.uint8)    # all 16 nibbles appear
    codes = torch.randint(2, 129, (16, 8), generator=g, device=DEVICE, dtype=torch.uint8)
    codes[0, :2] = torch.tensor([2, 128], dtype=torch.uint8)
    out = torch.empty(16, 256, device=DEVICE)
    order = _word_order(256).to(DEVICE) if words else torch.arange(256, device=DEVICE)

    def decode() -> torch.Tensor:
        _fp4_tile_kernel[(1,)](packed, codes, out, 256, WORDS=words, FP32=fp32, BN=16, BK=256)
        return torch.empty_like(out).index_copy_(1, order, out)

    ref = dequant_fp4_group(packed, codes.view(torch.float8_e8m0fnu), torch.float32)
    assert torch.equal(decode(), ref)
    codes[3, 5] = 130
    got = decode()
    assert not bool(torch.isfinite(got[3, 160:192]).any())
    assert torch.equal(got[4:], ref[4:])


def test_plan() -> None:
    """V4-Flash shapes: BLOCK_N 32 at N = 1 (the 64-wide grid would be 1.5 waves), 64 from N = 8;
    BLOCK_K 128 bytes of a row; BLOCK_N 16 takes one warp; bad knobs raise."""
    cpu = torch.device("cpu")
    p1 = plan_moe("fp4", "words", torch.bfloat16, cpu, 6, 256, 2048, 4096)
    p8 = plan_moe("fp4", "words", torch.bfloat16, cpu, 48, 256, 2048, 4096)
    assert (p1.gate_up.block_n, p1.down.block_n, p8.gate_up.block_n, p8.down.block_n) == \
        (32, 32, 64, 64)
    assert (p1.variant, p1.block_m, p1.block_k, p1.gate_up.num_warps) == \
        (VARIANTS["words"], 16, 256, 4)
    # decode: FP4 "frag" for bf16 x (nk <= 16 E), "fma" for fp32 x or fma knobs (nk <= E), the
    # same fma launches at every N; past them (or frag_rows = fma_rows = 0) the MMA; FP8 takes
    # "frag" below half a row per expert and "scaled" from there (its fma loop is slower)
    assert plan_moe("fp8", None, torch.bfloat16, cpu, 6, 256, 2048, 4096).variant == \
        VARIANTS["frag"]
    assert plan_moe("fp8", None, torch.bfloat16, cpu, 192, 256, 2048, 4096).variant == \
        VARIANTS["scaled"]
    for dtype, name in ((torch.bfloat16, "frag"), (torch.float32, "fma")):
        plans = [plan_moe("fp4", None, dtype, cpu, nk, 256, 2048, 4096) for nk in (6, 96)]
        assert (plans[0].variant, plans[0].block_m) == (plans[1].variant, plans[1].block_m) \
            == (VARIANTS[name], 1)
    assert plans[0] == plans[1]
    # frag: one slot per program below 1/2 row per expert (gate/up K over 4 warps while the grid
    # is short of warps), tiles of 8 rows from there, of 16 from 8, up to 16 rows per expert; the
    # launches per BLOCK_M (they never change a row's bits)
    for nk, bm, gate_up, down in ((6, 1, (16, 4), (16, 2)), (12, 1, (16, 4), (16, 2)),
                                  (24, 1, (16, 2), (16, 2)), (96, 1, (16, 2), (16, 2)),
                                  (128, 8, (32, 4), (32, 4)), (2047, 8, (32, 4), (32, 4)),
                                  (2048, 16, (64, 8), (32, 4)), (4096, 16, (64, 8), (32, 4))):
        p = plan_moe("fp4", None, torch.bfloat16, cpu, nk, 256, 2048, 4096)
        assert (p.variant, p.block_m) == (VARIANTS["frag"], bm), nk
        assert ((p.gate_up.block_n, p.gate_up.num_warps), (p.down.block_n, p.down.num_warps)) \
            == (gate_up, down), nk
    assert plan_moe("fp4", None, torch.bfloat16, cpu, 4097, 256, 2048, 4096).variant == \
        plan_moe("fp4", None, torch.float32, cpu, 257, 256, 2048, 4096).variant == \
        VARIANTS["words"]
    assert plan_moe("fp4", None, torch.bfloat16, cpu, 6, 256, 2048, 4096,
                    prefetch=True).variant == VARIANTS["fma"]
    assert plan_moe("fp4", None, torch.bfloat16, cpu, 6, 256, 2048, 4096, fma_rows=0,
                    frag_rows=0).variant == VARIANTS["words"]
    with pytest.raises(ValueError, match="'fma' needs"):
        plan_moe("fp8", "fma", torch.bfloat16, cpu, 6, 8, 64, 64, block_k=256)
    assert plan_moe("fp4", "fma", torch.bfloat16, cpu, 6, 8, 64, 64, prefetch=True).prefetch
    with pytest.raises(ValueError, match="prefetch is a knob of variant 'fma'"):
        plan_moe("fp4", "words", torch.bfloat16, cpu, 6, 8, 64, 64, prefetch=True)
    with pytest.raises(ValueError, match="multiples of 16"):
        plan_moe("fp8", "fma", torch.bfloat16, cpu, 6, 8, 72, 64)
    assert plan_moe("fp8", None, torch.bfloat16, cpu, 6, 8, 72, 64).variant == VARIANTS["scaled"]
    assert plan_moe("fp8", None, torch.bfloat16, cpu, 6, 256, 2048, 4096).block_k == 128
    assert plan_moe("fp4", "split", torch.bfloat16, cpu, 6, 256, 2048, 4096).block_k == 64
    assert plan_moe("fp4", "scaled", torch.float32, cpu, 6, 256, 2048, 4096, block_n=16
                    ).down == plan_moe("fp8", None, torch.float32, cpu, 6, 256, 2048, 4096,
                                       block_n=16).down
    assert plan_moe("bf16", None, torch.bfloat16, cpu, 6, 8, 64, 64, block_n=16).down.num_warps == 1
    for kw in ({"variant": "nibble"}, {"block_k": 256}, {"block_n": 48}):
        with pytest.raises(ValueError):
            plan_moe("fp8", kw.get("variant"), torch.bfloat16, cpu, 6, 8, 64, 64,  # type: ignore[arg-type]
                     block_k=kw.get("block_k"), block_n=kw.get("block_n"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_k"):
        plan_moe("fp4", "scaled", torch.bfloat16, cpu, 6, 8, 64, 64, block_k=512)
    with pytest.raises(ValueError, match="block_m"):
        plan_moe("fp4", "words", torch.bfloat16, cpu, 6, 8, 64, 64, block_m=64)
    big = (12288, 256, 2048, 4096)                                     # N = 2048
    assert (plan_moe("fp4", None, torch.bfloat16, cpu, *big).block_m,
            plan_moe("fp4", None, torch.bfloat16, cpu, *big).block_k) == (32, 128)
    assert plan_moe("fp8", None, torch.bfloat16, cpu, *big).block_m == 64
    # N = 8192: the plan stays at BLOCK_M 64; 128-row tiles (wgmma, prefill) by knob, "planes"
    # included, and BLOCK_N up to 128
    huge = (49152, 256, 2048, 4096)
    assert plan_moe("bf16", None, torch.bfloat16, cpu, *huge).block_m == 64
    p = plan_moe("fp4", "planes", torch.bfloat16, cpu, *huge, block_m=128, block_n=128)
    assert (p.variant, p.block_m, p.block_k, p.down.block_n) == (VARIANTS["planes"], 128, 128, 128)
    assert plan_moe("fp4", "planes", torch.bfloat16, cpu, 6, 8, 96, 128).block_k == 32
    # FP4 dot_scaled stays at BLOCK_N 32 (its wgmma form at 64 is wrong on sm_90)
    assert plan_moe("fp4", "dot_scaled", torch.bfloat16, cpu, 48, 256, 2048, 4096
                    ).gate_up.block_n == 32
    with pytest.raises(ValueError, match="needs block_n <= 32"):
        plan_moe("fp4", "dot_scaled", torch.bfloat16, cpu, 6, 8, 64, 64, block_n=64)


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_one_hot_expert_fp32_x_tight_clamp(fmt: str) -> None:
    """All 33 tokens on expert 2 (one expert's rows span several tiles), most experts idle, fp32 x,
    limit 0.5."""
    wts = make_weights(8, 64, 64, fmt, seed=3)
    idx, rw = make_routing(33, 8, 2, seed=3, hot=2)
    assert bool((idx == 2).any(dim=1).all())
    check(randn(33, 64) * 4, wts, idx, rw, 0.5, fmt, block_m=16)


def test_deterministic_epilogue() -> None:
    """The deterministic epilogue (default plan: FP4 frag in tiles of 8 rows; E 2, k 2: each
    token on both experts; d = I = 32: one row block per launch) against the reference and the
    atomic one, and the backend's deterministic op gives the same bits again."""
    wts = make_weights(2, 32, 32, "fp4", seed=17)
    idx, rw = make_routing(3, 2, 2, seed=17)
    x = randn(3, 32).to(torch.bfloat16)
    a = check(x, wts, idx, rw, 10.0, "fp4", deterministic=True)
    assert torch.equal(a, triton_routed_experts_quant_deterministic(
        x, *wts[:2], *wts[2:], idx, rw, 10.0, "fp4"))  # type: ignore[arg-type]
    b = triton_routed_experts_quant(
        x, *wts[:2], *wts[2:], idx, rw, 10.0, "fp4")  # type: ignore[arg-type]
    assert (a - b).abs().max().item() <= 1e-5 * a.abs().max().item()


@pytest.mark.parametrize("block_k", [32, 128])
def test_fp4_block_k(block_k: int) -> None:
    """The nibble-split FP4 step at its smallest tile (two dots of K = 16) and its largest (K = 64
    each, so the I = 96 down projection ends in a masked half tile)."""
    wts = make_weights(6, 128, 96, "fp4", seed=7)
    idx, rw = make_routing(5, 6, 2, seed=7)
    check(randn(5, 128), wts, idx, rw, 10.0, "fp4", block_k=block_k)
    with pytest.raises(ValueError, match="block_k >= 32"):
        triton_routed_experts_quant(
            randn(5, 128), *wts[:2], *wts[2:], idx, rw, 10.0, "fp4",  # type: ignore[arg-type]
            block_k=16)


@pytest.mark.parametrize("N,E,k,bm",
                         [(1, 8, 2, 16), (33, 8, 2, 16), (50, 4, 3, 16), (7, 256, 6, 16),
                          (9, 8, 2, 1)])
def test_tile_map_covers_rows_once(N: int, E: int, k: int, bm: int) -> None:
    idx, _ = make_routing(N, E, k, seed=N)
    order, start, end, expert = tile_map(idx, E, bm)
    sorted_e = idx.reshape(-1)[order]
    covered = torch.zeros(N * k, dtype=torch.int64, device=idx.device)
    for s, t, e in zip(start.tolist(), end.tolist(), expert.tolist(), strict=True):
        assert 0 <= t - s <= bm
        covered[s:t] += 1
        assert bool((sorted_e[s:t] == e).all())
    assert bool((covered == 1).all())


def test_empty_and_validation() -> None:
    wts = make_weights(4, 64, 64, "fp4")
    x = torch.randn(0, 64, device=DEVICE)
    idx, rw = torch.zeros(0, 2, dtype=torch.int64, device=DEVICE), torch.zeros(0, 2, device=DEVICE)
    assert triton_routed_experts_quant(
        x, *wts[:2], *wts[2:], idx, rw, 10.0, "fp4").shape == (0, 64)  # type: ignore[arg-type]
    idx, rw = make_routing(2, 4, 2)
    x = randn(2, 64)
    with pytest.raises(ValueError, match="fmt"):
        triton_routed_experts_quant(
            x, *wts[:2], *wts[2:], idx, rw, 10.0, "int4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="do not fit"):
        triton_routed_experts_quant(
            x, *wts[:2], *wts[2:], idx, rw, 10.0, "fp8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="scales"):
        triton_routed_experts_quant(x, wts[0], None, wts[2], None, idx, rw, 10.0, "fp4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_op_plain_experts(dtype: torch.dtype) -> None:
    """`triton_routed_experts` (the triton backend's op) on the model's own [E, I, d] w1 / w3
    parameters (no w13 copy) equals `ref.moe.routed_experts`; fp32: tight, bf16: the kernel keeps
    gate / up / y in fp32 (one h rounding) where the reference rounds each linear, and it is
    bit-reproducible run to run."""
    g = torch.Generator(DEVICE).manual_seed(11)
    E, d, inter, N = 6, 64, 96, 19
    w1, w3 = (torch.randn(E, inter, d, generator=g, device=DEVICE) * d ** -0.5
              for _ in range(2))
    w2 = torch.randn(E, d, inter, generator=g, device=DEVICE) * inter ** -0.5
    w1, w2, w3 = w1.to(dtype), w2.to(dtype), w3.to(dtype)
    idx, rw = make_routing(N, E, 2, seed=11)
    x = (randn(N, d) * 3).to(dtype)
    out = triton_routed_experts(x, w1, w2, w3, idx, rw, 1.5)
    ref = routed_experts(x.float(), w1.float(), w2.float(), w3.float(), idx, rw, 1.5)
    rel = 1e-5 if dtype == torch.float32 else REL
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= rel
    assert torch.equal(out, triton_routed_experts(x, w1, w2, w3, idx, rw, 1.5))
    with pytest.raises(ValueError, match="twins"):
        triton_routed_experts(x, w1, w2, w3[:, :-1], idx, rw, 1.5)


# ---- GPU: V4-Flash shapes ------------------------------------------------------------------------

FLASH = {"E": 256, "d": 4096, "inter": 2048, "k": 6}


@pytest.fixture(scope="module")
def flash_weights() -> dict[str, Weights]:
    return {fmt: make_weights(FLASH["E"], FLASH["d"], FLASH["inter"], fmt)
            for fmt in ("fp4", "fp8", "bf16")}


# FP8's split / words are its scaled loop; bf16 has one loop
FLASH_CASES = ([("fp4", v) for v in WEIGHT_ONLY + ["frag"]]
               + [("fp8", "scaled"), ("fp8", "dot_scaled"), ("fp8", "fma")] + [("bf16", None)])


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 8, 64, 512])
@pytest.mark.parametrize("fmt,variant", FLASH_CASES)
def test_flash_parity(flash_weights: dict[str, Weights], N: int, fmt: str,
                      variant: str | None) -> None:
    idx, rw = make_routing(N, FLASH["E"], FLASH["k"], seed=N)
    x = randn(N, FLASH["d"]).to(torch.bfloat16)
    check(x, flash_weights[fmt], idx, rw, 10.0, fmt, variant=variant)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,variant,block_m,block_n,warps",
                         [("fp4", "planes", 128, 64, 8), ("fp4", "planes", 64, 128, 4),
                          ("fp8", None, 128, 64, 8), ("bf16", None, 128, 64, 8)])
def test_flash_parity_prefill_tiles(flash_weights: dict[str, Weights], fmt: str,
                                    variant: str | None, block_m: int, block_n: int,
                                    warps: int) -> None:
    """N = 2048 (~48 rows per expert) on the wgmma tiles of `--prefill-sweep`."""
    idx, rw = make_routing(2048, FLASH["E"], FLASH["k"], seed=25)
    x = randn(2048, FLASH["d"]).to(torch.bfloat16)
    check(x, flash_weights[fmt], idx, rw, 10.0, fmt, variant=variant, block_m=block_m,
          block_n=block_n, num_warps=warps)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp4", "fp8", "bf16"])
def test_flash_rows_batch_invariant(flash_weights: dict[str, Weights], fmt: str) -> None:
    """The default (deterministic) op gives a token the same bits alone (N = 1: BLOCK_N 32) as in
    a batch of 8 (BLOCK_N 64), and the same bits run to run."""
    wts = flash_weights[fmt]
    idx, rw = make_routing(8, FLASH["E"], FLASH["k"], seed=21)
    x = randn(8, FLASH["d"]).to(torch.bfloat16)
    batch = triton_routed_experts_quant_deterministic(x, *wts[:2], *wts[2:], idx, rw,  # type: ignore[arg-type]
                                                       10.0, fmt)
    alone = triton_routed_experts_quant_deterministic(x[:1], *wts[:2], *wts[2:], idx[:1],  # type: ignore[arg-type]
                                                       rw[:1], 10.0, fmt)
    assert torch.equal(alone[0], batch[0])
    assert torch.equal(batch, triton_routed_experts_quant_deterministic(
        x, *wts[:2], *wts[2:], idx, rw, 10.0, fmt))  # type: ignore[arg-type]


@pytest.mark.gpu
def test_flash_graph_capture(flash_weights: dict[str, Weights]) -> None:
    wts = flash_weights["fp4"]
    idx, rw = make_routing(8, FLASH["E"], FLASH["k"])
    x = randn(8, FLASH["d"]).to(torch.bfloat16)
    eager = triton_routed_experts_quant(
        x, *wts[:2], *wts[2:], idx, rw, 10.0, "fp4", deterministic=True)  # type: ignore[arg-type]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_routed_experts_quant(
            x, *wts[:2], *wts[2:], idx, rw, 10.0, "fp4",  # type: ignore[arg-type]
            deterministic=True)
    idx.copy_(make_routing(8, FLASH["E"], FLASH["k"], seed=9)[0])
    graph.replay()
    want = triton_routed_experts_quant(
        x, *wts[:2], *wts[2:], idx, rw, 10.0, "fp4", deterministic=True)  # type: ignore[arg-type]
    assert torch.equal(out, want) and not torch.equal(out, eager)
