"""Parity of `lightning_topk` with the reference `topk_ragged` (exact equality: exact tie rule).

CPU: small rows under the Triton interpreter, with shrunken `TopKConfig` thresholds so both paths
(row, compact) and both compact modes (bound, exact) and every boundary (+-1) are reached: row_max,
chunk and block edges, exact_max; ragged lengths k-1, k, k+1, 0 and > N; exact ties (small integer
sets, all-equal rows, +-0.0), NaN of both signs (ranked above +inf, as `torch.sort` does), -inf; a
K1 bin below the true one (the tail's rescan); scratch overflow (heavy ties); one garbage-filled
workspace reused call after call (K1 zeroes K2's counters, no memset); `to_slots` with a permuted
page table. On a CUDA machine the same tests run compiled on the GPU, and `-m gpu` adds real shapes
(N up to 262,144, batch 1..300, k 512..2048) and CUDA-graph replay.

    PYTHONPATH=src python -m pytest -q tests/kernels/test_topk.py           # interpreter on CPU
    PYTHONPATH=src python -m pytest -q tests/kernels/test_topk.py -m gpu    # on a CUDA machine
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

# NOTE: must precede the first `import triton` / @triton.jit (tests/kernels/conftest.py may already
# do this).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from dsv4.kernels.ref.indexer import topk_lower_index  # noqa: E402
from dsv4.kernels.ref.topk import to_slots, topk_ragged  # noqa: E402
from dsv4.kernels.triton.topk import (  # noqa: E402
    TopKConfig,
    lightning_topk,
    plan_topk,
    topk_workspace_numel,
)
from dsv4.kernels.triton.topk_radix import bin_floor, order_key  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DISTS = ("randn", "ints", "equal", "inf", "nan", "signed_zeros", "sparse")

# Shrunken thresholds: rows <= 64 in registers; longer rows in chunks of 64-128 scores (K1 blocks of
# 64 = 16 groups of 4), compaction steps of 16 (32 on small grids), at most 16 programs per launch.
# Under the interpreter every program runs in sequence, so keep programs few; tail lists over 16
# entries take the multi-pass finish, shorter ones the register one; the tail's passes step over
# the candidate lists 32 at a time (lists of a few hundred: many steps, the last one masked);
# bound-mode chunks of <= 16 candidates take the tail's one-tile scratch pass (chunk_tile 256 over
# 16 chunk rows), fuller ones its loop. The coop path (small batches by default) is off here:
# tests/kernels/test_topk_coop.py covers it. EXACT: K1 histograms every key and the candidate list
# is contiguous. NARROW: never the small-grid compaction step.
SMALL = TopKConfig(row_max=64, block=64, compact_block=16, tail_block=32, small_block=16,
                   target_programs=16, max_chunk=128, max_hist_splits=4, group=4, exact_max=0,
                   finish_block=16, chunk_tile=256, coop_programs=0)
EXACT = replace(SMALL, exact_max=1 << 30)
NARROW = replace(SMALL, wide_programs=0)


def make_scores(B: int, N: int, dist: str, seed: int = 0, k: int = 8) -> torch.Tensor:
    """[B, N] fp32 scores with the requested tie structure."""
    g = torch.Generator().manual_seed(seed)
    if dist == "randn":
        x = torch.randn(B, N, generator=g)
    elif dist == "ints":                     # a small integer set: most scores tie
        x = torch.randint(-2, 3, (B, N), generator=g).float()
    elif dist == "equal":
        x = torch.full((B, N), 0.75)
    elif dist == "inf":
        # -inf inside the length is a valid, last-ranked candidate
        x = torch.randn(B, N, generator=g)
        x[torch.rand(B, N, generator=g) < 0.5] = float("-inf")
        x[torch.rand(B, N, generator=g) < 0.02] = float("inf")
        x[-1] = float("-inf")
    elif dist == "nan":
        # NaN of either sign ranks above +inf; NaNs tie (lower index first)
        x = torch.randn(B, N, generator=g)
        x[torch.rand(B, N, generator=g) < 0.03] = float("inf")
        nan = torch.rand(B, N, generator=g) < 0.03
        x[nan] = torch.where(torch.rand(B, N, generator=g) < 0.5, float("nan"),
                             -float("nan"))[nan]
    elif dist == "signed_zeros":
        # ReLU-like: exact zeros of both signs tie with each other
        x = (torch.relu(torch.randn(B, N, generator=g))
             * torch.where(torch.rand(B, N, generator=g) < 0.5, -1.0, 1.0))
    elif dist == "sparse":
        # k // 2 positives anywhere, +-0.0 elsewhere: the k-th largest is a zero tie spread over
        # every chunk
        sign = torch.where(torch.rand(B, N, generator=g) < 0.5, -1.0, 1.0)
        x = torch.zeros(B, N) * sign
        for b in range(B):
            x[b, torch.randperm(N, generator=g)[: k // 2]] = torch.rand(k // 2, generator=g) + 0.5
    else:
        raise ValueError(dist)
    return x.contiguous().to(DEVICE)


def ragged_lengths(B: int, N: int, k: int, seed: int = 0) -> torch.Tensor:
    """Row lengths cycling through N, k - 1, k, k + 1, 0, > N, then random ones."""
    g = torch.Generator().manual_seed(seed)
    special = [N, k - 1, k, k + 1, 0, N + 5]
    lengths = [special[i] if i < len(special) else int(torch.randint(0, N + 1, (1,), generator=g))
               for i in range(B)]
    return torch.tensor(lengths, dtype=torch.int64).clamp(min=0).to(DEVICE)


def reference(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """`topk_ragged` computed on the CPU, whose sort ranks every NaN above +inf (the kernel's
    contract). CUDA's sort orders NaN by its bits (a negative NaN ranks last, as on the H200): the
    one device dependence of the reference (`ref/topk.py`)."""
    return topk_ragged(scores.cpu(), lengths.cpu(), k).to(scores.device)


def check(scores: torch.Tensor, lengths: torch.Tensor, k: int, config: TopKConfig, path: str,
          workspace: torch.Tensor | None = None) -> None:
    B, N = scores.shape
    assert plan_topk(B, N, config).name == path, (plan_topk(B, N, config), path)
    out = lightning_topk(scores, lengths, k, config=config, workspace=workspace)
    ref = reference(scores, lengths, k)
    assert out.dtype == torch.int64 and out.shape == (B, k)
    if not torch.equal(out, ref):
        row = int((out != ref).any(dim=1).nonzero()[0])
        raise AssertionError(f"row {row} (len {int(lengths[row])}): got {out[row].tolist()} "
                             f"want {ref[row].tolist()}")


# --------------------------------------------------------------------------------------------- plan


def test_plan_default_thresholds() -> None:
    assert plan_topk(256, 4096).name == "row"
    # B * P <= 132 programs
    assert plan_topk(1, 4097).name == "coop" and plan_topk(4, 262144).name == "coop"
    assert (plan_topk(5, 262144).name == "compact-bound"
            and plan_topk(40, 65536).name == "compact-bound")
    c = replace(TopKConfig(), coop_programs=0)
    assert plan_topk(1, 4097, c).name == "compact-exact"
    assert (plan_topk(4, 262144, c).name == "compact-exact"
            and plan_topk(5, 262144, c).name == "compact-bound")
    one = plan_topk(1, 262144, c).compact
    assert (one is not None and (one.splits, one.chunk, one.hist_splits, one.hist_chunk)
            == (64, 4096, 64, 4096))
    assert one.compact_block == 2048                              # one program per SM: longer steps
    wide = plan_topk(64, 262144).compact
    assert (wide is not None and (wide.splits, wide.chunk, wide.hist_splits, wide.hist_chunk)
            == (32, 8192, 8, 32768))
    # many programs per SM: 2 warps
    assert (wide.group, wide.compact_block, wide.warps) == (4, 1024, 2)
    assert plan_topk(4096, 8192).splits == 1                      # huge batches: a program per row
    assert topk_workspace_numel(8, 4096, 512) == 0                # the row path needs none
    # int64 candidate slots for every score
    assert topk_workspace_numel(1, 262144, 512, c) >= 2 * 262144
    # coop: histograms, counts, a tie list
    assert topk_workspace_numel(1, 262144, 512) < 10000


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="power of two"):
        TopKConfig(block=48)
    with pytest.raises(ValueError, match=">= 16"):
        TopKConfig(block=64, group=8)
    with pytest.raises(ValueError, match="row_max"):
        TopKConfig(row_max=20000)


def test_bin_floor_matches_keys() -> None:
    """`not (x < bin_floor(d))` == `order_key(x) >= d << 24` for all 256 digits, on specials and
    random bits."""

    @triton.jit
    def _kernel(x_ptr, out_ptr, M: tl.constexpr):  # type: ignore[no-untyped-def]
        x = tl.load(x_ptr + tl.arange(0, M))
        for d in range(0, 256):
            by_float = ~(x < bin_floor(tl.full([], d, tl.int32)))
            by_key = order_key(x) >= (tl.full([], d, tl.uint32) << 24)
            tl.store(out_ptr + d * M + tl.arange(0, M), (by_float == by_key).to(tl.int32))

    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan"),
                            1.0, -1.0, 1e-40, -1e-40, 3.4e38, -3.4e38, 1.1754944e-38,
                            -1.1754944e-38, 2.0, 0.5])
    bits = torch.randint(-2**31, 2**31 - 1, (512 - special.numel(),),
                         generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    x = torch.cat([special, bits.view(torch.float32)]).to(DEVICE)
    out = torch.zeros(256 * 512, dtype=torch.int32, device=DEVICE)
    _kernel[(1,)](x, out, M=512)
    assert bool(out.all())


# ------------------------------------------------------------------------------------------- parity


@pytest.mark.parametrize("dist", DISTS)
@pytest.mark.parametrize("path,config,B,N,k", [
    ("row", SMALL, 6, 50, 8),
    ("row", TopKConfig(), 6, 1000, 16),          # default config: 1024-wide register row
    ("compact-bound", SMALL, 6, 300, 8),         # 3 K2 chunks of 128 per row, K1 2 chunks
    ("compact-exact", EXACT, 6, 300, 8),
    # 5 chunks of 128, the last ragged: the tail maps positions across chunks
    ("compact-bound", SMALL, 2, 600, 24),
    ("compact-exact", EXACT, 2, 600, 24),        # 4 chunks, one contiguous candidate list
])
def test_parity_paths(path: str, config: TopKConfig, B: int, N: int, k: int, dist: str) -> None:
    scores = make_scores(B, N, dist, seed=N + B, k=k)
    check(scores, ragged_lengths(B, N, k), k, config, path)


# NARROW plans as SMALL's (2, 600, 24) case but for K2's compaction step (16, not 32), whose
# control flow does not depend on the scores: it packs the same candidate lists, which the tail
# finishes for every dist in that case. Here: -inf, NaN and +-0.0 at K2's floor compare.
@pytest.mark.parametrize("dist", ("inf", "nan", "sparse"))
def test_parity_narrow_compaction(dist: str) -> None:
    B, N, k = 2, 600, 24
    check(make_scores(B, N, dist, seed=N + B, k=k), ragged_lengths(B, N, k), k, NARROW,
          "compact-bound")


@pytest.mark.parametrize("B,N,config,path", [
    # row_max +-1
    (2, 63, SMALL, "row"), (2, 64, SMALL, "row"), (2, 65, SMALL, "compact-bound"),
    # block / chunk edges
    (1, 127, SMALL, "compact-bound"), (1, 128, SMALL, "compact-bound"),
    (1, 129, SMALL, "compact-bound"), (1, 191, SMALL, "compact-bound"),
    (1, 193, SMALL, "compact-bound"),
    # one program per row (B >= target_programs): one chunk of 128, the plan SMALL gives 16 or 17
    # rows of 80 (15 rows take two chunks, as the rows above)
    (2, 80, replace(SMALL, target_programs=2), "compact-bound"),
    # exact_max +-1 (B * N = 258)
    (2, 129, replace(SMALL, exact_max=259), "compact-exact"),
    (2, 129, replace(SMALL, exact_max=258), "compact-exact"),
    (2, 129, replace(SMALL, exact_max=257), "compact-bound"),
])
def test_path_boundaries(B: int, N: int, config: TopKConfig, path: str) -> None:
    for seed, dist in enumerate(("randn", "sparse", "nan")):
        scores = make_scores(B, N, dist, seed=seed, k=7)
        lengths = torch.full((B,), N, dtype=torch.int64, device=DEVICE)
        check(scores, lengths, 7, config, path)


# compact rows of 3 chunks of 64, the last ragged (2 scores)
@pytest.mark.parametrize("config,path,N", [(SMALL, "row", 40), (SMALL, "compact-bound", 130),
                                           (EXACT, "compact-exact", 130)])
def test_k_at_and_beyond_lengths(config: TopKConfig, path: str, N: int) -> None:
    scores = make_scores(3, N, "ints", seed=1)
    for k in (1, N - 1, N, N + 1, N + 40):
        lengths = torch.tensor([N, k - 1, max(k - 1, 0) // 2], dtype=torch.int32, device=DEVICE)
        check(scores, lengths, k, config, path)


# `sample` sets only K1's block stride, whose control flow does not depend on the scores: every
# dist runs under one of the two samplings, each sampling under three or four dists
@pytest.mark.parametrize("sample,dist", [(4, "randn"), (4, "ints"), (4, "inf"), (4, "nan"),
                                         (2, "equal"), (2, "signed_zeros"), (2, "sparse")])
def test_sampled_histograms(sample: int, dist: str) -> None:
    """Bound mode with K1 histogramming every sample-th block (one K1 chunk of 15 blocks per row):
    still exact, as any subset's histogram bounds the k-th largest from below; ragged rows shorter
    than 16 * sample * k are histogrammed whole."""
    config = replace(SMALL, sample=sample, max_hist_splits=1)
    assert plan_topk(2, 1000, config).compact.sample == sample      # type: ignore[union-attr]
    check(make_scores(2, 1000, dist, seed=sample, k=8), ragged_lengths(2, 1000, 8, seed=sample), 8,
          config, "compact-bound")


def test_scaled_k() -> None:
    """k / N like 512 / 262144 (a few percent: test_parity_paths' (2, 600, 24), bound and exact,
    every dist)."""
    B, N, k = 2, 2048, 4
    for dist in ("randn", "signed_zeros"):
        check(make_scores(B, N, dist, seed=k, k=k), ragged_lengths(B, N, k, seed=k), k, SMALL,
              "compact-bound")


@pytest.mark.parametrize("exact_max", (1 << 20, 0))
def test_default_config_long_rows(exact_max: int) -> None:
    """The shipped blocks (4096 / 2048 / 1024), several chunks per row, both modes."""
    config = replace(TopKConfig(), exact_max=exact_max, coop_programs=0)
    for B, N, k, dist in ((2, 40000, 64, "randn"), (3, 20000, 512, "nan"), (2, 9000, 40, "sparse")):
        scores = make_scores(B, N, dist, seed=B, k=k)
        check(scores, ragged_lengths(B, N, k, seed=B), k, config, plan_topk(B, N, config).name)


def test_bound_mode_low_bin_rescans() -> None:
    """Top scores clustered in a few K1 groups: K1's bin is below the true one, so the tail rescans
    digit 1."""
    B, N, k = 2, 256, 8
    scores = torch.full((B, N), 0.3)                     # digit-0 bin [0.125, 0.5)
    block, group = SMALL.block, SMALL.group
    stride = block // group                              # members of a K1 group are `stride` apart
    # 2 groups x 4 members = the 8 winners, bin [2, 8)
    for j, col in enumerate((0, 1)):
        for m in range(group):
            scores[:, col + m * stride] = 2.0 + j + 0.1 * m
    scores[1, 100:140] = torch.linspace(0.31, 0.49, 40)  # ties broken differently in the second row
    check(scores.to(DEVICE), torch.full((B,), N, device=DEVICE), k, SMALL, "compact-bound")


def test_workspace_reused_with_garbage() -> None:
    """One garbage-filled workspace, many calls, varying shapes: K1 re-zeroes K2's counters every
    call."""
    numel = max(topk_workspace_numel(B, N, k, SMALL)
                for B, N, k in ((3, 300, 8), (2, 600, 24), (6, 130, 130)))
    workspace = torch.randint(-2**31, 2**31 - 1, (numel,), dtype=torch.int32, device=DEVICE)
    for step, (B, N, k, dist) in enumerate([(3, 300, 8, "randn"), (2, 600, 24, "ints"),
                                            (3, 300, 8, "nan"), (6, 130, 130, "sparse"),
                                            (3, 300, 8, "randn")]):
        scores = make_scores(B, N, dist, seed=step, k=k)
        check(scores, ragged_lengths(B, N, k, seed=step), k, SMALL, "compact-bound",
              workspace=workspace)
    # default: a fresh buffer from the allocator per call
    for _ in range(2):
        check(make_scores(3, 300, "randn", seed=7), ragged_lengths(3, 300, 8), 8, SMALL,
              "compact-bound")
    with pytest.raises(ValueError, match="workspace"):
        lightning_topk(make_scores(3, 300, "randn"), ragged_lengths(3, 300, 8), 8, config=SMALL,
                       workspace=workspace[:10])


@pytest.mark.parametrize("case", ["pass0", "n_le_k", "pass1", "gauss", "no_exit"])
def test_row_whole_bin_exits(case: str) -> None:
    """The row path stops its radix passes once a pass's bin is kept whole (its count is the keys
    still wanted): the k winners split at a digit-0 bin edge (stops after pass 0), fewer
    candidates than k (pass 0), at a digit-1 edge (pass 1), Gaussian rows (mostly pass 1 or 2),
    and all-equal rows (never stops: the tie rule picks the lower indices). Exact either way."""
    g = torch.Generator().manual_seed(len(case))
    n, k = 1000, 512
    if case == "pass0":     # 512 scores in [64, 128), the rest in [0.5, 1): one digit-0 bin each
        s = torch.cat((64 + 63 * torch.rand(512, generator=g), 0.5 + 0.4 * torch.rand(488,
                                                                             generator=g)))
    elif case == "n_le_k":
        n, s = 300, torch.randn(300, generator=g)
    elif case == "pass1":   # [1.0, 1.5) and [1.5, 2.0) share digit 0, differ in digit 1
        s = torch.cat((1.5 + 0.4 * torch.rand(512, generator=g), 1.0 + 0.4 * torch.rand(488,
                                                                               generator=g)))
    elif case == "gauss":
        s = torch.randn(n, generator=g)
    else:
        s = torch.full((n,), 0.25)
    scores = s[torch.randperm(n, generator=g)][None].to(DEVICE).contiguous()
    for lengths in ([n], [n - 1], [k]):
        lens = torch.tensor(lengths, device=DEVICE)
        assert plan_topk(1, n).path == "row"
        assert torch.equal(lightning_topk(scores, lens, k), topk_ragged(scores, lens, k)), lengths


def test_reference_matches_topk_lower_index() -> None:
    """On full rows the reference picks exactly the set `topk_lower_index` ranks first."""
    for dist in DISTS:
        if dist == "nan":
            continue        # topk_lower_index orders NaN by torch.topk, not by torch.sort
        scores = make_scores(4, 300, dist, seed=2)
        full = torch.full((4,), 300, dtype=torch.int64, device=DEVICE)
        expect = torch.sort(topk_lower_index(scores, 37), dim=-1).values
        assert torch.equal(topk_ragged(scores, full, 37), expect), dist


def test_empty_and_degenerate() -> None:
    scores = make_scores(2, 30, "randn")
    zero = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    assert torch.equal(lightning_topk(scores, zero, 5), torch.full((2, 5), -1, device=DEVICE))
    assert torch.equal(lightning_topk(make_scores(2, 300, "randn"), zero, 5, config=SMALL),
                       torch.full((2, 5), -1, device=DEVICE))
    none = torch.empty(2, 0, device=DEVICE)
    assert torch.equal(lightning_topk(none, zero, 3), torch.full((2, 3), -1, device=DEVICE))
    assert lightning_topk(torch.empty(0, 30, device=DEVICE), zero[:0], 3).shape == (0, 3)


def test_input_validation() -> None:
    scores = make_scores(2, 30, "randn")
    lengths = torch.full((2,), 30, device=DEVICE)
    with pytest.raises(ValueError, match="float32"):
        lightning_topk(scores.half(), lengths, 4)
    with pytest.raises(ValueError, match="contiguous"):
        lightning_topk(make_scores(30, 2, "randn").t(), lengths, 4)
    with pytest.raises(ValueError, match="lengths"):
        lightning_topk(scores, lengths[:1], 4)
    with pytest.raises(ValueError, match="lengths"):
        lightning_topk(scores, lengths.float(), 4)
    with pytest.raises(ValueError, match="k must"):
        lightning_topk(scores, lengths, 0)


def test_to_slots_permuted_pages() -> None:
    g = torch.Generator().manual_seed(3)
    B, pages, page_entries, k = 3, 6, 16, 20
    table = torch.stack([torch.randperm(40, generator=g)[:pages] for _ in range(B)])  # [B, pages]
    scores = make_scores(B, pages * page_entries, "ints", seed=3).cpu()
    lengths = torch.tensor([pages * page_entries, 37, 5])
    picks = topk_ragged(scores, lengths, k)
    slots = to_slots(picks, table, page_entries)
    for b in range(B):
        for j in range(k):
            i = int(picks[b, j])
            want = (-1 if i < 0
                    else int(table[b, i // page_entries]) * page_entries + i % page_entries)
            assert int(slots[b, j]) == want
    assert (slots[2, 5:] == -1).all() and slots.dtype == torch.int64


# ---------------------------------------------------------------------------------------------- gpu

NO_COOP = replace(TopKConfig(), coop_programs=0)                   # the compact path at every batch
GPU_EXACT = replace(NO_COOP, exact_max=1 << 40)
# bound mode without the sampled K1 / tiled tail
GPU_UNSAMPLED = replace(NO_COOP, sample=1, chunk_tile=0)


@pytest.mark.gpu
@pytest.mark.parametrize("B,N,k", [(1, 262144, 512), (64, 262144, 512), (8, 262144, 2048),
                                   (33, 131072, 512)])
@pytest.mark.parametrize("dist", ("randn", "ints", "nan", "sparse", "equal"))
def test_gpu_unsampled(B: int, N: int, k: int, dist: str) -> None:
    scores = make_scores(B, N, dist, seed=B, k=k)
    check(scores, ragged_lengths(B, N, k, seed=B), k, GPU_UNSAMPLED,
          plan_topk(B, N, GPU_UNSAMPLED).name)


@pytest.mark.gpu
@pytest.mark.parametrize("B,N,k", [
    (1, 262144, 512), (3, 262144, 512), (64, 262144, 512), (256, 262144, 512), (300, 262144, 512),
    (1, 65536, 1024), (8, 262144, 2048), (1, 65535, 2048), (1, 65537, 512),
    (128, 4096, 512), (17, 4097, 512), (2, 16383, 512), (2, 16384, 512), (33, 131072, 512),
    (2048, 8192, 512),
])
@pytest.mark.parametrize("dist", ("randn", "ints", "inf", "nan", "sparse"))
def test_gpu_real_shapes(B: int, N: int, k: int, dist: str) -> None:
    scores = make_scores(B, N, dist, seed=B, k=k)
    lengths = ragged_lengths(B, N, k, seed=B)
    check(scores, lengths, k, TopKConfig(), plan_topk(B, N).name)    # small batches: the coop path
    if plan_topk(B, N).coop is not None:
        check(scores, lengths, k, NO_COOP, plan_topk(B, N, NO_COOP).name)
    if B <= 64:
        check(scores, lengths, k, GPU_EXACT, plan_topk(B, N, GPU_EXACT).name)


@pytest.mark.gpu
@pytest.mark.parametrize("config", (TopKConfig(), NO_COOP, GPU_EXACT))
def test_gpu_all_equal_long_row(config: TopKConfig) -> None:
    """Worst case for the compact path: every score is a candidate and a tie (scratch overflow)."""
    scores = make_scores(2, 262144, "equal")
    lengths = torch.tensor([262144, 100000], device=DEVICE)
    check(scores, lengths, 512, config, plan_topk(2, 262144, config).name)


@pytest.mark.gpu
def test_gpu_workspace_reuse() -> None:
    """The compact path takes a garbage-filled workspace (the coop path needs a zeroed one:
    test_topk_coop.py)."""
    numel = topk_workspace_numel(64, 262144, 512, NO_COOP)
    workspace = torch.randint(-2**31, 2**31 - 1, (numel,), dtype=torch.int32, device=DEVICE)
    for step, (B, dist) in enumerate([(64, "randn"), (1, "ints"), (64, "nan"), (8, "sparse"),
                                      (64, "randn")]):
        scores = make_scores(B, 262144, dist, seed=step, k=512)
        path = plan_topk(B, 262144, NO_COOP).name  # B = 1 runs exact, the others bound
        check(scores, ragged_lengths(B, 262144, 512, seed=step), 512, NO_COOP, path,
              workspace=workspace)


@pytest.mark.gpu
@pytest.mark.parametrize("B,N", [(1, 262144), (64, 65536), (512, 8192), (64, 262144)])
def test_gpu_graph_replay(B: int, N: int) -> None:
    scores = make_scores(B, N, "randn")
    lengths = ragged_lengths(B, N, 512)
    lightning_topk(scores, lengths, 512)                     # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lightning_topk(scores, lengths, 512)
    for seed in range(4):
        scores.copy_(make_scores(B, N, ("randn", "ints", "nan", "sparse")[seed], seed=seed, k=512))
        graph.replay()
        assert torch.equal(out, reference(scores, lengths, 512))
