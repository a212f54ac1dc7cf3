"""Parity of `triton_sparse_attention` with the reference `sparse_attention_multi` (spec §6.7).

Index rows are built the way the engine builds them (engine/metadata.py): SWA window slots of
positions p-W+1..p with leading -1 before position 0 (windows partly filled for a request's first
tokens); C4 top-k: ascending entry slots of min(k, (p+1)//4) picks, -1 padded; C128: every visible
entry i < (p+1)//ratio, -1 beyond, possibly zero columns. Prefill: one request, consecutive
positions; decode: one token per request.
CPU (Triton interpreter): small H, D (also not powers of two), one and two sources, scattered -1,
all keys invalid (exact zeros), extreme sinks, duplicated keys, strided q, tile knobs, forced
split-KV, fp32 (1e-5) and bf16 (1e-2) relative to max |ref|, input validation. GPU (`-m gpu`): Flash
shapes (H 64, D 512, bf16, W 128 + C4 k 512 or C128 V up to 2048; T 1..4096), split-KV, the sweep
configs, fp32 ieee dots, graph capture.

    # interpreter on CPU, then on a CUDA machine:
    PYTHONPATH=src python3 -m pytest -q tests/kernels/test_sparse_attention_triton.py
    PYTHONPATH=src python3 -m pytest -q -m gpu tests/kernels/test_sparse_attention_triton.py
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

# NOTE: must precede the first `import triton` (tests/kernels/conftest.py may already do this).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from dsv4.kernels.ref.attention import sparse_attention_multi  # noqa: E402
from dsv4.kernels.ref.rope_norm import rope_inverse  # noqa: E402
from dsv4.kernels.triton.sparse_attention import (  # noqa: E402
    choose_splits,
    split_plan,
    triton_sparse_attention,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP32_REL = 1e-5     # max |diff| / max |ref|
BF16_REL = 1e-2
# decode pools alias requests beyond this many rows (harmless: any slot is a valid key)
POOL_CAP = 1 << 16

Sources = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Spec:
    T: int
    H: int
    D: int
    W: int                # window width (SWA source)
    comp: str = "none"    # second source: "none" | "c4" (top-k) | "c128" (all visible entries)
    k: int = 0            # c4 top-k width
    ratio: int = 4        # c128 ratio (c4 is always 4)
    decode: bool = False  # one token per request (positions random in [0, last]) vs one request
    last: int = 0         # decode: largest position; prefill: position of the first token


def positions(spec: Spec, g: torch.Generator, device: str) -> torch.Tensor:
    if not spec.decode:
        return spec.last + torch.arange(spec.T, device=device)
    pos = torch.randint(0, spec.last + 1, (spec.T,), generator=g, device=device)
    # a request's first token (window of 1) and the longest context
    pos[0], pos[-1] = 0, spec.last
    return pos


class SlotMap:
    """Distinct pool slots of (request, position) pairs (aliased beyond POOL_CAP rows); pool size
    adds 3 spares."""

    def __init__(self, requests: int, span: int, g: torch.Generator, device: str) -> None:
        self.span, self.n = span, min(requests * span, POOL_CAP)
        self.perm = torch.randperm(self.n, generator=g, device=device)
        self.pool_rows = self.n + 3

    def __call__(self, req: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.perm[(req * self.span + x) % self.n]


def window_rows(pos: torch.Tensor, W: int, slots: SlotMap, req: torch.Tensor) -> torch.Tensor:
    win = pos[:, None] - W + 1 + torch.arange(W, device=pos.device)     # [T, W], engine layout
    return torch.where(win >= 0, slots(req[:, None], win.clamp(min=0)), -1)


def entry_rows(spec: Spec, pos: torch.Tensor, slots: SlotMap, req: torch.Tensor,
               g: torch.Generator) -> torch.Tensor:
    ratio = 4 if spec.comp == "c4" else spec.ratio
    visible = (pos + 1) // ratio                                        # [T]
    V = int(visible.max())
    ids = torch.arange(V, device=pos.device).expand(spec.T, V)
    seen = ids < visible[:, None]
    if spec.comp == "c128":
        return torch.where(seen, slots(req[:, None], ids), -1)
    # random "indexer"
    score = torch.rand(spec.T, V, generator=g, device=pos.device).masked_fill(~seen, -1.0)
    top, pick = score.topk(min(spec.k, V), dim=1) if V else (score[:, :0], ids[:, :0])
    pick = torch.where(top >= 0, pick, V).sort(dim=1).values            # ascending, -1 last
    rows = torch.where(pick < V, slots(req[:, None], pick.clamp(max=max(V - 1, 0))), -1)
    return torch.nn.functional.pad(rows, (0, spec.k - rows.shape[1]), value=-1)


def make_case(spec: Spec, dtype: torch.dtype, *, seed: int = 0,
              device: str = DEVICE) -> tuple[torch.Tensor, Sources, torch.Tensor]:
    g = torch.Generator(device).manual_seed(seed)
    pos = positions(spec, g, device)
    requests = spec.T if spec.decode else 1
    req = torch.arange(spec.T, device=device) if spec.decode else torch.zeros_like(pos)
    span = int(pos.max()) + 1
    swa_slots = SlotMap(requests, span, g, device)
    q = torch.randn(spec.T, spec.H, spec.D, generator=g, device=device).to(dtype)
    sink = torch.randn(spec.H, generator=g, device=device)
    swa = torch.randn(swa_slots.pool_rows, spec.D, generator=g, device=device).to(dtype)
    sources = [(swa, window_rows(pos, spec.W, swa_slots, req).contiguous())]
    if spec.comp != "none":
        ratio = 4 if spec.comp == "c4" else spec.ratio
        entry_slots = SlotMap(requests, max(1, span // ratio), g, device)
        entries = torch.randn(entry_slots.pool_rows, spec.D, generator=g, device=device).to(dtype)
        sources.append((entries, entry_rows(spec, pos, entry_slots, req, g).contiguous()))
    return q, sources, sink


def assert_close(out: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape, (
        out.dtype, out.shape, ref.dtype, ref.shape)
    assert torch.isfinite(out).all(), "non-finite output"
    scale = ref.float().abs().max().clamp(min=1e-6)
    err = ((out.float() - ref.float()).abs().max() / scale).item()
    assert err <= rel, f"max |diff| / max |ref| = {err:.3e} > {rel:.0e}"


def check(q: torch.Tensor, sources: Sources, sink: torch.Tensor, **knobs: int) -> torch.Tensor:
    scale = q.shape[-1] ** -0.5
    out = triton_sparse_attention(q, sources, sink, scale, **knobs)
    assert_close(out, sparse_attention_multi(q, sources, sink, scale),
                 FP32_REL if q.dtype == torch.float32 else BF16_REL)
    return out


DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
CPU_SPECS = [
    pytest.param(Spec(1, 4, 32, 8), id="swa-only-decode-T1-first-token"),
    pytest.param(Spec(6, 8, 32, 8, decode=True, last=40), id="swa-only-decode-T6"),
    pytest.param(Spec(12, 16, 64, 16, "c4", k=8, last=0), id="c4-prefill-from-0"),
    pytest.param(Spec(5, 4, 32, 8, "c4", k=16, decode=True, last=90), id="c4-decode-T5"),
    pytest.param(Spec(10, 8, 32, 8, "c128", ratio=4, last=0), id="c128-prefill-from-0"),
    pytest.param(Spec(7, 16, 64, 16, "c128", ratio=16, last=3), id="c128-prefill-zero-visible"),
    pytest.param(Spec(4, 8, 32, 8, "c128", ratio=8, decode=True, last=300),
                 id="c128-decode-V37"),
    pytest.param(Spec(3, 6, 48, 8, "c4", k=16, decode=True, last=50), id="nonpow2-H6-D48"),
    pytest.param(Spec(2, 64, 512, 128, "c4", k=512, decode=True, last=4000),
                 id="flash-c4-decode-T2"),
]


@pytest.mark.parametrize("spec", CPU_SPECS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_parity(spec: Spec, dtype: torch.dtype) -> None:
    q, sources, sink = make_case(spec, dtype)
    check(q, sources, sink, block_n=16)


@pytest.mark.parametrize("knobs", [dict(num_splits=2), dict(num_splits=3), dict(num_splits=64),
                                   dict(block_h=32, block_n=32, num_splits=2),
                                   dict(block_h=16, block_n=64)],
                         ids=["split2", "split3", "split-capped", "bh32-bn32-split2", "bn64"])
def test_tiles_and_split_kv(knobs: dict[str, int]) -> None:
    """Forced split-KV (split boundaries inside each source and across the two) and other tile
    shapes."""
    q, sources, sink = make_case(Spec(3, 8, 32, 24, "c4", k=40, decode=True, last=200),
                                 torch.float32, seed=1)
    check(q, sources, sink, **{"block_n": 16, **knobs})


def test_split_kv_bf16_empty_splits_rows() -> None:
    """bf16 through the combine step, with rows whose early splits hold no valid key (-inf lse)."""
    q, sources, sink = make_case(Spec(4, 8, 32, 32, "c128", ratio=2, decode=True, last=70),
                                 torch.bfloat16, seed=2)
    check(q, sources, sink, block_n=16, num_splits=4)


def test_split_combine_column_programs_with_inverse_rope() -> None:
    """D = 512 (V4's head): the split combine runs 4 column programs per row, the RoPE pairs in
    the last one; its de-rotated output is `rope_inverse` of the plain split output bit for bit
    in fp32 (interpreter) and the reference's to the tolerance."""
    q, sources, sink = make_case(Spec(2, 2, 512, 16, "c128", ratio=8, decode=True, last=400),
                                 torch.float32, seed=3)
    cos, sin = rope_tables(2, 64, 64)
    scale = 512 ** -0.5
    plain = triton_sparse_attention(q, sources, sink, scale, block_n=16, num_splits=5)
    got = triton_sparse_attention(q, sources, sink, scale, block_n=16, num_splits=5,
                                  inverse_rope=(cos, sin))
    if DEVICE == "cpu":
        assert torch.equal(got, rope_inverse(plain, cos, sin))
    assert torch.equal(got[..., :448], plain[..., :448]), "no-RoPE channels"
    want = sparse_attention_multi(q, sources, sink, scale, inverse_rope=(cos, sin))
    assert_close(got, want, FP32_REL)


def rope_tables(T: int, rd: int, seed: int, device: str = DEVICE) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device).manual_seed(seed)
    angles = torch.rand(T, rd // 2, generator=g, device=device) * 6.3
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("num_splits", [1, 3], ids=["no-split", "split-combine"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rd", [8, 32], ids=["rope-slice", "rope-whole-head"])
def test_inverse_rope_in_the_store(num_splits: int, dtype: torch.dtype, rd: int) -> None:
    """`inverse_rope`: the output de-rotated in the kernel's store (or the split combine's) is
    `rope_inverse` of the plain output: bit for bit in fp32 on the interpreter (no FMA
    contraction; on the GPU the compiler fuses the rotation's multiply-adds, a rounding apart),
    within one rounding in bf16 (the interpreter's float -> bf16 cast truncates, torch's rounds
    to nearest); and the reference's with the same argument to the tolerance."""
    q, sources, sink = make_case(Spec(5, 8, 32, 8, "c4", k=16, decode=True, last=90), dtype)
    cos, sin = rope_tables(5, rd, rd)
    scale = 32 ** -0.5
    plain = triton_sparse_attention(q, sources, sink, scale, block_n=16, num_splits=num_splits)
    got = triton_sparse_attention(q, sources, sink, scale, block_n=16, num_splits=num_splits,
                                  inverse_rope=(cos, sin))
    if dtype == torch.float32 and DEVICE == "cpu":
        assert torch.equal(got, rope_inverse(plain, cos, sin))
    elif dtype == torch.float32:
        assert_close(got, rope_inverse(plain, cos, sin), 1e-6)
        assert torch.equal(got[..., :32 - rd], plain[..., :32 - rd]), "no-RoPE channels"
    else:
        assert_close(got, rope_inverse(plain, cos, sin), 8e-3)
        assert torch.equal(got[..., :32 - rd], plain[..., :32 - rd]), "no-RoPE channels"
    want = sparse_attention_multi(q, sources, sink, scale, inverse_rope=(cos, sin))
    assert_close(got, want, FP32_REL if dtype == torch.float32 else BF16_REL)
    with pytest.raises(ValueError, match=r"cos / sin must be \[5, rd/2\] float32"):
        triton_sparse_attention(q, sources, sink, scale, inverse_rope=(cos[:4], sin[:4]))


def test_scattered_invalid_slots() -> None:
    """-1 anywhere in a row (not only padding), including whole blocks of -1 between valid ones."""
    q, sources, sink = make_case(Spec(5, 8, 32, 32, "c4", k=48, decode=True, last=400),
                                 torch.float32, seed=3)
    g = torch.Generator(DEVICE).manual_seed(3)
    holes = [(kv, idx.masked_fill(torch.rand(idx.shape, generator=g, device=DEVICE) < 0.4, -1))
             for kv, idx in sources]
    holes[1][1][:, 16:32] = -1
    check(q, holes, sink, block_n=16)
    check(q, holes, sink, block_n=16, num_splits=3)


@pytest.mark.parametrize("programs,blocks,want", [
    (4, 5, 5), (4, 20, 20), (4, 33, 33),        # batch 1 (4 head groups): one block per split
    (4, 36, 18), (4, 229, 58),                  # past one wave: >= 2 blocks per split, cap 64
    (32, 5, 2), (32, 20, 7),                    # batch 8: the 2-per-SM target, evened
    (132, 20, 1), (1, 1, 1)])
def test_split_plan_on_132_sms(monkeypatch: pytest.MonkeyPatch, programs: int, blocks: int,
                               want: int) -> None:
    """The split plan from Python ints on a 132-SM GPU (no GPU needed): one key block per split
    while every (program, block) pair fits one per SM, else the 2-per-SM target with >= 2 blocks
    per split and at most 64 splits, evened out."""
    monkeypatch.setattr("dsv4.kernels.triton.launch.sms", lambda device: 132)
    splits, per_split = split_plan(programs, blocks, torch.device("cuda"))
    assert splits == want and splits * per_split >= blocks > (splits - 1) * per_split


@pytest.mark.parametrize("num_splits", [None, 2])
def test_all_keys_invalid_gives_zeros(num_splits: int | None) -> None:
    q, sources, sink = make_case(Spec(3, 4, 32, 8, "c4", k=16, decode=True, last=60),
                                 torch.float32)
    dead = [(kv, torch.full_like(idx, -1)) for kv, idx in sources]
    dead_row = [(kv, idx.clone()) for kv, idx in sources]
    for _, idx in dead_row:
        idx[1] = -1
    assert torch.equal(triton_sparse_attention(q, dead, sink, 0.2, block_n=16,
                                               num_splits=num_splits), torch.zeros_like(q))
    out = check(q, dead_row, sink, block_n=16, num_splits=num_splits or 1)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_extreme_sinks_and_logits() -> None:
    """A sink far above / below the logits, and sharply peaked logits (large scale)."""
    q, sources, sink = make_case(Spec(4, 4, 32, 16, "c4", k=16, decode=True, last=80),
                                 torch.float32, seed=4)
    for s in (sink + 40.0, sink - 40.0):
        check(q, sources, s, block_n=16)
    out = triton_sparse_attention(q, sources, sink, 3.0, block_n=16)
    assert_close(out, sparse_attention_multi(q, sources, sink, 3.0), FP32_REL)


def test_one_source_variants() -> None:
    """One source; a [T, 0] second source; an empty first source with a live second one; duplicated
    keys."""
    q, sources, sink = make_case(Spec(4, 8, 32, 8, "c4", k=16, decode=True, last=70),
                                 torch.float32, seed=5)
    swa, c4 = sources
    empty = (swa[0], swa[1][:, :0])
    for variant in ([c4], [swa, empty], [empty, c4], [c4, c4]):
        check(q, variant, sink, block_n=16)


def test_strided_q_and_mixed_dtypes() -> None:
    q, sources, sink = make_case(Spec(3, 8, 32, 8, "c4", k=16, decode=True, last=50),
                                 torch.float32, seed=6)
    wide = torch.randn(3, 8, 64, device=DEVICE)
    wide[..., :32] = q
    check(wide[..., :32], sources, sink, block_n=16)                 # q row stride 64
    mixed = [(sources[0][0].bfloat16(), sources[0][1]), sources[1]]  # bf16 SWA pool, fp32 entries
    check(q, mixed, sink, block_n=16)
    check(q.bfloat16(), [(kv.float(), idx) for kv, idx in sources], sink, block_n=16)


def test_empty() -> None:
    q, sources, sink = make_case(Spec(2, 4, 32, 8, "c4", k=16), torch.float32)
    assert triton_sparse_attention(q[:0], [(kv, idx[:0]) for kv, idx in sources], sink,
                                   0.1).shape == (0, 4, 32)
    out = triton_sparse_attention(q, [(kv, idx[:, :0]) for kv, idx in sources], sink, 0.1)
    assert torch.equal(out, torch.zeros_like(q))


def test_rejects_bad_inputs() -> None:
    q, sources, sink = make_case(Spec(2, 4, 32, 8, "c4", k=16), torch.float32)
    (swa, win), (ent, picks) = sources
    bad = {
        "no source": (q, [], sink),
        "three sources": (q, [*sources, sources[0]], sink),
        "indices int32": (q, [(swa, win.int())], sink),
        "kv width": (q, [(swa[:, :16].contiguous(), win)], sink),
        "kv column stride": (q, [(swa.t().contiguous().t(), win)], sink),
        "indices T": (q, [(swa, win[:1])], sink),
        "sink bf16": (q, sources, sink.bfloat16()),
        "sink length": (q, sources, sink[:2]),
        "q 2-D": (q[0], sources, sink),
        "q int8": (q.to(torch.int8), sources, sink),
    }
    for name, args in bad.items():
        with pytest.raises(ValueError):
            triton_sparse_attention(*args, 0.1)  # type: ignore[arg-type]
            pytest.fail(f"accepted {name}")
    with pytest.raises(ValueError, match="block_n"):
        triton_sparse_attention(q, sources, sink, 0.1, block_n=24)
    with pytest.raises(ValueError, match="p_terms"):
        triton_sparse_attention(q, sources, sink, 0.1, p_terms=4)
    q16, sources16, sink16 = make_case(Spec(2, 4, 32, 8, "c4", k=16), torch.bfloat16)
    with pytest.raises(ValueError, match="num_warps=16 with p_terms=3"):  # faults on the H200
        triton_sparse_attention(q16, sources16, sink16, 0.1, num_warps=16)


# ---- GPU: V4-Flash shapes ------------------------------------------------------------------------

FLASH = Spec(1, 64, 512, 128)
C4 = replace(FLASH, comp="c4", k=512)
C128 = replace(FLASH, comp="c128", ratio=128)


def flash_spec(comp: str, T: int, decode: bool, width: int) -> Spec:
    """decode: positions up to the context where C4 sees 4 * k entries / C128 sees `width` entries;
    prefill: the last T tokens of that context (window full, width entries visible at the end)."""
    base = C4 if comp == "c4" else C128
    context = (4 * 4 * width) if comp == "c4" else 128 * width - 1
    return replace(base, T=T, decode=decode, last=context if decode else max(0, context - T + 1))


def reference_by_rows(q: torch.Tensor, sources: Sources, sink: torch.Tensor, scale: float,
                      rows: int = 512) -> torch.Tensor:
    return torch.cat([sparse_attention_multi(q[i:i + rows],
                                             [(kv, idx[i:i + rows]) for kv, idx in sources],
                                             sink, scale) for i in range(0, q.shape[0], rows)])


def check_cuda(q: torch.Tensor, sources: Sources, sink: torch.Tensor,
               **knobs: int) -> torch.Tensor:
    out = triton_sparse_attention(q, sources, sink, 512 ** -0.5, **knobs)
    ref = reference_by_rows(q, sources, sink, 512 ** -0.5)
    assert_close(out, ref, BF16_REL if q.dtype == torch.bfloat16 else FP32_REL)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 64, 512, 4096])
@pytest.mark.parametrize("comp,width",
                         [("c4", 512), ("c128", 32), ("c128", 1024), ("c128", 2048)])
def test_flash_decode_cuda(T: int, comp: str, width: int) -> None:
    q, sources, sink = make_case(flash_spec(comp, T, True, width), torch.bfloat16, seed=T + width,
                                 device="cuda")
    check_cuda(q, sources, sink)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [512, 4096])
