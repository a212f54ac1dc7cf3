"""Parity of `triton_compress_pair` with the reference pair op (`compress_cached_pair`).

`triton_compress_pair` serves a CSA layer's two compressors in one launch. A harness drives the
engine's own metadata (`build_context` over a real request table) and keeps three copies of a CSA
layer's two compressor states (attention: overlap Dc_a; indexer: overlap Dc_b; one plan for both):
the reference pair op's, the fused kernel's, and two single `triton_compress_cached` calls'. After
every step: rings bit-equal to the reference and to the single kernels', entries within 1e-5
(fp32) / 1e-2 (bf16) of both. On the H200 the fused and single kernels' entries differ in
rounding: other warp counts, other summation orders. The scores are raw, and the ops add each
compressor's `ape` per slot, as the serving path runs them (`ape=False`: scores that include
it). The default (`fuse=None`) fuses steps of up to 512 tokens; tests force each path.

    PYTHONPATH=src python -m pytest -q tests/kernels/test_compressor_pair.py  # interpreter on CPU
    PYTHONPATH=src python -m pytest -q -m gpu tests/kernels/test_compressor_pair.py  # on CUDA
"""

from __future__ import annotations

import os

import torch

# NOTE: must precede the first `import triton` (tests/kernels/conftest.py may already do it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from compress_steps import EngineSteps, rel_error  # noqa: E402

from dsv4.checkpoint.presets import micro  # noqa: E402
from dsv4.kernels.ref.compressor import (  # noqa: E402
    CompressIndex,
    CompressTarget,
    compress_cached_pair,
)
from dsv4.kernels.registry import create_kernels  # noqa: E402
from dsv4.kernels.triton import compressor_pair  # noqa: E402
from dsv4.kernels.triton.compressor import triton_compress_cached  # noqa: E402
from dsv4.kernels.triton.compressor_pair import triton_compress_pair  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


class PairHarness:
    """A CSA layer's two compressor states under the engine's metadata: reference, fused kernel,
    single kernels."""

    def __init__(self, dcs: tuple[int, int], rd: int, page_size: int, out_dtype: torch.dtype,
                 seed: int = 0, knobs: dict[str, int | bool] | None = None,
                 ape: bool = True) -> None:
        self.dcs, self.rd, self.device, self.knobs = dcs, rd, torch.device(DEVICE), knobs or {}
        self.steps = EngineSteps(micro(), page_size, self.device)
        cache = self.steps.cache("csa")
        assert cache.state is not None and cache.entries is not None
        rows, n_out = cache.state.kv.shape[0], cache.entries.shape[0]
        self.gen = torch.Generator(DEVICE).manual_seed(seed)
        self.states: dict[str, list[list[torch.Tensor]]] = {}
        base = [[torch.zeros(rows, 2 * dc, device=DEVICE),
                 torch.full((rows, 2 * dc), float("-inf"), device=DEVICE),
                 torch.zeros(n_out, dc, dtype=out_dtype, device=DEVICE)] for dc in dcs]
        for name in ("ref", "pair", "single"):
            self.states[name] = [[x.clone() for x in s] for s in base]
        self.weights = [torch.rand(dc, generator=self.gen, device=DEVICE) + 0.5 for dc in dcs]
        self.apes = [torch.randn(4, 2 * dc, generator=self.gen, device=DEVICE) if ape else None
                     for dc in dcs]
        self.inv_freq = 1.0 / 10000 ** (torch.arange(0, rd, 2, device=DEVICE) / rd)
        self.emitted = 0

    def finish(self, rid: int) -> None:
        self.steps.finish(rid)

    def targets(self, name: str,
                proj: list[tuple[torch.Tensor, torch.Tensor]]) -> list[CompressTarget]:
        return [CompressTarget(kv, score, s[0], s[1], w, s[2], a) for (kv, score), s, w, a
                in zip(proj, self.states[name], self.weights, self.apes, strict=True)]

    def step(self, work: list[tuple[int, int]]) -> CompressIndex:
        plan = self.steps.plan(work, 4)
        freqs = plan.entry_pos[:, None].float() * self.inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        T = sum(n for _, n in work)
        proj = [(torch.randn(T, 2 * dc, generator=self.gen, device=DEVICE),
                 2 * torch.randn(T, 2 * dc, generator=self.gen, device=DEVICE)) for dc in self.dcs]
        compress_cached_pair(*self.targets("ref", proj), plan.index, EPS, cos, sin)
        triton_compress_pair(*self.targets("pair", proj), plan.index, EPS, cos, sin, **self.knobs)
        for c in self.targets("single", proj):
            triton_compress_cached(c.kv, c.score, c.ring_kv, c.ring_score, plan.index,
                                   c.norm_weight, EPS, cos, sin, c.out, ape=c.ape)
        self.check(plan.index)
        self.steps.release(work)
        return plan.index

    def check(self, index: CompressIndex) -> None:
        self.emitted += int((index.write_slot != self.states["ref"][0][2].shape[0] - 1).sum())
        for j in range(2):
            ref, pair, single = (self.states[n][j] for n in ("ref", "pair", "single"))
            assert (torch.equal(pair[0][:-1], ref[0][:-1])
                    and torch.equal(pair[1][:-1], ref[1][:-1])), f"ring {j}"
            limit = 1e-5 if ref[2].dtype == torch.float32 else 1e-2
            assert rel_error(pair[2][:-1], ref[2][:-1]) <= limit, f"entries {j}"
            assert (torch.equal(pair[0][:-1], single[0][:-1])
                    and torch.equal(pair[1][:-1], single[1][:-1]))
            assert rel_error(pair[2][:-1], single[2][:-1]) <= limit, (f"entries {j}: fused vs "
                                                                      "single kernel")


