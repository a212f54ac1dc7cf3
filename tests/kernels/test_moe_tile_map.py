"""Parity of `triton_tile_map` (one launch, or two over chunks) with `tile_map_ref` (torch ops):
bit-equal outputs.

CPU: the interpreter on decode-sized maps: one token, a batch, every slot on one expert, experts
with no slots, E not a power of two, more tiles than one tile chunk, block_m 16 / 64; the chunked
form (from SPLIT_MIN_SLOTS slots) with a partial last chunk, one expert's slots across every
chunk, 1,000 experts and a prefill-sized map (5,400 slots). GPU (`-m gpu`):
V4-Flash routing (E 256, k 6) at batch 1..682 and prefill chunks up to the largest map, inside a
CUDA graph.

    PYTHONPATH=src python -m pytest -q tests/kernels/test_moe_tile_map.py
"""

from __future__ import annotations

import os

import torch

# NOTE: must precede the first `import triton` (tests/kernels/conftest.py may already do this).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from dsv4.kernels.triton.moe_tile_map import (  # noqa: E402
    MAX_FUSED_SLOTS,
    MAX_ONE_CTA_SLOTS,
    SPLIT_CHUNK,
    SPLIT_MIN_SLOTS,
    tile_map,
    tile_map_ref,
    triton_tile_map,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def routing(N: int, E: int, k: int, seed: int, spread: int | None = None) -> torch.Tensor:
    """[N, k] distinct experts per token, drawn from the first `spread` experts (default all)."""
    g = torch.Generator().manual_seed(seed)
    pool = spread or E
    rows = [torch.randperm(pool, generator=g)[:k] for _ in range(N)]
    return torch.stack(rows).to(DEVICE)


def assert_same(indices: torch.Tensor, E: int, block_m: int,
                chunked: bool | None = None) -> None:
    want = tile_map_ref(indices, E, block_m)
    got = triton_tile_map(indices, E, block_m, chunked=chunked)
    for name, w, g in zip(("order", "tile_start", "tile_end", "tile_expert"), want, got,
                          strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, w.dtype, g.shape)
        assert torch.equal(g, w), (name, g.tolist(), w.tolist())


@pytest.mark.parametrize("N,E,k,bm,spread", [
    (1, 256, 6, 16, None),      # decode at batch 1 (V4-Flash routing)
    (5, 8, 2, 16, None),
    (33, 8, 2, 16, None),       # several tiles per expert
    (9, 6, 3, 16, 3),           # E not a power of two; half the experts get nothing
    (40, 16, 1, 16, 1),         # every slot on one expert
    (20, 256, 6, 16, None),     # 120 slots: more tiles than one tile chunk
    (16, 64, 4, 64, None),      # block_m 64
])
def test_parity(N: int, E: int, k: int, bm: int, spread: int | None) -> None:
    """Both forms (the chunked one forced below its threshold: one partial chunk)."""
    indices = routing(N, E, k, seed=N + E, spread=spread)
    assert_same(indices, E, bm)
    assert_same(indices, E, bm, chunked=True)


def test_large_fused_map() -> None:
    """The largest map of the one-program form (more warps sort the keys)."""
    slots = SPLIT_MIN_SLOTS - 8
    assert_same(routing(slots // 8, 32, 8, seed=3), 32, 16)


@pytest.mark.parametrize("N,E,k,spread", [
    (SPLIT_MIN_SLOTS // 8, 32, 8, None),         # whole chunks
    (SPLIT_MIN_SLOTS // 6 + 7, 256, 6, None),    # V4-Flash routing, a partial last chunk
    (512, 1000, 4, None),                        # E not a power of two (BLOCK_E 1024)
    (900, 256, 6, None),    # 5,400 slots: more chunk histograms than one summing step
    (SPLIT_MIN_SLOTS + 3, 16, 1, 1),             # every slot on one expert, across every chunk
])
def test_chunked_map(N: int, E: int, k: int, spread: int | None) -> None:
    """From SPLIT_MIN_SLOTS slots: chunks of SPLIT_CHUNK sorted apart, placed by the chunks'
    histograms: the same stable order and tiles as the reference."""
    assert N * k >= SPLIT_MIN_SLOTS and N * k > SPLIT_CHUNK
    assert_same(routing(N, E, k, seed=N + E, spread=spread), E, 16)


def test_dispatch_and_validation() -> None:
    """`tile_map` takes the reference above the fused limit; the kernel refuses what it cannot
    take."""
    big = routing(MAX_FUSED_SLOTS // 8 + 1, 16, 8, seed=1)
    for w, g in zip(tile_map_ref(big, 16, 16), tile_map(big, 16, 16), strict=True):
        assert torch.equal(w, g)
    with pytest.raises(ValueError, match="slots"):
        triton_tile_map(big, 16, 16)
    over = routing(MAX_ONE_CTA_SLOTS // 8 + 1, 16, 8, seed=2)
    with pytest.raises(ValueError, match="one launch"):
        triton_tile_map(over, 16, 16, chunked=False)
    with pytest.raises(ValueError, match="power of two"):
        triton_tile_map(routing(2, 8, 2, seed=0), 8, 24)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 8, 32, 64, 128, 512, 682, 4096, 10922])
def test_gpu_flash_routing_in_graph(N: int) -> None:
    """`tile_map` on V4-Flash routing, the kernels at every N here (decode sizes, a prefill chunk
    of 4,096 tokens, and 10,922 x 6 = 65,532 slots, the most the chunked form takes)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    indices = routing(N, 256, 6, seed=N)
    want = tile_map_ref(indices, 256, 16)
    tile_map(indices, 256, 16)                      # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = tile_map(indices, 256, 16)
    graph.replay()
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)
