"""Launch plan of the routed-expert kernels (kernels/triton/moe.py): inner loop and tile sizes.

`plan_moe` turns the shapes of one call (and any knobs the caller pins) into a `MoePlan`. Every
choice comes from shapes alone (no host sync).

Inner loop (`VARIANTS`; `moe_decode.py` has the details): "split" (the first FP4 loop: two K = 16
dots per 32-wide scale group), "scaled" (the whole tile decoded to bf16 element by element, scales
folded in, one dot), "dot_scaled" (`tl.dot_scaled`: Triton's own e2m1 / e4m3 upcast) and "words"
(FP4 decoded 8 nibbles per 32-bit word, the pairs scaled by one bf16x2 multiply, k permuted within
each 8 in both operands). FP8's "split", "scaled" and "words" are one loop; bf16 weights have one
loop (the variant changes nothing). Default: `DEFAULT_VARIANT[fmt]`, the fewest instructions per
weight byte in the K loop of the sm_90 SASS (`benchmarks/aot_compile_sm90.py`, V4-Flash gate/up,
BLOCK_N 64: FP4 "words" ~9, "scaled" ~15, "dot_scaled" ~18, "split" ~47; FP8 ~4; bf16 ~0.8).
"dot_scaled" feeds the activations to the MMA as bf16, so it refuses fp32 activations (a float32
model; the others run fp32 dots for them, exact).
"frag" (`moe_frag.py`: FP4 or e4m3 codes decoded into mma.sync register fragments) is FP4's
default for bf16 activations while the mean rows per expert is at most `frag_rows` (default
FRAG_MAX_MEAN_ROWS = 16: V4-Flash up to N = 682 at k 6), and FP8's below FRAG_FP8_MAX_MEAN_ROWS
= 1/2 (its one-slot programs: faster than "scaled" at V4-Flash N = 1 and 8 on the H200, slower in
tiles of 8 at N = 32; benchmarks/results/quant_moe_h200_202612.md), from shapes only: one slot
per program (BLOCK_M 1, no tile map) below FRAG_TILE_MEAN_ROWS = 1/2 row per expert, then tiles
of up to 8 rows of one expert sharing each MMA (its 8 columns), from FRAG_WIDE_MEAN_ROWS = 8 tiles
of 16 (two MMAs per decoded A fragment); all give a row the same bits, and so do the launches
(FRAG_LAUNCHES per BLOCK_M). "fma" (`moe_fma.py`: FP4 / FP8 on the CUDA cores, no tl.dot) is FP4's
default for fp32 / fp16 activations or the fma knobs (block_m 2 / 4, block_k, stages, prefetch)
while the mean rows per expert is at most `fma_rows` (default FMA_MAX_MEAN_ROWS = 1: nk <= E, where
a 16-row tl.dot tile would hold ~1 real row). On the H200 at V4-Flash's experts FP4 frag is 1.1-1.2x
faster than fma at N = 1 and 8 and 2.3x faster than "words" at N = 128; fma is 2-3x faster than
"words" at N = 1 to 32, while FP8's fma ties "scaled", so FP8 keeps "scaled" past frag's regime
(benchmarks/results/quant_moe_h200_202612.md). The fma tiles are fixed (`_plan_fma`: BLOCK_M 1,
BLOCK_N 32, BLOCK_K 256 / 128 bytes of a row, 4 warps, 1 stage, no register prefetch), the same at
every N; `prefetch=True` issues each K step's next loads first (a knob: no faster there).
SASS K loop (V4-Flash, BLOCK_N 32, Triton 3.6): FP4 ~8 instructions per weight byte, FP8 ~3.4.

Tiles. BLOCK_K: one step reads 128 bytes of each weight row (full 128-byte lines): FP4 256 (64
for "split", its first setting; 128 at BLOCK_M 32), FP8 128 (also the most one 128-wide scale block
allows), bf16 64.
BLOCK_M = the mean rows per expert as a power of two in [16, 64] (decode: 16, the tl.dot minimum;
at most 32 for FP4 "scaled" / "words": `max_block_m`).
BLOCK_N: at decode the N*k rows land on ~N*k experts with one row each, so the grid
(tiles, out / BLOCK_N) is small: N = 1, k = 6, I = 2048 gives 6 x 32 = 192 gate/up programs at
BLOCK_N = 64 for 132 SMs (1.5 waves, few bytes in flight). Each launch (gate/up: out = I; down:
out = d) takes BLOCK_N = 64 if its grid reaches `PROGRAMS_PER_SM` programs per SM, else 32 (V4-
Flash N = 1: 384 gate/up and 768 down programs); 4 warps. Narrower tiles cost more than they
give: at BLOCK_M = 16 the MMA spreads a [16, BLOCK_N] tile over BLOCK_N / 8 warps and the others
decode the same weights again, so BLOCK_N = 16 needs 1 warp (a knob: `block_n=16` picks 1 warp
unless `num_warps` is given). No split-K: the gate/up epilogue's SwiGLU needs the whole sum and
the deterministic down path may not add partials with float atomics, so a split would cost a
second pass; BLOCK_N = 32 already gives 3-6 programs per SM at N = 1 on V4-Flash.

Prefill by decoded chunks (`moe_dequant.py`, not a loop of its own: the bf16 loop on bf16 copies
of `DEQUANT_CHUNK` experts at a time, decoded beside it): `dequant_chunk` picks it on CUDA for the
formats of `DEQUANT_MIN_MEAN_ROWS` from that many mean rows per expert, with no knob pinned and
no act_quant. On the H100 at V4-Flash's experts (benchmarks/results/quant_moe_h200_202612.md) FP4
chunks of 32 ran 1.27-1.29x faster than the FP4 loop at N = 8192 (192 rows per expert) and
0.86-0.87x / 0.59x as fast at 4096 / 2048; FP8 was slower at all three (0.36-0.71x), so it keeps
its loop.

Bits. BLOCK_M and BLOCK_N only choose which program computes an output element, and FP4 "words" /
"scaled" and bf16 accumulate the k terms in the MMA in one fixed order at any BLOCK_K ("words":
ascending 8-groups, a fixed permutation within each; FP8 and split FP4 round each tile's scaled
product, so their BLOCK_K is fixed), so a token's row does not depend on the batch around it as
long as the MMA instruction stays the same. It changes where Triton moves a dot to wgmma: at
BLOCK_M 64 (bf16, FP8, large N, as before) and for FP4 "dot_scaled" already at BLOCK_N 64 (so
its rows can change between N = 1 and N = 8). FP4 "words" / "scaled" stay on mma.sync (BLOCK_M
<= 32) at every N.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch
import triton

VARIANTS = {"split": 0, "scaled": 1, "dot_scaled": 2, "words": 3, "fma": 4, "planes": 5,
            "w8a8": 6, "frag": 7}
DEFAULT_VARIANT = {"fp4": "words", "fp8": "scaled", "bf16": "scaled"}
FMA_MAX_MEAN_ROWS = 1.0      # default loop "fma" while nk <= this * num_experts (quantised fmts)
FMA_BLOCK_M = 1
FMA_BLOCK_N = 32
FMA_BLOCK_K = {"fp4": 256, "fp8": 128}
FMA_WARPS = 4
FMA_PREFETCH = False
FRAG_STEP = 128              # "frag": k per warp K step (a quad's 4 lanes x 32-k groups)
FRAG_ROWS = 16               # "frag": weight rows per warp (the m of m16n8k16)
FRAG_MAX_MEAN_ROWS = 16.0    # default loop "frag" (FP4, bf16 x) while nk <= this * num_experts
FRAG_TILE_MEAN_ROWS = 0.5    # ... with BLOCK_M 8 (a tile map) from nk >= this * E
FRAG_WIDE_MEAN_ROWS = 8.0    # ... and BLOCK_M 16 (two MMAs per A fragment) from this * E
FRAG_FP8_MAX_MEAN_ROWS = FRAG_TILE_MEAN_ROWS   # FP8 (bf16 x): "frag" below this * E (BLOCK_M 1)
FRAG_SPLITS = 4              # "frag": virtual K splits, summed in a fixed order (any WK)
# "frag": ((block_n, warps) of gate/up, of down) per BLOCK_M: block_n / 16 warps across the rows,
# WK = 2 or 4 warps across the K splits (a row's bits do not depend on them)
FRAG_LAUNCHES = {1: ((16, 2), (16, 2)), 8: ((32, 4), (32, 4)), 16: ((64, 8), (32, 4))}
FRAG_DEEP_WARPS = 32         # BLOCK_M 1: gate/up at FRAG_DEEP_GATE_UP while the launch of
DEQUANT_MIN_MEAN_ROWS = {"fp4": 160.0}  # decoded chunks from this * E rows (V4-Flash: N 6827)
DEQUANT_CHUNK = 32           # experts per decoded chunk (V4-Flash: 3.2 GB of bf16 scratch)
FRAG_DEEP_GATE_UP = (16, 4)  # ... FRAG_LAUNCHES[1] (WK 2) would fill < this many warps per SM
PROGRAMS_PER_SM = 4
DEFAULT_MAX_BLOCK_M = 64     # the plan's BLOCK_M cap; larger tiles (max_block_m) only by knob
_NUM_SMS_CPU = 132           # the H200's, for plans made without a GPU (interpreter, tests)
_MIN_DOT = 16
_FP8_BLOCK = 128
MIN_REGS, MAX_REGS = 64, 255     # "w8a8"'s max_regs knob
W8A8_DOWN_REGS = 128             # "w8a8": the register cap of its 8-warp BLOCK_M 64 down launch


@dataclass(frozen=True)
class Launch:
    """One launch's output tile width and warps."""

    block_n: int
    num_warps: int
    max_regs: int | None = None   # "w8a8": registers per thread the compiler may use (maxnreg)