MICRO, FLASH = ((32, 16), 8), ((512, 128), 64)
# Each geometry with and without the ape and in both entry dtypes, every (ape, dtype) pair in one
# of them: the ape (a gather term) and the dtype (the entry stores' cast) are independent
# branches, so a geometry's other two pairs run no branch that these cases do not.
DECODE_CASES = [pytest.param(MICRO, torch.float32, True, id="ape-micro-fp32"),
                pytest.param(MICRO, torch.bfloat16, False, id="no-ape-micro-bf16"),
                pytest.param(FLASH, torch.bfloat16, True, id="ape-flash-bf16"),
                pytest.param(FLASH, torch.float32, False, id="no-ape-flash-fp32")]


@pytest.mark.parametrize(("geo", "dtype", "ape"), DECODE_CASES)
def test_decode_across_windows(geo: tuple[tuple[int, int], int], dtype: torch.dtype,
                               ape: bool) -> None:
    """Prefill (three-launch path), then decode across window boundaries (one fused launch): six
    steps take every request over a window boundary (ratio 4) and two of them over two, around
    the two-window ring."""
    h = PairHarness(geo[0], geo[1], 16, dtype, seed=1, ape=ape)
    prompts = [1, 2, 7, 13]
    index = h.step(list(enumerate(prompts)))
    assert not index.ring_reads_disjoint
    for _ in range(6):
        assert h.step([(i, 1) for i in range(len(prompts))]).ring_reads_disjoint
    assert h.emitted > len(prompts)


@pytest.mark.parametrize("knobs", [pytest.param({"num_warps": 2}, id="fused-2w"),
                                   pytest.param({"fuse": False}, id="two-launches")])
def test_extend_across_pages_beside_decode(knobs: dict[str, int | bool]) -> None:
    h = PairHarness(*MICRO, 16, torch.bfloat16, seed=3, knobs=knobs)
    h.step([(0, 9)])
    for chunk in (5, 11, 7, 16, 9, 3, 17):
        h.step([(0, 1), (1, chunk)])
    assert h.emitted >= (9 + 7 + 68) // 4


def test_rejects_what_one_plan_cannot_address() -> None:
    h = PairHarness(*MICRO, 16, torch.float32)
    index = h.step([(0, 6)])
    T = index.write_slot.shape[0]
    cos = torch.rand(T, 4, device=DEVICE)
    proj = [(torch.randn(T, 2 * dc, device=DEVICE), torch.randn(T, 2 * dc, device=DEVICE))
            for dc in h.dcs]
    a, b = h.targets("pair", proj)
    short_ring = b._replace(ring_kv=b.ring_kv[:-2], ring_score=b.ring_score[:-2])
    short_out = b._replace(out=b.out[:-1])
    # no overlap
    one_wide = b._replace(kv=b.kv[:, :16].contiguous(), score=b.score[:, :16].contiguous())
    for bad in (short_ring, short_out, one_wide):
        with pytest.raises(ValueError):
            triton_compress_pair(a, bad, index, EPS, cos, cos.clone())
    assert b.ape is not None
    with pytest.raises(ValueError, match="both targets carry an ape or neither"):
        triton_compress_pair(a, b._replace(ape=None), index, EPS, cos, cos.clone())
    with pytest.raises(ValueError, match="ape must be"):           # [ratio, 2 Dc]
        triton_compress_pair(a, b._replace(ape=b.ape[:2]), index, EPS, cos, cos.clone())


