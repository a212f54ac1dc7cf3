"""Parity of `lightning_topk` with the reference `topk_ragged` (exact equality: the tie rule is exact).

CPU: small rows under the Triton interpreter, with shrunken `TopKConfig` thresholds so every path (row,
stream, split) and every path boundary (+-1) is reached; ragged lengths k-1, k, k+1, 0 and > N; exact ties
(small integer sets, all-equal rows, +-0.0), -inf entries, k > N; `to_slots` with a permuted page table.
On a CUDA machine the same tests run compiled on the GPU, and `-m gpu` adds real shapes (N up to 262,144,
batch 1..256, k 512..2048) and CUDA-graph replay.

    PYTHONPATH=src python -m pytest -q tests/kernels/test_topk.py           # interpreter on CPU (< 60 s)
    PYTHONPATH=src python -m pytest -q tests/kernels/test_topk.py -m gpu    # on a CUDA machine
"""

from __future__ import annotations

import os

import torch

# NOTE: must precede the first `import triton` / @triton.jit (tests/kernels/conftest.py may already do this).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from dsv4.kernels.ref.indexer import topk_lower_index  # noqa: E402
from dsv4.kernels.ref.topk import to_slots, topk_ragged  # noqa: E402
from dsv4.kernels.triton.topk import TopKConfig, lightning_topk, plan_topk  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DISTS = ("randn", "ints", "equal", "inf", "signed_zeros", "sparse")

# Shrunken thresholds: rows <= 64 in registers, streamed in 32-element blocks, split from 256 at B <= 8 into
# at most 4 chunks. Under the interpreter every program runs in sequence, so keep programs few.
SMALL = TopKConfig(row_max=64, block=32, split_min_n=256, target_programs=16, max_splits=4)


def make_scores(B: int, N: int, dist: str, seed: int = 0, k: int = 8) -> torch.Tensor:
    """[B, N] fp32 scores with the requested tie structure."""
    g = torch.Generator().manual_seed(seed)
    if dist == "randn":
        x = torch.randn(B, N, generator=g)
    elif dist == "ints":                     # a small integer set: most scores tie
        x = torch.randint(-2, 3, (B, N), generator=g).float()
    elif dist == "equal":
        x = torch.full((B, N), 0.75)
    elif dist == "inf":                      # -inf inside the length is a valid, last-ranked candidate
        x = torch.randn(B, N, generator=g)
        x[torch.rand(B, N, generator=g) < 0.5] = float("-inf")
        x[torch.rand(B, N, generator=g) < 0.02] = float("inf")
        x[-1] = float("-inf")
    elif dist == "signed_zeros":             # ReLU-like: exact zeros of both signs tie with each other
        x = torch.relu(torch.randn(B, N, generator=g)) * torch.where(torch.rand(B, N, generator=g) < 0.5, -1.0, 1.0)
    elif dist == "sparse":                   # k // 2 positives anywhere, +-0.0 elsewhere: the k-th largest is a
        sign = torch.where(torch.rand(B, N, generator=g) < 0.5, -1.0, 1.0)     # zero tie spread over every chunk
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
    lengths = [special[i] if i < len(special) else int(torch.randint(0, N + 1, (1,), generator=g)) for i in range(B)]
    return torch.tensor(lengths, dtype=torch.int64).clamp(min=0).to(DEVICE)


def check(scores: torch.Tensor, lengths: torch.Tensor, k: int, config: TopKConfig, path: str) -> None:
    B, N = scores.shape
    assert plan_topk(B, N, config).path == path, (plan_topk(B, N, config), path)
    out = lightning_topk(scores, lengths, k, config=config)
    ref = topk_ragged(scores, lengths, k)
    assert out.dtype == torch.int64 and out.shape == (B, k)
    if not torch.equal(out, ref):
        row = int((out != ref).any(dim=1).nonzero()[0])
        raise AssertionError(f"row {row} (len {int(lengths[row])}): got {out[row].tolist()} want {ref[row].tolist()}")


# ------------------------------------------------------------------------------------------------ plan


def test_plan_default_thresholds() -> None:
    assert plan_topk(256, 4096).path == "row"
    assert plan_topk(1, 4097).path == "stream"           # mid-length rows stream
    assert plan_topk(1, 16384).path == "split"
    one = plan_topk(1, 262144)
    assert (one.path, one.splits, one.chunk) == ("split", 64, 4096)
    wide = plan_topk(64, 262144)
    assert (wide.path, wide.splits, wide.chunk) == ("split", 8, 32768)
    assert plan_topk(264, 262144).path == "split" and plan_topk(265, 262144).path == "stream"


def test_config_rejects_non_power_of_two_block() -> None:
    with pytest.raises(ValueError, match="block"):
        TopKConfig(block=48)


# ---------------------------------------------------------------------------------------------- parity