@dataclass(frozen=True)
class MoePlan:
    """One call's launch parameters; `variant` is the VARIANTS code."""

    variant: int
    block_m: int
    block_k: int
    num_stages: int
    gate_up: Launch
    down: Launch
    prefetch: bool = False   # "fma": each K step issues the next step's weight loads first
    stream_weights: bool = False   # "frag": the weights' loads are not allocated in L1


def plan_moe(fmt: str, variant: str | None, x_dtype: torch.dtype, device: torch.device, nk: int,
             num_experts: int, inter: int, d: int, *, block_m: int | None = None,
             block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
             num_stages: int | None = None, prefetch: bool | None = None,
             fma_rows: float = FMA_MAX_MEAN_ROWS, frag_rows: float = FRAG_MAX_MEAN_ROWS,
             act_quant: bool = False, max_regs: int | None = None,
             stream_weights: bool | None = None) -> MoePlan:
    """The plan for nk = N*k rows over `num_experts` experts (gate/up out width `inter`, down `d`);
    a knob given (not None) is used as is, after validation. `frag_rows` / `fma_rows`: the mean
    rows per expert up to which FP4 defaults to "frag" (bf16 x) / "fma" (other x). `act_quant`:
    FP8 activations (the only loop: "w8a8").
    `max_regs` ("w8a8" only): a register cap per thread (two CTAs of 8 warps per SM at 128).
    `stream_weights` ("frag" only): the weights' loads skip L1 (each byte is read once; L1 keeps
    the activations). Off by default: it was faster only for FP4 one-slot programs (BLOCK_M 1) in
    the A/B of benchmarks/results/quant_moe_h200_202612.md, slower for FP8 and for tiles."""
    if act_quant or variant == "w8a8":
        return _plan_w8a8(fmt, variant, act_quant, nk, num_experts, block_m, block_n, block_k,
                          num_warps, num_stages, prefetch, max_regs)
    if max_regs is not None:
        raise ValueError(f"max_regs is a knob of variant 'w8a8'; got variant {variant!r}")
    name = _variant(fmt, variant, x_dtype)
    if stream_weights is not None and variant != "frag":
        raise ValueError(f"stream_weights is a knob of variant 'frag' (given explicitly); got "
                         f"variant {variant!r}")
    fits = fmt == "fp4" or (d % 16 == 0 and inter % 16 == 0)   # fma reads FP8 in 16-k chunks
    frag_knobs = block_m in (None, 1, 8, 16) and block_k is None and num_stages is None
    if (variant is None and fmt == "fp4" and x_dtype == torch.bfloat16 and frag_knobs
            and not prefetch and nk <= frag_rows * num_experts):
        name = "frag"
    elif (variant is None and fmt == "fp8" and x_dtype == torch.bfloat16 and frag_knobs
            and not prefetch and nk < FRAG_FP8_MAX_MEAN_ROWS * num_experts
            and d % 32 == 0 and inter % 32 == 0):
        name = "frag"
    elif (variant is None and fmt == "fp4" and nk <= fma_rows * num_experts
            and block_m in (None, 1, 2, 4) and fits):
        name = "fma"
    if name == "frag":
        if block_m is None:
            mean = nk / num_experts
            block_m = 16 if mean >= FRAG_WIDE_MEAN_ROWS else 8 if mean >= FRAG_TILE_MEAN_ROWS else 1
        # few slots: gate/up splits K over more warps, so the grid holds enough warps to stream
        bn, warps = FRAG_LAUNCHES[1][0]
        deep = block_m == 1 and nk * triton.cdiv(inter, bn) * warps < (
            FRAG_DEEP_WARPS * _num_sms(device))
        return _plan_frag(block_m, block_n, block_k, num_warps, num_stages, prefetch, deep,
                          bool(stream_weights))
    if name == "fma":
        if not fits:
            raise ValueError(f"fp8 variant 'fma' needs d and I multiples of 16; got {d}, {inter}")
        return _plan_fma(fmt, block_m, block_n, block_k, num_warps, num_stages, prefetch)
    if prefetch:
        raise ValueError(f"prefetch is a knob of variant 'fma'; got variant {name!r}")
    max_m = max_block_m(fmt, name)
    if block_m is not None and not _MIN_DOT <= block_m <= max_m:
        raise ValueError(f"fmt {fmt!r} variant {name!r} needs 16 <= block_m <= {max_m}; "
                         f"got {block_m}")
    bm = block_m or _default_block_m(nk, num_experts, max_m)
    bk = block_k or default_block_k(fmt, name, bm)
    if block_k is None and fmt == "fp4" and name == "planes":
        bk = min(bk, _pow2_divisor(math.gcd(d, inter)))
    _check_blocks(fmt, name, block_n, bk)
    if fmt == "fp4" and name == "planes" and (d % bk or inter % bk):
        raise ValueError(f"fp4 variant 'planes' permutes whole BLOCK_K blocks: block_k must "
                         f"divide d = {d} and I = {inter}; got {bk}")
    tiles = max(1, (nk + min(num_experts, nk) * (bm - 1)) // bm)
    target = PROGRAMS_PER_SM * _num_sms(device)

    widest = max_block_n(fmt, name)
    if block_n is not None and block_n > widest:
        raise ValueError(f"fmt {fmt!r} variant {name!r} needs block_n <= {widest}; got {block_n}")

    def launch(out: int) -> Launch:
        bn = block_n or (64 if tiles * triton.cdiv(out, 64) >= target and widest >= 64 else 32)
        return Launch(bn, num_warps or (4 if bn >= 32 else 1))

    return MoePlan(VARIANTS[name], bm, bk, num_stages or 3, launch(inter), launch(d))


def _plan_fma(fmt: str, block_m: int | None, block_n: int | None, block_k: int | None,
              num_warps: int | None, num_stages: int | None, prefetch: bool | None) -> MoePlan:
    """The fma loop's fixed tiles (the same at every N: a row's bits do not depend on the batch):
    BLOCK_M 1, 2 or 4; BLOCK_N a power of two in [4, 128]; BLOCK_K a power of two, whole chunks
    (FP4 >= 32, FP8 >= 16) and FP8 <= 128 (one scale block per step)."""
    bm, bn = block_m or FMA_BLOCK_M, block_n or FMA_BLOCK_N
    bk = block_k or FMA_BLOCK_K[fmt]
    min_k, max_k = (32, 2048) if fmt == "fp4" else (16, _FP8_BLOCK)
    if (bm not in (1, 2, 4) or not 4 <= bn <= 128 or bn & (bn - 1)
            or not min_k <= bk <= max_k or bk & (bk - 1)):
        raise ValueError(f"fmt {fmt!r} variant 'fma' needs block_m in (1, 2, 4), block_n a power "
                         f"of two in [4, 128], block_k a power of two in [{min_k}, {max_k}]; "
                         f"got {bm}, {bn}, {bk}")
    launch = Launch(bn, num_warps or FMA_WARPS)
    pf = FMA_PREFETCH if prefetch is None else prefetch
    return MoePlan(VARIANTS["fma"], bm, bk, num_stages or 1, launch, launch, pf)


def _plan_frag(block_m: int | None, block_n: int | None, block_k: int | None,
               num_warps: int | None, num_stages: int | None, prefetch: bool | None,
               deep: bool = False, stream_weights: bool = False) -> MoePlan:
    """The frag loop (`moe_frag.py`): BLOCK_M 1 (one slot per program, no tile map), 8 or 16 (a
    tile of up to 8 / 16 rows of one expert, one or two MMAs' 8 columns), BLOCK_N = 16 x WN rows,
    num_warps = WK x WN (WK = 2 or 4 warps run the FRAG_SPLITS virtual K splits); no BLOCK_K,
    stages or prefetch knobs. Defaults per BLOCK_M: FRAG_LAUNCHES, the fastest of the H200 sweep
    (benchmarks/results/quant_moe_h200_202612.md), and gate/up at FRAG_DEEP_GATE_UP when `deep`
    (so few slots that FRAG_LAUNCHES[1] would leave the SMs short of warps); a knob pins both
    launches. The launches never change a row's bits: the splits' order is fixed."""
    if block_m not in (None, 1, 8, 16) or block_k not in (None, FRAG_STEP) \
            or num_stages not in (None, 1) or prefetch:
        raise ValueError(f"variant 'frag' takes block_m 1, 8 or 16, block_k {FRAG_STEP}, one "
                         f"stage and no prefetch; got {block_m}, {block_k}, {num_stages}, "
                         f"{prefetch}")
    bm = block_m or 1
    gate_up, down = FRAG_LAUNCHES[bm]
    launches = []
    for default_bn, default_warps in (FRAG_DEEP_GATE_UP if deep else gate_up, down):
        bn, warps = block_n or default_bn, num_warps or default_warps
        frag_warps(bn, warps)
        launches.append(Launch(bn, warps))
    return MoePlan(VARIANTS["frag"], bm, FRAG_STEP, 1, launches[0], launches[1],
                   stream_weights=stream_weights)


def frag_warps(block_n: int, num_warps: int) -> tuple[int, int]:
    """(WK, WN) of a frag launch: WN = block_n / 16 row blocks (a power of two), WK = num_warps /
    WN = 2 or 4 (each warp runs FRAG_SPLITS / WK of the virtual K splits)."""
    wn = block_n // FRAG_ROWS
    wk = num_warps // wn if wn >= 1 else 0
    if (block_n % FRAG_ROWS or wn < 1 or wn & (wn - 1) or wk * wn != num_warps
            or wk not in (2, 4) or num_warps > 16):
        raise ValueError(f"variant 'frag' needs block_n = 16 x a power of two WN and num_warps = "
                         f"WN x 2 or WN x 4, at most 16; got block_n {block_n}, num_warps "
                         f"{num_warps}")
    return wk, wn


def _plan_w8a8(fmt: str, variant: str | None, act_quant: bool, nk: int, num_experts: int,
               block_m: int | None, block_n: int | None, block_k: int | None,
               num_warps: int | None, num_stages: int | None, prefetch: bool | None,
               max_regs: int | None) -> MoePlan:
    """The W8A8 loop (`moe_w8a8.py`): FP8 activations, FP8 weights or FP4 ones decoded to e4m3,
    K steps of one 128-wide scale block; gate/up BLOCK_N 128 (its epilogue quantises one block
    of h per row), 8 warps from BLOCK_M 64 (two [BM, 128] fp32 accumulators); down BLOCK_N 128
    (a knob: 16..128). BLOCK_M as the other MMA loops. The down launch at BLOCK_M 64 with 8 warps
    is capped at W8A8_DOWN_REGS registers, so two CTAs share an SM; capping gate/up (two
    accumulators) made it slower (H200, N 512 / 2048 / 8192:
    benchmarks/results/quant_moe_h200_202612.md)."""
    if fmt not in ("fp8", "fp4") or not act_quant or variant not in (None, "w8a8"):
        raise ValueError(f"variant 'w8a8' is the loop of fmt 'fp8' / 'fp4' with act_quant=True; "
                         f"got fmt {fmt!r}, variant {variant!r}, act_quant={act_quant}")
    if prefetch or block_k not in (None, _FP8_BLOCK):
        raise ValueError(f"variant 'w8a8' takes block_k {_FP8_BLOCK} and no prefetch; got "
                         f"{block_k}, {prefetch}")
    if block_m is not None and (not _MIN_DOT <= block_m <= 128 or block_m & (block_m - 1)):
        raise ValueError(f"variant 'w8a8' needs block_m a power of two in [16, 128]; got {block_m}")
    if block_n is not None and (not _MIN_DOT <= block_n <= 128 or block_n & (block_n - 1)):
        raise ValueError(f"variant 'w8a8' needs block_n a power of two in [16, 128]; got {block_n}")
    if max_regs is not None and not MIN_REGS <= max_regs <= MAX_REGS:
        raise ValueError(f"variant 'w8a8' takes max_regs in [{MIN_REGS}, {MAX_REGS}]; got "
                         f"{max_regs}")
    bm = block_m or _default_block_m(nk, num_experts, DEFAULT_MAX_BLOCK_M)
    bn = block_n or _FP8_BLOCK

    def warps(acc_width: int) -> int:
        return num_warps or (8 if bm * acc_width >= 64 * _FP8_BLOCK else 4)

    capped = block_m is None and num_warps is None and bm == 64 and warps(bn) == 8
    # gate/up holds two accumulators of its width
    return MoePlan(VARIANTS["w8a8"], bm, _FP8_BLOCK, num_stages or 3,
                   Launch(_FP8_BLOCK, warps(2 * _FP8_BLOCK), max_regs),
                   Launch(bn, warps(bn), max_regs or (W8A8_DOWN_REGS if capped else None)))


def _variant(fmt: str, variant: str | None, x_dtype: torch.dtype) -> str:
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}; got {variant!r}")
    if fmt == "bf16":
        return "scaled"
    if variant == "frag" and (fmt not in ("fp4", "fp8") or x_dtype != torch.bfloat16):
        raise ValueError(f"variant 'frag' is fmt 'fp4' or 'fp8' with bf16 activations; got fmt "
                         f"{fmt!r}, {x_dtype}")
    if variant == "fma" and x_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"variant 'fma' takes bf16 / fp16 / fp32 activations; got {x_dtype}")
    if variant is None:
        variant = DEFAULT_VARIANT[fmt]
        return "scaled" if variant == "dot_scaled" and x_dtype != torch.bfloat16 else variant
    if variant == "dot_scaled" and x_dtype != torch.bfloat16:
        raise ValueError(f"variant 'dot_scaled' feeds bf16 activations to the MMA; got {x_dtype} "
                         "(use 'scaled', exact for fp32 activations)")
    return variant