@pytest.mark.parametrize("invariant", [False, True], ids=["auto-plan", "invariant-plans"])
def test_invariant_plans_run_the_pair_as_singles_at_any_step_size(
        invariant: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under token-count-invariant plans (`create_kernels(..., invariant_plans=True)`, RL) a
    6-token step takes the path of a > 512-token step (two single launches), so an entry's
    rounding never depends on the step's size; the automatic plan fuses the small step."""
    h = PairHarness(*MICRO, 16, torch.float32)
    index = h.step([(0, 6)])
    T = index.write_slot.shape[0]
    proj = [(torch.randn(T, 2 * dc, device=DEVICE), torch.randn(T, 2 * dc, device=DEVICE))
            for dc in h.dcs]
    launches: list[str] = []

    class FusedSpy:
        def __getitem__(self, grid: object) -> object:
            return lambda *a, **k: launches.append("fused")
    monkeypatch.setattr(compressor_pair, "_compress_pair_kernel", FusedSpy())
    monkeypatch.setattr(compressor_pair, "launch_compress",
                        lambda *a, **k: launches.append("single"))
    ops = create_kernels("triton", invariant_plans=invariant)
    cos = torch.rand(T, 4, device=DEVICE)
    ops.compress_pair(*h.targets("pair", proj), index, EPS, cos, cos.clone())
    assert launches == (["single", "single"] if invariant else ["fused"])


# ---- GPU: V4-Flash geometry (attention Dc 512 + indexer Dc 128), long decode, graph capture ----


@pytest.mark.gpu
def test_long_decode_and_extend_cuda() -> None:
    h = PairHarness(*FLASH, 256, torch.bfloat16, seed=6)
    h.step([(i, 1 + 37 * i % 300) for i in range(64)])
    for _ in range(11):
        assert h.step([(i, 1) for i in range(64)]).ring_reads_disjoint
    for chunk in (255, 257, 1, 513, 129):
        h.step([(i, chunk if i % 8 == 0 else 1) for i in range(64)])


@pytest.mark.gpu
@pytest.mark.parametrize("warps", (2, 4, 8))
def test_prefill_lengths_cuda(warps: int) -> None:
    """Prompt lengths 1..300 in multi-request steps of 60, each followed by two decode steps, at
    each warp count."""
    h = PairHarness(*FLASH, 256, torch.bfloat16, seed=warps,
                    knobs={"num_warps": warps, "fuse": True})
    for first in range(1, 301, 60):
        batch = range(first, first + 60)
        h.step([(n, n) for n in batch])
        for _ in range(2):
            h.step([(n, 1) for n in batch])
        for n in batch:
            h.finish(n)
    assert h.emitted >= sum(n // 4 for n in range(1, 301))


@pytest.mark.gpu
def test_cuda_graph_replay_matches_reference() -> None:
    h = PairHarness(*FLASH, 256, torch.bfloat16, seed=7)
    h.step([(i, 3 + 5 * i) for i in range(32)])
    index = h.step([(i, 1) for i in range(32)])
    T = index.write_slot.shape[0]
    cos, sin = torch.rand(T, 32, device="cuda"), torch.rand(T, 32, device="cuda")
    proj = [(torch.randn(T, 2 * dc, device="cuda"), torch.randn(T, 2 * dc, device="cuda"))
            for dc in h.dcs]
    h.states["graph"] = [[x.clone() for x in s] for s in h.states["pair"]]
    triton_compress_pair(*h.targets("graph", proj), index, EPS, cos, sin)  # warm-up (compile)
    for s, base in zip(h.states["graph"], h.states["pair"], strict=True):
        for x, y in zip(s, base, strict=True):
            x.copy_(y)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_compress_pair(*h.targets("graph", proj), index, EPS, cos, sin)
    for kv, score in proj:
        kv.normal_()
        score.normal_()
    graph.replay()
    compress_cached_pair(*h.targets("ref", proj), index, EPS, cos, sin)
    for got, want in zip(h.states["graph"], h.states["ref"], strict=True):
        assert torch.equal(got[0][:-1], want[0][:-1]) and torch.equal(got[1][:-1], want[1][:-1])
        assert rel_error(got[2][:-1], want[2][:-1]) <= 1e-2
