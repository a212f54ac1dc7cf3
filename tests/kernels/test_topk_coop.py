"""Parity of Lightning TopK's coop path (`kernels/triton/topk_coop.py`: one launch, grid-wide
barriers) with the reference `topk_ragged` (exact equality), its plan, and its workspace invariant.

CPU: the interpreter runs programs one after another, so the coop kernel runs there as its staged
launches (the same code; a launch boundary stands in for each barrier) on small rows with shrunken
thresholds: chunk edges +-1, ragged lengths (k - 1, k, k + 1, 0, > N), every tie structure of
`test_topk.DISTS`; the tie-list round and the heavy-ties round (a tie list of capacity 1 forces it);
the zeroed region left zero after each call. On a CUDA machine `-m gpu` runs the fused single launch
at real shapes, compares it with the staged form, reuses one workspace call after call (the counter
stays a multiple of 2^16, the histograms zero, no barrier timed out) and replays it in a CUDA graph.

    PYTHONPATH=src python -m pytest -q tests/kernels/test_topk_coop.py         # interpreter on CPU
    PYTHONPATH=src python -m pytest -q tests/kernels/test_topk_coop.py -m gpu  # on a CUDA machine
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from test_topk import DEVICE, DISTS, check, make_scores, ragged_lengths, reference  # noqa: E402

from dsv4.kernels.triton.topk import (  # noqa: E402
    TopKConfig,
    TopKRunner,
    device_sms,
    lightning_topk,
    plan_topk,
    topk_workspace_numel,
)
from dsv4.kernels.triton.topk_coop import (  # noqa: E402
    CTR,
    ERR,
    HIST_WORDS,
    TIES,
    ZERO_WORDS,
    row_words,
)

# Rows of up to 16 programs x 64 scores (128 when the batch needs fewer programs), 2 warps; the tie
# list holds up to 16 keys of the k-th largest's 20-bit bin (CAP1: one key, so nearly every row
# takes the heavy-ties round).
COOP = TopKConfig(row_max=64, coop_programs=16, coop_chunk=64, coop_max_chunk=128, coop_warps=2,
                  coop_cap=16)
CAP1 = replace(COOP, coop_cap=1)


def zero_region_ok(workspace: torch.Tensor, B: int, plan_words: int) -> None:
    """Every row's histograms and tie counter are zero, its barrier counter a multiple of 2^16, no
    timeout."""
    rows = workspace[: B * plan_words].view(B, plan_words).cpu()
    assert not rows[:, : HIST_WORDS.value].any(), "histograms left non-zero"
    assert not rows[:, TIES.value].any(), "tie counter left non-zero"
    assert not (rows[:, CTR.value] % 65536).any(), "barrier counter not a multiple of 2^16"
    assert not rows[:, ERR.value].any(), "a barrier timed out"


# --------------------------------------------------------------------------------------------- plan


def test_plan() -> None:
    c = replace(TopKConfig(), coop_programs=132)
    one = plan_topk(1, 262144, c, sms=132)
    assert one.name == "coop" and one.coop is not None
    assert (one.coop.programs, one.coop.chunk, one.coop.split) == (128, 2048, False)
    four = plan_topk(4, 262144, c, sms=132).coop
    # chunk doubled until B * P fits
    assert four is not None and (four.programs, four.chunk) == (32, 8192)
    # 5 x 32 programs: too many
    assert plan_topk(5, 262144, c, sms=132).name == "compact-bound"
    assert plan_topk(1, 262144, c, sms=100).coop.chunk == 4096    # capped at the GPU's SMs
    assert plan_topk(1, 262144, c).coop.split                     # no GPU: the staged form
    assert plan_topk(1, 262144, replace(c, coop_split=True), sms=132).coop.split
    assert plan_topk(1, 4096, c, sms=132).name == "row"
    assert plan_topk(1, 262144, replace(c, coop_programs=0), sms=132).name == "compact-exact"
    assert (topk_workspace_numel(2, 262144, 512, c, sms=132)
            == 2 * row_words(plan_topk(2, 262144, c, 132).coop))
    with pytest.raises(ValueError, match="coop_programs"):
        TopKConfig(coop_programs=-1)
    with pytest.raises(ValueError, match="coop_chunk"):
        TopKConfig(coop_chunk=100)


# ------------------------------------------------------------------------------------------- parity


@pytest.mark.parametrize("dist", DISTS)
@pytest.mark.parametrize("config,B,N,k", [
    (COOP, 1, 1000, 8),         # 16 programs of 64 (the last one ragged)
    (COOP, 3, 300, 8),          # 5 programs of 64 per row, ragged lengths
    (COOP, 2, 200, 40),         # k ~ a program's chunk
    # the heavy-ties round (CAP1) for every dist, ragged rows; at 16 programs a row it runs in
    # (COOP, 1, 1000, 8) with ints / equal / inf / nan / sparse (more than 16 tied keys)
    (CAP1, 3, 300, 24),
])
def test_parity(config: TopKConfig, B: int, N: int, k: int, dist: str) -> None:
    scores = make_scores(B, N, dist, seed=N + B, k=k)
    lengths = ragged_lengths(B, N, k) if B > 1 else torch.full((1,), N, device=DEVICE)
    check(scores, lengths, k, config, "coop")


# chunk edges at B = 2: 64 x 2 +-1; chunks of 128 (2 x 10 or 2 x 16 programs of 64 exceed 16) one
# short (639 = 128 x 5 - 1, the P_POW2 and ZERO_BLOCK of 1023) and full at 128 x 8 = 1024 (16
# programs: the grid's limit)
@pytest.mark.parametrize("N", [65, 127, 128, 129, 639, 1024])
def test_chunk_edges(N: int) -> None:
    for dist in ("randn", "sparse"):
        scores = make_scores(2, N, dist, seed=N, k=8)
        check(scores, torch.tensor([N, N - 1], device=DEVICE), 8, COOP, "coop")


def test_shipped_config() -> None:
    """The default TopKConfig plans the coop path for small batches: its chunk of 2048 at 8 warps,
    a cap of 32."""
    for B, N, k, dist in ((1, 9000, 64, "randn"), (2, 5000, 40, "sparse")):
        scores = make_scores(B, N, dist, seed=B, k=k)
        check(scores, ragged_lengths(B, N, k, seed=B), k, TopKConfig(), "coop")


@pytest.mark.parametrize("k", [7, 8, 9, 300])
def test_k_around_lengths(k: int) -> None:
    scores = make_scores(3, 200, "ints", seed=k)
    check(scores, torch.tensor([8, 200, 0], device=DEVICE), k, COOP, "coop")


def test_workspace_left_zero() -> None:
    """One zeroed workspace over many calls and shapes: every call leaves its zeroed region as it
    found it."""
    shapes = [(3, 300, 8, "randn", COOP), (1, 600, 24, "sparse", CAP1), (2, 200, 40, "nan", COOP),
              (1, 600, 8, "equal", CAP1), (3, 300, 8, "ints", COOP)]
    numel = max(topk_workspace_numel(B, N, k, cfg, device_sms(torch.device(DEVICE)))
                for B, N, k, _, cfg in shapes)
    workspace = torch.zeros(numel, dtype=torch.int32, device=DEVICE)
    for step, (B, N, k, dist, cfg) in enumerate(shapes):
        check(make_scores(B, N, dist, seed=step, k=k), ragged_lengths(B, N, k, seed=step), k, cfg,
              "coop", workspace=workspace)
        plan = plan_topk(B, N, cfg, device_sms(torch.device(DEVICE))).coop
        assert plan is not None
        zero_region_ok(workspace, B, row_words(plan))
    with pytest.raises(ValueError, match="workspace"):
        lightning_topk(make_scores(3, 300, "randn"), ragged_lengths(3, 300, 8), 8, config=COOP,
                       workspace=workspace[:10])
    assert ZERO_WORDS.value > ERR.value > CTR.value >= HIST_WORDS.value


def test_runner_holds_one_workspace() -> None:
    """`TopKRunner` (the triton backend's top-k): one zeroed buffer per device reused by every coop
    call, left zero; compact-path calls take their own."""
    runner = TopKRunner(COOP)
    for step, (B, N, k, dist) in enumerate([(3, 300, 8, "randn"), (1, 600, 24, "sparse"),
                                            (3, 1000, 8, "nan"), (2, 200, 40, "ints"),
                                            (3, 300, 8, "equal")]):
        scores = make_scores(B, N, dist, seed=step, k=k)
        lengths = ragged_lengths(B, N, k, seed=step)
        assert torch.equal(runner(scores, lengths, k), reference(scores, lengths, k)), step
    held = runner.held(torch.device(DEVICE))
    assert held is not None and held.numel() == runner.workspace_numel() and len(runner._held) == 1
    assert not held.view(-1)[: HIST_WORDS.value].any()
    assert plan_topk(3, 1000, COOP).name.startswith("compact")  # 3 rows x 8 programs: not coop


# ---------------------------------------------------------------------------------------------- gpu

# capped at the GPU's SM count by the wrapper
GPU_COOP = replace(TopKConfig(), coop_programs=1 << 16)


@pytest.mark.gpu
@pytest.mark.parametrize("B,N,k", [(1, 262144, 512), (1, 262144, 2048), (2, 262144, 1024),
                                   (4, 262144, 512), (1, 65536, 1024), (1, 65537, 512),
                                   (3, 100000, 512), (1, 4097, 512)])
@pytest.mark.parametrize("dist", ("randn", "ints", "inf", "nan", "signed_zeros", "sparse", "equal"))
def test_gpu_fused(B: int, N: int, k: int, dist: str) -> None:
    scores = make_scores(B, N, dist, seed=B + k, k=k)
    lengths = ragged_lengths(B, N, k, seed=B) if B > 1 else torch.full((1,), N, device=DEVICE)
    sms = device_sms(scores.device)
    plan = plan_topk(B, N, GPU_COOP, sms)
    assert plan.coop is not None and not plan.coop.split
    workspace = torch.zeros(topk_workspace_numel(B, N, k, GPU_COOP, sms), dtype=torch.int32,
                            device=DEVICE)
    check(scores, lengths, k, GPU_COOP, "coop", workspace=workspace)
    zero_region_ok(workspace, B, row_words(plan.coop))
    staged = lightning_topk(scores, lengths, k, config=replace(GPU_COOP, coop_split=True))
    assert torch.equal(staged, reference(scores, lengths, k))
    heavy = replace(GPU_COOP, coop_cap=1)               # the heavy-ties round, fused
    check(scores, lengths, k, heavy, "coop")


@pytest.mark.gpu
def test_gpu_workspace_many_calls() -> None:
    B, N, k = 1, 262144, 512
    sms = device_sms(torch.device(DEVICE))
    plan = plan_topk(B, N, GPU_COOP, sms).coop
    assert plan is not None
    workspace = torch.zeros(topk_workspace_numel(B, N, k, GPU_COOP, sms), dtype=torch.int32,
                            device=DEVICE)
    scores = [make_scores(B, N, dist, seed=i, k=k)
              for i, dist in enumerate(("randn", "sparse", "nan", "ints"))]
    lengths = torch.full((B,), N, device=DEVICE)
    want = [reference(s, lengths, k) for s in scores]
    for i in range(200):
        out = lightning_topk(scores[i % 4], lengths, k, config=GPU_COOP, workspace=workspace)
        assert torch.equal(out, want[i % 4]), i
    zero_region_ok(workspace, B, row_words(plan))
    assert int(workspace[CTR.value]) != 0                               # the counter did move


@pytest.mark.gpu
def test_gpu_graph_replay() -> None:
    B, N, k = 1, 262144, 512
    sms = device_sms(torch.device(DEVICE))
    workspace = torch.zeros(topk_workspace_numel(B, N, k, GPU_COOP, sms), dtype=torch.int32,
                            device=DEVICE)
    scores = make_scores(B, N, "randn")
    lengths = torch.full((B,), N, device=DEVICE)
    # compile outside capture
    lightning_topk(scores, lengths, k, config=GPU_COOP, workspace=workspace)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lightning_topk(scores, lengths, k, config=GPU_COOP, workspace=workspace)
    for seed in range(6):
        scores.copy_(make_scores(B, N, ("randn", "ints", "nan", "sparse", "equal", "inf")[seed],
                                 seed=seed, k=k))
        graph.replay()
        assert torch.equal(out, reference(scores, lengths, k)), seed


@pytest.mark.gpu
def test_gpu_runner_under_capture() -> None:
    """A runner's first call inside a CUDA-graph capture takes a fresh zero-filled buffer in the
    graph (a held one allocated there would never have been zeroed); once it holds one, later
    captures use it."""
    B, N, k = 1, 262144, 512
    scores = make_scores(B, N, "randn")
    lengths = torch.full((B,), N, device=DEVICE)
    lightning_topk(scores, lengths, k)                  # compile outside capture
    for warm in (False, True):
        runner = TopKRunner()
        if warm:
            runner(scores, lengths, k)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = runner(scores, lengths, k)
        assert (runner.held(scores.device) is not None) or not warm
        for seed in range(3):
            scores.copy_(make_scores(B, N, ("randn", "sparse", "nan")[seed], seed=seed, k=k))
            graph.replay()
            assert torch.equal(out, reference(scores, lengths, k)), (warm, seed)
        # eager after capture
        assert torch.equal(runner(scores, lengths, k), reference(scores, lengths, k))