@pytest.mark.parametrize("comp,width", [("c4", 512), ("c128", 64), ("c128", 2048)])
def test_flash_prefill_cuda(T: int, comp: str, width: int) -> None:
    q, sources, sink = make_case(flash_spec(comp, T, False, width), torch.bfloat16, seed=T,
                                 device="cuda")
    check_cuda(q, sources, sink)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 2, 5, 17, 32, 64])
@pytest.mark.parametrize("T", [1, 8])
def test_flash_split_kv_cuda(T: int, num_splits: int) -> None:
    q, sources, sink = make_case(flash_spec("c128", T, True, 1024), torch.bfloat16,
                                 seed=num_splits, device="cuda")
    check_cuda(q, sources, sink, num_splits=num_splits)
    blocks = sum(-(-idx.shape[1] // 32) for _, idx in sources)
    assert choose_splits(T * 4, blocks, q.device) > 1, "decode at small batch is meant to split"


@pytest.mark.gpu
def test_flash_c128_decode_at_900k_cuda() -> None:
    """Batch-1 C128 decode at 900K context (7,200 entries + the window): the default split plan
    (the 64-split cap) against the reference."""
    q, sources, sink = make_case(flash_spec("c128", 1, True, 7200), torch.bfloat16, seed=9,
                                 device="cuda")
    check_cuda(q, sources, sink)
    blocks = sum(-(-idx.shape[1] // 32) for _, idx in sources)
    assert choose_splits(4, blocks, q.device) > 32, "900K at batch 1 splits past the old cap"


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 8])
@pytest.mark.parametrize("T", [1, 8])
def test_flash_inverse_rope_cuda(T: int, num_splits: int) -> None:
    """V4-Flash decode (rd 64 of D 512): the de-rotation in the store against `rope_inverse` of the
    plain output, within one bf16 rounding (a contracted a * cos - b * sin may round once less)."""
    q, sources, sink = make_case(flash_spec("c4", T, True, 512), torch.bfloat16, seed=T,
                                 device="cuda")
    cos, sin = rope_tables(T, 64, T, "cuda")
    plain = triton_sparse_attention(q, sources, sink, 512 ** -0.5, num_splits=num_splits)
    got = triton_sparse_attention(q, sources, sink, 512 ** -0.5, num_splits=num_splits,
                                  inverse_rope=(cos, sin))
    assert_close(got, rope_inverse(plain, cos, sin), 8e-3)
    assert torch.equal(got[..., :448], plain[..., :448]), "channels without RoPE are untouched"


@pytest.mark.gpu
@pytest.mark.parametrize("block_h,block_n,num_warps,num_stages",
                         [(16, 32, 8, 2), (16, 64, 8, 2), (16, 64, 4, 2), (16, 32, 4, 1),
                          (16, 32, 4, 3), (32, 32, 8, 2), (32, 64, 8, 2), (64, 16, 8, 2),
                          (64, 32, 8, 2)])
def test_sweep_configs_cuda(block_h: int, block_n: int, num_warps: int, num_stages: int) -> None:
    """Every configuration bench_sparse_attention.py --sweep times compiles and is correct."""
    knobs = dict(block_h=block_h, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    for spec, seed in ((flash_spec("c4", 8, True, 512), 1),
                       (flash_spec("c128", 256, False, 512), 2)):
        q, sources, sink = make_case(spec, torch.bfloat16, seed=seed, device="cuda")
        check_cuda(q, sources, sink, **knobs)


@pytest.mark.gpu
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_flash_fp32_ieee_cuda(decode: bool) -> None:
    q, sources, sink = make_case(flash_spec("c4", 64, decode, 512), torch.float32, device="cuda")
    check_cuda(q, sources, sink)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64])
def test_cuda_graph_replay_matches_reference(T: int) -> None:
    q, sources, sink = make_case(flash_spec("c128", T, True, 512), torch.bfloat16, device="cuda")
    eager = triton_sparse_attention(q, sources, sink, 512 ** -0.5)        # warm-up (compiles)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = triton_sparse_attention(q, sources, sink, 512 ** -0.5)
    q.copy_(torch.randn_like(q))
    graph.replay()
    assert_close(captured, sparse_attention_multi(q, sources, sink, 512 ** -0.5), BF16_REL)
    assert not torch.equal(captured, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_pv_terms_round_like_the_reference_cuda(decode: bool) -> None:
    """P as 3 bf16 terms keeps the reference's fp32 P: (almost) every output element is
    bit-equal to the reference's, where one rounding of P (flash attention's) moves many."""
    q, sources, sink = make_case(flash_spec("c4", 256, decode, 512), torch.bfloat16,
                                 device="cuda")
    ref = reference_by_rows(q, sources, sink, 512 ** -0.5)
    differ = {t: (triton_sparse_attention(q, sources, sink, 512 ** -0.5, p_terms=t) != ref)
              .float().mean().item() for t in (1, 2, 3)}
    assert differ[3] <= 0.005 and differ[1] >= 10 * max(differ[3], 1e-4), differ
    assert differ[3] <= differ[2] <= differ[1], differ
