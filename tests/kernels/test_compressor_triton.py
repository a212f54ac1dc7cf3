"""Parity of the Flash Compressor `triton_compress_cached` with the reference `compress_cached`.

Spec §6.5. Plans are the engine's own: a harness drives `engine/metadata.py::build_context` over a
real request table step by step (prefill, decode, chunked extend, several requests per step) and
keeps two copies of one compressor's state, the reference's and the kernel's. After every step the
entry pools agree to 1e-5 (fp32) or 1e-2 (bf16) relative to max |ref| and the ring pools are
bit-equal (trash rows excluded: neither is read). The scores are raw and the ops add the gate
scores' `ape` per source slot (the serving path's form; `ape=False` cases: scores that include it);
a third copy, the reference on scores with the ape added by position up front (the full-sequence
path's form), has the reference's entries bit for bit. Geometries: micro (ratio 4 overlap Dc 32 /
16, ratio 16 Dc 32, rope 8) and V4-Flash (C4 Dc 512 and indexer Dc 128 with overlap, C128 Dc 512;
rope 64). Also: the engine's own compress calls (prefix-cache hits, chunked prefill) checked call
by call. The engine's greedy tokens with kernel_backend='triton' (this kernel active) are tested
in tests/kernels/test_engine_triton_backend.py.

    PYTHONPATH=src python -m pytest -q tests/kernels/test_compressor_triton.py  # interpreter on CPU
    PYTHONPATH=src python -m pytest -q -m gpu tests/kernels/test_compressor_triton.py  # on CUDA
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

# NOTE: must precede the first `import triton` (tests/kernels/conftest.py may already do it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from compress_steps import EngineSteps, rel_error  # noqa: E402

from dsv4 import EngineConfig, SamplingParams  # noqa: E402
from dsv4.checkpoint.presets import micro  # noqa: E402
from dsv4.checkpoint.writer import random_model  # noqa: E402
from dsv4.engine.engine import LLMEngine  # noqa: E402
from dsv4.engine.request import Request  # noqa: E402
from dsv4.kernels.ref.compressor import (  # noqa: E402
    CompressIndex,
    CompressTarget,
    compress_cached,
    compress_cached_pair,
)
from dsv4.kernels.triton.compressor import (  # noqa: E402
    default_config,
    default_tokens,
    triton_compress_cached,
)
from dsv4.kernels.triton.compressor_pair import triton_compress_pair  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP32_REL = 1e-5     # max |diff| / max |ref| over the entry pool
BF16_REL = 1e-2


@dataclass(frozen=True)
class Geometry:
    ratio: int
    overlap: bool
    Dc: int
    rd: int


MICRO_C4, MICRO_IDX, MICRO_C16 = (Geometry(4, True, 32, 8), Geometry(4, True, 16, 8),
                                  Geometry(16, False, 32, 8))
FLASH_C4, FLASH_IDX, FLASH_C128 = (Geometry(4, True, 512, 64), Geometry(4, True, 128, 64),
                                   Geometry(128, False, 512, 64))


class Harness:
    """One compressor's state under the engine's metadata: a reference copy and a kernel copy."""

    def __init__(self, geo: Geometry, page_size: int, out_dtype: torch.dtype, *,
                 ring_multiplier: int = 1, knobs: dict[str, int | bool] | None = None,
                 seed: int = 0, device: str = DEVICE, ape: bool = True) -> None:
        self.geo, self.device, self.knobs = geo, torch.device(device), knobs or {}
        model = micro().replace(hca_ratio=128) if geo.ratio == 128 else micro()
        self.steps = EngineSteps(model, page_size, self.device, ring_multiplier)
        cache = self.steps.cache("csa" if geo.overlap else "hca")
        assert cache.state is not None and cache.entries is not None
        width = (2 if geo.overlap else 1) * geo.Dc
        rows, n_out = cache.state.kv.shape[0], cache.entries.shape[0]
        ring = (torch.zeros(rows, width, device=device),
                torch.full((rows, width), float("-inf"), device=device))
        self.ref = [ring[0], ring[1], torch.zeros(n_out, geo.Dc, dtype=out_dtype, device=device)]
        self.tri = [x.clone() for x in self.ref]
        self.gen = torch.Generator(device).manual_seed(seed)
        self.norm_weight = torch.rand(geo.Dc, generator=self.gen, device=device) + 0.5
        self.inv_freq = 1.0 / 10000 ** (torch.arange(0, geo.rd, 2, device=device) / geo.rd)
        self.emitted = 0
        # the gate scores' ape, added per slot by the ops; `old`: the reference on scores with the
        # ape added by position before the op (rings holding it), as the full-sequence path adds it
        self.ape = (torch.randn(geo.ratio, width, generator=self.gen, device=device) if ape
                    else None)
        self.old = [x.clone() for x in self.ref]

    def step(self, work: list[tuple[int, int]]) -> CompressIndex:
        """Run one engine step (request id -> number of new tokens); returns its CompressIndex."""
        plan = self.steps.plan(work, self.geo.ratio)
        freqs = plan.entry_pos[:, None].float() * self.inv_freq
        T, width = sum(n for _, n in work), self.ref[0].shape[1]
        kv = torch.randn(T, width, generator=self.gen, device=self.device)
        score = 2 * torch.randn(T, width, generator=self.gen, device=self.device)
        args = (plan.index, self.norm_weight, 1e-6, freqs.cos(), freqs.sin())
        compress_cached(kv, score, self.ref[0], self.ref[1], *args, self.ref[2], ape=self.ape)
        triton_compress_cached(kv, score, self.tri[0], self.tri[1], *args, self.tri[2],
                               ape=self.ape, **self.knobs)  # type: ignore[arg-type]
        if self.ape is not None:
            by_position = score + self.ape[self.steps.positions(work) % self.geo.ratio]
            compress_cached(kv, by_position, self.old[0], self.old[1], *args, self.old[2])
        self.check(plan.index)
        self.steps.release(work)
        return plan.index

    def finish(self, rid: int) -> None:
        self.steps.finish(rid)

    def check(self, index: CompressIndex) -> None:
        out_trash, ring_trash = self.ref[2].shape[0] - 1, self.ref[0].shape[0] - 1
        self.emitted += int((index.write_slot != out_trash).sum())
        assert torch.equal(self.tri[0][:-1], self.ref[0][:-1]), "ring kv differs"
        assert torch.equal(self.tri[1][:-1], self.ref[1][:-1]), "ring score differs"
        limit = FP32_REL if self.ref[2].dtype == torch.float32 else BF16_REL
        err = rel_error(self.tri[2][:-1], self.ref[2][:-1])
        assert err <= limit, f"entries: max |diff| / max |ref| = {err:.3e} > {limit:.0e}"
        if self.ape is not None:     # the ape per slot is the ape by position (module docstring)
            assert torch.equal(self.old[2][:-1], self.ref[2][:-1]), "ape per slot != by position"
        # the promise the fused single launch relies on (engine/metadata.py)
        if index.ring_reads_disjoint:
            read = set(index.src_ring[index.src_valid & ~index.from_new].tolist())
            written = set(index.ring_write[index.ring_write != ring_trash].tolist())
            assert not read & written, ("ring_reads_disjoint set but a ring row is both read "
                                        "and written")


def page_for(geo: Geometry) -> int:
    return 128 if geo.ratio == 128 else 16


def boundary_lengths(r: int) -> list[int]:
    """1, r - 1, r, r + 1, 2 r + 1 and odd lengths; for ratio 128 (interpreter time) 1, r - 1, r
    and r + 1 (two C128 windows and a partial one in one prefill: test_decode_c128_flash's
    300-token prompt)."""
    if r == 128:
        return [1, r - 1, r, r + 1]
    return sorted({1, r - 1, r, r + 1, 2 * r + 1, 3 * r - 1, 2 * r + 7 | 1})


CPU_GEOMETRIES = [pytest.param(MICRO_C4, id="micro-c4"),
                  pytest.param(MICRO_IDX, id="micro-indexer"),
                  pytest.param(MICRO_C16, id="micro-c16"),
                  pytest.param(FLASH_C4, id="flash-c4-512"),
                  pytest.param(FLASH_IDX, id="flash-indexer-128"),
                  pytest.param(FLASH_C128, id="flash-c128-512")]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# Every geometry with and without the ape and in both entry dtypes, every (ape, dtype) pair in
# three geometries: the ape (a gather term) and the dtype (the entry store's cast) are independent
# branches, so a geometry's other two pairs run no branch that its two cases and the pair's other
# geometries do not.
PREFILL_CASES = [
    pytest.param(geo.values[0], dtype.values[0], ape, id=f"{a_id}-{geo.id}-{dtype.id}")
    for i, geo in enumerate(CPU_GEOMETRIES)
    for (ape, a_id), dtype in zip(((True, "ape"), (False, "no-ape")), DTYPES[::1 - 2 * (i % 2)],
                                  strict=True)]


@pytest.mark.parametrize(("geo", "dtype", "ape"), PREFILL_CASES)
def test_prefill_batch(geo: Geometry, dtype: torch.dtype, ape: bool) -> None:
    """One multi-request prefill step, prompt lengths around window boundaries (two-launch path);
    scores raw with the ape per slot, or including it (no ape)."""
    h = Harness(geo, page_for(geo), dtype, ape=ape)
    lengths = boundary_lengths(geo.ratio) + ([2 * page_for(geo) + 5] if geo.ratio < 128 else [])
    index = h.step(list(enumerate(lengths)))
    assert not index.ring_reads_disjoint
    assert h.emitted == sum(n // geo.ratio for n in lengths)


# tokens=1 is the default of these geometries (default_tokens: 1 below Dc 64 and for Dc 512), so
# "default" runs its launch; the indexer's default of 2 is test_extend_across_pages'
KNOBS = [pytest.param({}, id="default"), pytest.param({"block_s": 2}, id="bs2-prefetch"),
         pytest.param({"block_s": 2, "prefetch": False}, id="bs2-per-chunk"),
         pytest.param({"block_s": 4, "num_warps": 2}, id="bs4-w2"),   # C4 in 2 chunks
         pytest.param({"tokens": 4}, id="tokens4"),
         pytest.param({"tokens": 2, "num_warps": 2}, id="tokens2-w2"),
         pytest.param({"ape": False}, id="no-ape"),
         pytest.param({"tokens": 4, "ape": False}, id="tokens4-no-ape")]
# V4-Flash's C4 (S 8, ratio 4, overlap, page 16) plans every step as micro-c4 does: its other
# knobs take micro-c4's branches and masks, only on wider rows
DECODE_CASES = [pytest.param(geo, k.values[0], id=f"{name}-{k.id}")
                for geo, name in ((MICRO_C4, "micro-c4"), (MICRO_C16, "micro-c16"))
                for k in KNOBS] + [
    pytest.param(FLASH_C4, k.values[0], id=f"flash-c4-512-{k.id}") for k in KNOBS[:1] + KNOBS[4:5]]


@pytest.mark.parametrize(("geo", "knobs"), DECODE_CASES)
def test_decode_across_windows(geo: Geometry, knobs: dict[str, int | bool]) -> None:
    """Prefill, then decode one token per request across several window boundaries (fused single
    launch). block_s = 2 walks the slots in chunks, the first entirely masked for an early window:
    index rows prefetched two chunks ahead (short windows' default) and per chunk (C128's path)."""
    knobs = dict(knobs)
    ape = bool(knobs.pop("ape", True))
    h = Harness(geo, page_for(geo), torch.float32, knobs=knobs, seed=1, ape=ape)
    r = geo.ratio
    prompts = [1, r - 2, 2 * r - 1, 3 * r + 1]
    h.step(list(enumerate(prompts)))
    for _ in range(2 * r + 2 if r <= 4 else r + 2):
        assert h.step([(i, 1) for i in range(len(prompts))]).ring_reads_disjoint
    assert h.emitted > len(prompts)


@pytest.mark.parametrize("knobs", KNOBS[1:3] + KNOBS[4:5])
@pytest.mark.parametrize("geo", [pytest.param(MICRO_C4, id="micro-c4"),
                                 pytest.param(MICRO_C16, id="micro-c16")])
def test_prefill_chunk_walks(geo: Geometry, knobs: dict[str, int | bool]) -> None:
    """The two-launch (prefill) path with the slots walked in chunks, both index-row schedules."""
    h = Harness(geo, page_for(geo), torch.float32, knobs=knobs, seed=8)
    lengths = boundary_lengths(geo.ratio)
    h.step(list(enumerate(lengths)))
    assert h.emitted == sum(n // geo.ratio for n in lengths)


def test_decode_c128_flash() -> None:
    """C128's default walk (index rows loaded per chunk) in decode, windows read from the ring.
    The prefetching walk over several chunks: test_decode_across_windows[micro-c16-bs2-prefetch]
    (no overlap, 8 chunks: the same branches)."""
    h = Harness(FLASH_C128, 128, torch.bfloat16, seed=2)
    h.step([(0, 126), (1, 127), (2, 254), (3, 300)])
    for _ in range(3):
        assert h.step([(i, 1) for i in range(4)]).ring_reads_disjoint
    assert h.emitted == (0 + 0 + 1 + 2) + (1 + 1 + 1 + 0)   # entries end at positions 127, 255


@pytest.mark.parametrize("geo", [pytest.param(MICRO_C4, id="micro-c4"),
                                 pytest.param(MICRO_C16, id="micro-c16"),
                                 pytest.param(FLASH_IDX, id="flash-indexer-128")])
@pytest.mark.parametrize("knobs", [pytest.param({}, id="default"),
                                   pytest.param({"tokens": 4}, id="tokens4")])
def test_extend_across_pages(geo: Geometry, knobs: dict[str, int | bool]) -> None:
    """A chunked prefill, chunks straddling page and window boundaries, beside a decode request."""
    h = Harness(geo, page_for(geo), torch.bfloat16, seed=3, knobs=knobs)
    h.step([(0, 9)])
    for chunk in (5, 11, 7, 16, 9, 3, 17):
        h.step([(0, 1), (1, chunk)])
    assert h.emitted >= (9 + 7 + 68) // geo.ratio


def test_doubled_rings_fuse_multi_token_steps() -> None:
    """ring_multiplier = 2 (speculative decoding): steps of up to S + 1 tokens still fuse."""
    h = Harness(MICRO_C4, 16, torch.float32, ring_multiplier=2, seed=4)
    h.step([(0, 13), (1, 6)])
    for n in (3, 9, 2, 9):
        assert h.step([(0, n), (1, n)]).ring_reads_disjoint
    assert not h.step([(0, 10)]).ring_reads_disjoint


# (S, Dc) -> (block_s, num_warps, num_stages): the H200 sweep's one configuration per geometry at
# every batch (benchmarks/results/compressor_h200_202611.md)
MEASURED_BEST = [((8, 512), (8, 4, 2)), ((8, 128), (8, 2, 2)), ((128, 512), (16, 4, 2))]


@pytest.mark.parametrize(("shape", "best"), MEASURED_BEST)
def test_default_config_reproduces_the_sweep(shape: tuple[int, int],
                                             best: tuple[int, int, int]) -> None:
    assert default_config(*shape) == best


def test_default_tokens_reproduce_the_sweep() -> None:
    """Indexer compressor only: 2 tokens per program (H200 sweep, compressor_h200_202611.md)."""
    assert [default_tokens(*shape) for shape, _ in MEASURED_BEST] == [1, 2, 1]


def test_default_config_is_valid_everywhere() -> None:
    for S in (1, 2, 3, 8, 16, 32, 128, 256):
        for Dc in (16, 32, 100, 128, 512, 1024):
            block_s, warps, stages = default_config(S, Dc)
            assert block_s & (block_s - 1) == 0 and 1 <= block_s <= max(2, 2 * S), (S, Dc, block_s)
            assert warps in (2, 4, 8, 16) and stages == 2, (S, Dc, warps)


@pytest.mark.parametrize("knobs", [pytest.param({}, id="default"),
                                   pytest.param({"tokens": 4}, id="tokens4")])
def test_padding_tokens_write_no_trash_row(knobs: dict[str, int]) -> None:
    """Tokens with trash write_slot and ring_write (as CUDA-graph padding rows may have) in a fused
    launch leave both trash rows as they were; the real tokens' rows match the reference."""
    h = Harness(MICRO_C4, 16, torch.float32, seed=9)
    h.step([(0, 9), (1, 14)])
    index = h.step([(0, 1), (1, 1)])
    assert index.ring_reads_disjoint
    pad = 3
    out_trash, ring_trash = h.tri[2].shape[0] - 1, h.tri[0].shape[0] - 1

    def rows(x: torch.Tensor, fill: int | bool) -> torch.Tensor:
        return torch.cat([x, torch.full((pad, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)])

    padded = CompressIndex(rows(index.src_new, 0), rows(index.src_ring, ring_trash),
                           rows(index.from_new, False), rows(index.src_valid, False),
                           rows(index.write_slot, out_trash), rows(index.ring_write, ring_trash),
                           True)
    T = padded.write_slot.shape[0]
    kv, score = torch.randn(T, 64, device=DEVICE), torch.randn(T, 64, device=DEVICE)
    cos, sin = torch.rand(T, 4, device=DEVICE), torch.rand(T, 4, device=DEVICE)
    for x in h.tri:
        x[-1] = 3.0                     # a sentinel: a zero entry written there would go unseen
    mine, ref = [x.clone() for x in h.tri], [x.clone() for x in h.tri]
    triton_compress_cached(kv, score, mine[0], mine[1], padded, h.norm_weight, 1e-6, cos, sin,
                           mine[2], **knobs)
    compress_cached(kv, score, ref[0], ref[1], padded, h.norm_weight, 1e-6, cos, sin, ref[2])
    for got, before in zip(mine, h.tri, strict=True):
        assert torch.equal(got[-1], before[-1]), "a trash row was written"
    assert torch.equal(mine[0][:-1], ref[0][:-1]) and torch.equal(mine[1][:-1], ref[1][:-1])
    assert rel_error(mine[2][:-1], ref[2][:-1]) <= FP32_REL


def test_rejects_bad_inputs() -> None:
    h = Harness(MICRO_C4, 16, torch.float32)
    index = h.step([(0, 6)])
    T = index.write_slot.shape[0]
    kv = torch.randn(T, 64, device=DEVICE)
    cos = torch.randn(T, 4, device=DEVICE)
    good = dict(kv=kv, score=kv.clone(), ring_kv=h.tri[0], ring_score=h.tri[1], index=index,
                norm_weight=h.norm_weight, eps=1e-6, cos=cos, sin=cos.clone(), out=h.tri[2])
    bad = {
        "kv bf16": dict(kv=kv.bfloat16()),
        "kv width": dict(kv=kv[:, :48].contiguous(), score=kv[:, :48].contiguous()),
        "score not contiguous": dict(score=kv.t().contiguous().t()),
        "rope wider than Dc": dict(cos=torch.randn(T, 20, device=DEVICE),
                                   sin=torch.randn(T, 20, device=DEVICE)),
        "src_new int32": dict(index=index._replace(src_new=index.src_new.int())),
        "write_slot T mismatch": dict(index=index._replace(write_slot=index.write_slot[:-1])),
        "out int8": dict(out=h.tri[2].to(torch.int8)),
        "norm weight length": dict(norm_weight=h.norm_weight[:8]),
    }
    for name, change in bad.items():
        with pytest.raises(ValueError):
            triton_compress_cached(**{**good, **change})  # type: ignore[arg-type]
            pytest.fail(f"accepted {name}")


def test_column_slices_of_one_projection() -> None:
    """kv and score as column slices of one wider tensor (a fused projection's output: one row
    stride) give their contiguous copies' results bit for bit; kv and score of two different row
    strides are refused."""
    h = Harness(MICRO_C4, 16, torch.float32)
    index = h.step([(0, 6)])
    T = index.write_slot.shape[0]
    wide = torch.randn(T, 200, device=DEVICE)
    kv, score = wide[:, :64], wide[:, 100:164]
    cos, sin = torch.rand(T, 4, device=DEVICE), torch.rand(T, 4, device=DEVICE)
    results = []
    for a, b in ((kv, score), (kv.contiguous(), score.contiguous())):
        state = [x.clone() for x in h.tri]
        triton_compress_cached(a, b, state[0], state[1], index, h.norm_weight, 1e-6, cos, sin,
                               state[2])
        results.append(state)
    assert all(torch.equal(x, y) for x, y in zip(*results, strict=True))
    with pytest.raises(ValueError, match="row stride"):
        triton_compress_cached(kv, score.contiguous(), h.tri[0], h.tri[1], index, h.norm_weight,
                               1e-6, cos, sin, h.tri[2])


def test_empty_step() -> None:
    h = Harness(MICRO_C4, 16, torch.float32)
    index = h.step([(0, 5)])
    empty = CompressIndex(*(x[:0] for x in index[:6]))
    before = [x.clone() for x in h.tri]
    kv = torch.zeros(0, 64, device=DEVICE)
    cs = torch.zeros(0, 4, device=DEVICE)
    triton_compress_cached(kv, kv, h.tri[0], h.tri[1], empty, h.norm_weight, 1e-6, cs, cs, h.tri[2])
    assert all(torch.equal(a, b) for a, b in zip(before, h.tri, strict=True))


# ---- the engine's own calls -------------------------------------------------------------------


def generate(engine: LLMEngine, prompts: list[list[int]],
             params: SamplingParams) -> list[Request]:
    reqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return reqs


def test_engine_calls_match_call_by_call() -> None:
    """Every compress and compress_pair call of a real engine run (chunked prefill, decode, a
    prefix-cache hit), replayed through the kernels on a copy of its state, matches the reference
    call. Both first requests complete a C4 window while decoding."""
    engine = LLMEngine(random_model(micro(), torch.float32, torch.device(DEVICE), seed=5),
                       EngineConfig(page_size=16, max_total_tokens=2048, chunked_prefill_size=24))
    runner = engine.runner
    calls = {"n": 0, "disjoint": 0}

    def checked(kv: torch.Tensor, score: torch.Tensor, ring_kv: torch.Tensor,
                ring_score: torch.Tensor, index: CompressIndex, *rest: object,
                ape: torch.Tensor | None = None) -> None:
        assert ape is not None, "the engine hands the op raw scores and the ape"
        out: torch.Tensor = rest[-1]  # type: ignore[assignment]
        mine = [ring_kv.clone(), ring_score.clone(), out.clone()]
        triton_compress_cached(kv, score, mine[0], mine[1], index,
                               *rest[:-1], mine[2], ape=ape)  # type: ignore[arg-type]
        compress_cached(kv, score, ring_kv, ring_score, index, *rest,  # type: ignore[arg-type]
                        ape=ape)
        assert (torch.equal(mine[0][:-1], ring_kv[:-1])
                and torch.equal(mine[1][:-1], ring_score[:-1]))
        assert rel_error(mine[2][:-1], out[:-1]) <= FP32_REL
        calls["n"] += 1
        calls["disjoint"] += index.ring_reads_disjoint

    def checked_pair(first: CompressTarget, second: CompressTarget, index: CompressIndex,
                     *rest: object) -> None:
        assert first.ape is not None and second.ape is not None
        mine = [c._replace(ring_kv=c.ring_kv.clone(), ring_score=c.ring_score.clone(),
                           out=c.out.clone()) for c in (first, second)]
        triton_compress_pair(*mine, index, *rest)  # type: ignore[arg-type]
        compress_cached_pair(first, second, index, *rest)  # type: ignore[arg-type]
        for got, want in zip(mine, (first, second), strict=True):
            assert torch.equal(got.ring_kv[:-1], want.ring_kv[:-1])
            assert torch.equal(got.ring_score[:-1], want.ring_score[:-1])
            assert rel_error(got.out[:-1], want.out[:-1]) <= FP32_REL
        calls["pair"] += 1

    calls["pair"] = 0
    runner.ops = replace(runner.ops, compress=checked, compress_pair=checked_pair)
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(2, 512, (37,), generator=g).tolist()
    prompts = [shared, torch.randint(2, 512, (21,), generator=g).tolist()]
    # decode positions 37-39 and 21-23: windows end at 39 and 23
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    generate(engine, prompts, params)
    hit = generate(engine, [shared + [7, 8, 9]], params)
    assert hit[0].cached_tokens >= 32, "the third request was meant to hit the prefix cache"
    assert calls["n"] > 0 and 0 < calls["disjoint"] < calls["n"] and calls["pair"] > 0


# ---- GPU: every prefill length 1..1024, long decode, graph capture -----------------------------

GPU_GEOMETRIES = [pytest.param(FLASH_C4, id="flash-c4-512"),
                  pytest.param(FLASH_IDX, id="flash-indexer-128"),
                  pytest.param(FLASH_C128, id="flash-c128-512"),
                  pytest.param(MICRO_C16, id="micro-c16")]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("geo", GPU_GEOMETRIES)
def test_every_prefill_length_cuda(geo: Geometry, dtype: torch.dtype) -> None:
    """Prompt lengths 1..1024 in multi-request steps of <= 8192 tokens and <= 64 requests."""
    lengths, step, rid = list(range(1, 1025)), [], 0
    h = Harness(geo, 256, dtype, seed=5)
    for n in lengths:
        if step and (sum(k for _, k in step) + n > 8192 or len(step) == 64):
            h.step(step)
            for done, _ in step:
                h.finish(done)
            step = []
        step.append((rid, n))
        rid += 1
    h.step(step)
    assert h.emitted == sum(n // geo.ratio for n in lengths)


GPU_TOKEN_KNOBS = [pytest.param({"tokens": 1}, id="tokens1"),
                   pytest.param({"tokens": 4}, id="tokens4"),
                   pytest.param({"tokens": 8, "num_warps": 8}, id="tokens8-w8")]


LONG_DECODE = [pytest.param(g.values[0], {}, id=f"{g.id}-default") for g in GPU_GEOMETRIES] + [
    pytest.param(geo, k.values[0], id=f"{name}-{k.id}")
    for geo, name in ((FLASH_C4, "flash-c4-512"), (FLASH_IDX, "flash-indexer-128"))
    for k in GPU_TOKEN_KNOBS]


@pytest.mark.gpu
@pytest.mark.parametrize("geo,knobs", LONG_DECODE)
def test_long_decode_and_extend_cuda(geo: Geometry, knobs: dict[str, int]) -> None:
    """64 requests decode 2 * ratio + 3 steps (every window boundary), then extend by odd chunks
    across pages; short windows also at 1, 4 and 8 tokens per program (the indexer's default: 2)."""
    h = Harness(geo, 256, torch.bfloat16, seed=6, knobs=knobs)
    h.step([(i, 1 + 37 * i % 300) for i in range(64)])
    for _ in range(2 * geo.ratio + 3):
        assert h.step([(i, 1) for i in range(64)]).ring_reads_disjoint
    for chunk in (255, 257, 1, 513, 129):
        h.step([(i, chunk if i % 8 == 0 else 1) for i in range(64)])


@pytest.mark.gpu
def test_cuda_graph_replay_matches_reference() -> None:
    h = Harness(FLASH_C4, 256, torch.bfloat16, seed=7)
    h.step([(i, 3 + 5 * i) for i in range(32)])
    index = h.step([(i, 1) for i in range(32)])
    T = index.write_slot.shape[0]
    kv, score = torch.randn(T, 1024, device="cuda"), torch.randn(T, 1024, device="cuda")
    cos, sin = torch.rand(T, 32, device="cuda"), torch.rand(T, 32, device="cuda")
    state = [x.clone() for x in h.tri]
    ref = [x.clone() for x in h.tri]
    # warm-up
    triton_compress_cached(kv, score, *state[:2], index, h.norm_weight, 1e-6, cos, sin, state[2])
    state = [x.copy_(y) for x, y in zip(state, h.tri, strict=True)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_compress_cached(kv, score, *state[:2], index, h.norm_weight, 1e-6, cos, sin,
                               state[2])
    kv.normal_()
    score.normal_()
    graph.replay()
    compress_cached(kv, score, *ref[:2], index, h.norm_weight, 1e-6, cos, sin, ref[2])
    assert torch.equal(state[0][:-1], ref[0][:-1]) and torch.equal(state[1][:-1], ref[1][:-1])
    assert rel_error(state[2][:-1], ref[2][:-1]) <= BF16_REL