def max_block_m(fmt: str, variant: str) -> int:
    """128 (the plan itself goes up to DEFAULT_MAX_BLOCK_M), but 32 for FP4 "scaled" / "words": at
    BLOCK_M = 64 Triton (3.6, sm_90) moves the MMA to wgmma, whose shared-memory operand layout it
    cannot derive through the decoded tile's join / reshape (a compile error; "planes" has
    none)."""
    return 32 if fmt == "fp4" and variant in ("scaled", "words") else 128


def max_block_n(fmt: str, variant: str) -> int:
    """128, but 32 for FP4 "dot_scaled": at BLOCK_N 64 Triton (3.6, sm_90) lowers its
    `tl.dot_scaled` to wgmma, whose products are wrong on the H200 (the GPU parity test
    `test_flash_parity` fails with a relative error above 1); at 32 it runs mma.sync and passes."""
    return 32 if fmt == "fp4" and variant == "dot_scaled" else 128


def default_block_k(fmt: str, variant: str, block_m: int) -> int:
    """128 bytes of each weight row per step (split FP4: its first 64; FP4 at BLOCK_M 32: 64
    bytes, or the two 256-wide decoded tiles spill registers)."""
    if fmt == "fp4":
        return 64 if variant == "split" else 256 if block_m == _MIN_DOT else 128
    return _FP8_BLOCK if fmt == "fp8" else 64