@pytest.mark.parametrize("dist", DISTS)
@pytest.mark.parametrize("path,B,N,k", [
    ("row", 6, 50, 8),
    ("row", 6, 1000, 16),          # default config: 1024-wide register row
    ("stream", 6, 200, 8),
    ("split", 6, 300, 8),          # 4 chunks of 96
])
def test_parity_paths(path: str, B: int, N: int, k: int, dist: str) -> None:
    config = TopKConfig() if N > SMALL.row_max and path == "row" else SMALL
    scores = make_scores(B, N, dist, seed=N + B, k=k)
    check(scores, ragged_lengths(B, N, k), k, config, path)


@pytest.mark.parametrize("B,N,path", [
    (2, 63, "row"), (2, 64, "row"), (2, 65, "stream"),              # row_max +-1
    (2, 255, "stream"), (2, 256, "split"), (2, 257, "split"),       # split_min_n +-1
    (8, 300, "split"), (9, 300, "stream"),                          # target_programs // B >= 2 +-1
    (1, 288, "split"), (1, 289, "split"), (1, 319, "split"),       # chunk / block edges
    (1, 95, "stream"), (1, 96, "stream"), (1, 97, "stream"),       # stream block edges
])
def test_path_boundaries(B: int, N: int, path: str) -> None:
    for seed, dist in enumerate(("randn", "sparse")):
        scores = make_scores(B, N, dist, seed=seed, k=7)
        lengths = torch.full((B,), N, dtype=torch.int64, device=DEVICE)
        check(scores, lengths, 7, SMALL, path)


@pytest.mark.parametrize("path,N", [("row", 40), ("stream", 120), ("split", 260)])
def test_k_at_and_beyond_lengths(path: str, N: int) -> None:
    scores = make_scores(3, N, "ints", seed=1)
    for k in (1, N - 1, N, N + 1, N + 40):
        lengths = torch.tensor([N, k - 1, max(k - 1, 0) // 2], dtype=torch.int32, device=DEVICE)
        check(scores, lengths, k, SMALL, path)


def test_reference_matches_topk_lower_index() -> None:
    """On full rows the reference picks exactly the set `topk_lower_index` ranks first."""
    for dist in DISTS:
        scores = make_scores(4, 300, dist, seed=2)
        full = torch.full((4,), 300, dtype=torch.int64, device=DEVICE)
        expect = torch.sort(topk_lower_index(scores, 37), dim=-1).values
        assert torch.equal(topk_ragged(scores, full, 37), expect), dist


def test_empty_and_degenerate() -> None:
    scores = make_scores(2, 30, "randn")
    zero = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    assert torch.equal(lightning_topk(scores, zero, 5), torch.full((2, 5), -1, device=DEVICE))
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
    table = torch.stack([torch.randperm(40, generator=g)[:pages] for _ in range(B)])      # [B, pages]
    scores = make_scores(B, pages * page_entries, "ints", seed=3).cpu()
    lengths = torch.tensor([pages * page_entries, 37, 5])
    picks = topk_ragged(scores, lengths, k)
    slots = to_slots(picks, table, page_entries)
    for b in range(B):
        for j in range(k):
            i = int(picks[b, j])
            want = -1 if i < 0 else int(table[b, i // page_entries]) * page_entries + i % page_entries
            assert int(slots[b, j]) == want
    assert (slots[2, 5:] == -1).all() and slots.dtype == torch.int64


# -------------------------------------------------------------------------------------------------- gpu


@pytest.mark.gpu
@pytest.mark.parametrize("B,N,k", [
    (1, 262144, 512), (3, 262144, 512), (64, 262144, 512), (256, 262144, 512), (300, 262144, 512),
    (1, 65536, 1024), (8, 262144, 2048), (1, 65535, 2048), (1, 65537, 512),
    (128, 4096, 512), (17, 4097, 512), (2, 16383, 512), (2, 16384, 512), (33, 131072, 512),
])
@pytest.mark.parametrize("dist", ("randn", "ints", "inf", "sparse"))
def test_gpu_real_shapes(B: int, N: int, k: int, dist: str) -> None:
    scores = make_scores(B, N, dist, seed=B, k=k)
    lengths = ragged_lengths(B, N, k, seed=B)
    check(scores, lengths, k, TopKConfig(), plan_topk(B, N).path)


@pytest.mark.gpu
def test_gpu_all_equal_long_row() -> None:
    """Worst case for the split path: every entry is a candidate and a tie."""
    scores = make_scores(2, 262144, "equal")
    lengths = torch.tensor([262144, 100000], device=DEVICE)
    check(scores, lengths, 512, TopKConfig(), "split")


@pytest.mark.gpu
@pytest.mark.parametrize("B,N", [(1, 262144), (64, 65536), (512, 8192)])
def test_gpu_graph_replay(B: int, N: int) -> None:
    scores = make_scores(B, N, "randn")
    lengths = ragged_lengths(B, N, 512)
    lightning_topk(scores, lengths, 512)                     # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lightning_topk(scores, lengths, 512)
    for seed in range(3):
        scores.copy_(make_scores(B, N, "ints" if seed else "randn", seed=seed))
        graph.replay()
        assert torch.equal(out, topk_ragged(scores, lengths, 512))