def _check_blocks(fmt: str, variant: str, block_n: int | None, block_k: int) -> None:
    """Powers of two >= 16; block_k <= 128 (an fp8 tile inside one scale block), <= 256 for FP4
    "scaled" / "dot_scaled", >= 32 for FP4 (a whole scale group per step)."""
    wide = fmt == "fp4" and variant != "split"
    max_k = 2 * _FP8_BLOCK if wide else _FP8_BLOCK
    min_k = 2 * _MIN_DOT if fmt == "fp4" else _MIN_DOT
    for b in (block_n, block_k):
        if b is not None and (b < _MIN_DOT or b & (b - 1)):
            raise ValueError(f"block_n / block_k must be powers of two >= {_MIN_DOT}; "
                             f"got {block_n}, {block_k}")
    if not min_k <= block_k <= max_k:
        raise ValueError(f"fmt {fmt!r} variant {variant!r} needs block_k >= {min_k} and <= "
                         f"{max_k} (fp4: whole 32-wide scale groups; fp8: one 128-wide scale "
                         f"block); got {block_k}")


def _default_block_m(nk: int, num_experts: int, cap: int) -> int:
    """The mean rows per expert as a power of two in [16, min(cap, DEFAULT_MAX_BLOCK_M)]."""
    mean = triton.next_power_of_2(max(1, nk // num_experts))
    return max(_MIN_DOT, min(cap, DEFAULT_MAX_BLOCK_M, mean))


def _pow2_divisor(n: int) -> int:
    """The largest power of two dividing n > 0."""
    return n & -n


@cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _NUM_SMS_CPU
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def dequant_chunk(fmt: str, device: torch.device, nk: int, num_experts: int,
                  pinned: bool) -> int:
    """Experts per decoded chunk for the default prefill path (module docstring), 0 for the
    quantised loop; `pinned`: the caller gave a loop or tile knob, or act_quant."""
    rows = DEQUANT_MIN_MEAN_ROWS.get(fmt)
    if pinned or rows is None or device.type != "cuda" or nk < rows * num_experts:
        return 0
    return DEQUANT_CHUNK
