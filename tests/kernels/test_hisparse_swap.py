"""Parity of the HiSparse copy kernels `triton_swap_in` / `triton_write_rows` with the references
`swap_in_ref` / `write_rows_ref`.

CPU: small shapes under the Triton interpreter: random indices with ~1/3 skipped rows (-1
destinations, their sources garbage: -1 or past the pool) and repeated source entries; fp32, bf16,
fp32 -> bf16 (the cast), uint8 (packed entries, a bit copy); int32 and int64 indices; D not a
multiple of BLOCK_D; one layer's views of [L, N, D] pools (other layers untouched) and a strided
host pool; repeated identical (src, dst) pairs and repeated write rows with equal values;
validation (devices, shapes, dtypes). The kernels must equal the references bit for bit on every
row but the trash row (overwritten freely; the kernels leave it alone). Repeated destinations with
different sources are outside both contracts (the reference's index_copy_ picks any) and are not
tested. End to end: a HotSet driven through `write_entries` and `select` with the Triton hooks
equals one with the references.
GPU (`-m gpu`): V4-Flash shape (D = 512, bf16, 8192 rows into a 64K-row pool), CUDA-graph
replay, and both kernels on a pinned host pool (UVA: read and written in place, also inside a
captured graph).

    PYTHONPATH=src python -m pytest -q tests/kernels/test_hisparse_swap.py         # interpreter
    PYTHONPATH=src python -m pytest -q -m gpu tests/kernels/test_hisparse_swap.py  # a CUDA machine
"""

from __future__ import annotations

import os

import torch

# NOTE: must precede the first `import triton` (tests/kernels/conftest.py may already do this).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from dsv4.cache.hisparse import HiSparseLayout, HotSet  # noqa: E402
from dsv4.kernels.ref.hisparse import swap_in_ref, write_rows_ref  # noqa: E402
from dsv4.kernels.triton.hisparse import triton_swap_in, triton_write_rows  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def make_pool(rows: int, d: int, dtype: torch.dtype, g: torch.Generator,
              device: str = DEVICE) -> torch.Tensor:
    if dtype == torch.uint8:
        return torch.randint(0, 256, (rows, d), generator=g, dtype=torch.uint8).to(device)
    return torch.randn(rows, d, generator=g).to(device, dtype)


def make_indices(n: int, n_host: int, n_dev: int, g: torch.Generator,
                 dtype: torch.dtype = torch.int64, device: str = DEVICE
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """src with repeats; dst distinct rows of [0, n_dev) with ~1/3 of them -1 and src garbage
    there (-1 or past the host pool: the kernel must not read it)."""
    assert n <= n_dev
    src = torch.randint(0, n_host, (n,), generator=g)
    dst = torch.randperm(n_dev, generator=g)[:n]
    skip = torch.rand(n, generator=g) < 1 / 3
    dst[skip] = -1
    garbage = torch.where(torch.rand(n, generator=g) < 0.5, -1, n_host + 1000)
    src = torch.where(skip, garbage, src)
    return src.to(device, dtype), dst.to(device, dtype)


def run_both(host: torch.Tensor, dev: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
             **knobs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel's device pool, reference's device pool), both from `dev`."""
    got, want = dev.clone(), dev.clone()
    triton_swap_in(host, got, src, dst, **knobs)
    # the reference indexes host rows with src even where dst is -1 (it replaces them by 0)
    swap_in_ref(host, want, src, dst)
    return got, want


def assert_equal_but_trash(got: torch.Tensor, want: torch.Tensor, before: torch.Tensor,
                           cast: bool = False) -> None:
    """Bit-equal but the trash row; a cast (fp32 -> bf16) under the interpreter: within one bf16
    ulp (its cast truncates where the GPU and torch round to nearest even; see
    benchmarks/backend_rounding.py)."""
    if cast and INTERPRETED:
        torch.testing.assert_close(got[:-1].float(), want[:-1].float(), rtol=2.0 ** -7, atol=0)
    else:
        assert torch.equal(got[:-1], want[:-1]), (got[:-1] != want[:-1]).nonzero()[:8]
    assert torch.equal(got[-1], before[-1]), "the kernel writes nothing for skipped rows"


@pytest.mark.parametrize(("host_dtype", "dev_dtype"), [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16), (torch.uint8, torch.uint8)])  # the cast: one ulp on CPU
@pytest.mark.parametrize("n", [1, 7, 33])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_swap_in_matches_reference(host_dtype: torch.dtype, dev_dtype: torch.dtype, n: int,
                                   index_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(n)
    d, n_host, n_dev = 32, 50, 40
    host = make_pool(n_host, d, host_dtype, g)
    dev = make_pool(n_dev + 1, d, dev_dtype, g)
    src, dst = make_indices(n, n_host, n_dev, g, index_dtype)
    got, want = run_both(host, dev, src, dst)
    assert_equal_but_trash(got, want, dev, cast=host_dtype != dev_dtype)


@pytest.mark.parametrize(("d", "block_d"), [(40, 16), (100, 32), (64, 64), (24, None)])
def test_rows_split_over_d_blocks(d: int, block_d: int | None) -> None:
    g = torch.Generator().manual_seed(d)
    host, dev = make_pool(30, d, torch.bfloat16, g), make_pool(21, d, torch.bfloat16, g)
    src, dst = make_indices(17, 30, 20, g)
    got, want = run_both(host, dev, src, dst, **({"block_d": block_d} if block_d else {}))
    assert_equal_but_trash(got, want, dev)


def test_one_layer_of_stacked_pools_and_a_strided_host_pool() -> None:
    """HotSet passes host_pool[layer] / device_pool[layer]; a host pool with a wider row stride
    (a column slice) is read through its stride."""
    g = torch.Generator().manual_seed(3)
    L, d = 3, 16
    host = make_pool(L * 20, d + 8, torch.float32, g).view(L, 20, d + 8)[:, :, :d]
    dev = make_pool(L * 13, d, torch.float32, g).view(L, 13, d)
    src, dst = make_indices(9, 20, 12, g)
    got, want = dev.clone(), dev.clone()
    triton_swap_in(host[1], got[1], src, dst)
    swap_in_ref(host[1], want[1], src, dst)
    assert torch.equal(got[0], dev[0]) and torch.equal(got[2], dev[2])
    assert_equal_but_trash(got[1], want[1], dev[1])


def test_repeated_identical_pairs_and_all_skipped() -> None:
    def ids(v: list[int]) -> torch.Tensor:
        return torch.tensor(v, dtype=torch.long, device=DEVICE)

    g = torch.Generator().manual_seed(5)
    host, dev = make_pool(10, 8, torch.float32, g), make_pool(6, 8, torch.float32, g)
    src, dst = ids([4, 4, 2, 4]), ids([1, 1, 3, 1])
    got, want = run_both(host, dev, src, dst)
    assert_equal_but_trash(got, want, dev)
    got, _ = run_both(host, dev, ids([-1, 99]), ids([-1, -1]))
    assert torch.equal(got, dev)
    got, _ = run_both(host, dev, ids([]), ids([]))
    assert torch.equal(got, dev)


def test_bad_inputs_are_value_errors() -> None:
    host, dev = torch.zeros(10, 8), torch.zeros(6, 8)
    idx = torch.tensor([0, 1])
    with pytest.raises(ValueError, match=r"got host_pool on meta, device_pool on cpu"):
        triton_swap_in(host.to("meta"), dev, idx, idx)
    with pytest.raises(ValueError, match=r"must be on one device; got host_pool on cpu, "
                                         r"device_pool on meta"):
        triton_swap_in(host, dev.to("meta"), idx, idx)
    with pytest.raises(ValueError, match="N_host, D"):
        triton_swap_in(torch.zeros(10, 4), dev, idx, idx)
    with pytest.raises(ValueError, match="int32 / int64"):
        triton_swap_in(host, dev, idx.float(), idx)
    with pytest.raises(ValueError, match="int32 / int64"):
        triton_swap_in(host, dev, idx, idx[:1])
    with pytest.raises(ValueError, match="unit stride"):
        triton_swap_in(torch.zeros(8, 10).t(), dev, idx, idx)
    with pytest.raises(ValueError, match="uint8"):
        triton_swap_in(host.to(torch.uint8), dev, idx, idx)
    with pytest.raises(ValueError, match="power of two"):
        triton_swap_in(host, dev, idx, idx, block_d=12)


def write_both(pool: torch.Tensor, rows: torch.Tensor, values: torch.Tensor,
               **knobs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel's pool, reference's pool), both from `pool`."""
    got, want = pool.clone(), pool.clone()
    triton_write_rows(got, rows, values, **knobs)
    write_rows_ref(want, rows, values)
    return got, want


@pytest.mark.parametrize(("val_dtype", "pool_dtype"), [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16), (torch.uint8, torch.uint8)])
@pytest.mark.parametrize("n", [1, 9, 33])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_write_rows_matches_reference(val_dtype: torch.dtype, pool_dtype: torch.dtype, n: int,
                                      index_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(100 + n)
    d, rows_n = 32, 40
    pool = make_pool(rows_n + 1, d, pool_dtype, g)
    values = make_pool(n, d, val_dtype, g)
    _, rows = make_indices(n, 1, rows_n, g, index_dtype)       # distinct rows, ~1/3 of them -1
    got, want = write_both(pool, rows, values)
    assert_equal_but_trash(got, want, pool, cast=val_dtype != pool_dtype)


@pytest.mark.parametrize(("d", "block_d"), [(40, 16), (100, 32), (24, None)])
def test_write_rows_split_over_d_blocks_and_repeated_rows(d: int, block_d: int | None) -> None:
    """Rows over several D blocks; a row written by several tokens with equal values (the pad
    slot's null-page row); one layer of a stacked pool, the others untouched."""
    g = torch.Generator().manual_seed(d)
    stacked = make_pool(3 * 21, d, torch.bfloat16, g).view(3, 21, d)
    values = make_pool(12, d, torch.bfloat16, g)
    rows = torch.tensor([3, 0, 0, 7, -1, 0, 19, 5, -1, 11, 0, 2], device=DEVICE)
    values[rows == 0] = values[1].clone()
    got, want = stacked.clone(), stacked.clone()
    triton_write_rows(got[1], rows, values, **({"block_d": block_d} if block_d else {}))
    write_rows_ref(want[1], rows, values)
    assert torch.equal(got[0], stacked[0]) and torch.equal(got[2], stacked[2])
    assert_equal_but_trash(got[1], want[1], stacked[1])


def test_write_rows_bad_inputs_are_value_errors() -> None:
    pool, values, rows = torch.zeros(10, 8), torch.zeros(2, 8), torch.tensor([0, 1])
    with pytest.raises(ValueError, match=r"rows, values must be on one device; got pool on cpu, "
                                         r"rows on meta, values on cpu"):
        triton_write_rows(pool, rows.to("meta"), values)
    with pytest.raises(ValueError, match=r"pool must be on the device of the others"):
        triton_write_rows(pool.to("meta"), rows, values)
    with pytest.raises(ValueError, match=r"values must be \[n, D\] and pool \[N, D\]"):
        triton_write_rows(pool, rows, torch.zeros(2, 4))
    with pytest.raises(ValueError, match="n = values.shape"):
        triton_write_rows(pool, rows[:1], values)
    with pytest.raises(ValueError, match="int32 / int64"):
        triton_write_rows(pool, rows.float(), values)
    with pytest.raises(ValueError, match="uint8"):
        triton_write_rows(pool.to(torch.uint8), rows, values)
    with pytest.raises(ValueError, match="unit stride"):
        triton_write_rows(pool, rows, torch.zeros(8, 2).t())


def test_hot_set_select_with_the_kernel_equals_the_reference() -> None:
    """HotSet's swap_in / write_rows hooks: the same writes and picks through both pairs of
    copies give identical host mirrors, hot pools and rows."""
    layout = HiSparseLayout(num_layers=2, max_reqs=2, max_entries=16, device_entries=6, top_k=4,
                            num_host_rows=(2 * 8 + 1) * 2 + 1, page_entries=2, width=8)
    page_table = 1 + torch.arange(3 * 8).view(3, 8)       # page 0: the null page
    page_table[2] = 0                                     # the pad slot
    sets = [HotSet(layout, page_table.to(DEVICE), torch.float32, torch.device(DEVICE),
                   host_device=torch.device(DEVICE), swap_in=swap, write_rows=write)
            for swap, write in ((swap_in_ref, write_rows_ref),
                                (triton_swap_in, triton_write_rows))]
    g = torch.Generator().manual_seed(7)
    values = torch.randn(2, 16, 8, generator=g).to(DEVICE)
    picks = [torch.randint(-1, 16, (3, 4), generator=g).to(DEVICE) for _ in range(4)]
    for hs in sets:
        for slot in range(2):
            hs.admit(slot)
            for layer in range(2):
                hs.write_entries(layer, torch.full((16,), slot, device=DEVICE),
                                 torch.arange(16, device=DEVICE), values[slot])
    rows = [[hs.select(i % 2, torch.tensor([0, 1, 2], device=DEVICE), p)
             for i, p in enumerate(picks)] for hs in sets]
    for a, b in zip(*rows, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(sets[0].device_pool[:, :-1], sets[1].device_pool[:, :-1])
    assert torch.equal(sets[0].host_pool[:, :-1], sets[1].host_pool[:, :-1])
    assert int(sets[1].num_swapped) > 0
    sets[1].check_integrity()


@pytest.mark.gpu
def test_v4_flash_shape_on_gpu() -> None:
    """D = 512 bf16, 8192 rows (~1/3 skipped) of a 256K-row host pool into a 64K-row hot pool."""
    g = torch.Generator().manual_seed(0)
    n_host, n_dev, d = 1 << 18, 1 << 16, 512
    host = make_pool(n_host, d, torch.bfloat16, g, "cuda")
    dev = make_pool(n_dev + 1, d, torch.bfloat16, g, "cuda")
    src, dst = make_indices(8192, n_host, n_dev, g, torch.int64, "cuda")
    got, want = run_both(host, dev, src, dst)
    assert_equal_but_trash(got, want, dev)
    # int32 indices, fp32 host -> bf16 hot rows
    src32, dst32 = make_indices(4096, n_host, n_dev, g, torch.int32, "cuda")
    host32 = host.float()
    got, want = run_both(host32, dev, src32, dst32)
    assert_equal_but_trash(got, want, dev)


@pytest.mark.gpu
def test_cuda_graph_replay_copies_the_new_indices() -> None:
    g = torch.Generator().manual_seed(1)
    host = make_pool(4096, 512, torch.bfloat16, g, "cuda")
    dev = torch.zeros(1025, 512, dtype=torch.bfloat16, device="cuda")
    src, dst = make_indices(512, 4096, 1024, g, torch.int64, "cuda")
    triton_swap_in(host, dev, src, dst)          # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_swap_in(host, dev, src, dst)
    new_src, new_dst = make_indices(512, 4096, 1024, g, torch.int64, "cuda")
    src.copy_(new_src)
    dst.copy_(new_dst)
    before = dev.clone()
    graph.replay()
    want = before.clone()
    swap_in_ref(host, want, new_src, new_dst)
    assert_equal_but_trash(dev, want, before)


@pytest.mark.gpu
def test_pinned_host_pool_is_read_and_written_in_place() -> None:
    """UVA: the swap-in reads a pinned CPU pool and the write stores into it, eagerly and from a
    captured graph replayed with new indices and values; the host sees the writes after a sync."""
    g = torch.Generator().manual_seed(2)
    host = make_pool(4096, 512, torch.bfloat16, g, "cpu").pin_memory()
    dev = torch.zeros(1025, 512, dtype=torch.bfloat16, device="cuda")
    src, dst = make_indices(512, 4096, 1024, g, torch.int64, "cuda")
    got, want = run_both(host, dev, src, dst)
    assert_equal_but_trash(got, want, dev)
    values = make_pool(64, 512, torch.bfloat16, g, "cuda")
    _, rows = make_indices(64, 1, 4095, g, torch.int64, "cuda")
    written, want_host = host.clone().pin_memory(), host.clone()
    triton_write_rows(written, rows, values)
    write_rows_ref(want_host, rows, values)
    torch.cuda.synchronize()
    assert_equal_but_trash(written, want_host, host)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_write_rows(written, rows, values)
        triton_swap_in(written, got, src, dst)
    new_values = make_pool(64, 512, torch.bfloat16, g, "cuda")
    _, new_rows = make_indices(64, 1, 4095, g, torch.int64, "cuda")
    new_src, new_dst = make_indices(512, 4096, 1024, g, torch.int64, "cuda")
    for buf, new in ((values, new_values), (rows, new_rows), (src, new_src), (dst, new_dst)):
        buf.copy_(new)
    host_before, dev_before = written.clone(), got.clone()
    graph.replay()
    torch.cuda.synchronize()
    write_rows_ref(host_before, new_rows, new_values)
    want_dev = dev_before.clone()
    swap_in_ref(host_before, want_dev, new_src, new_dst)
    assert torch.equal(written[:-1], host_before[:-1])
    assert_equal_but_trash(got, want_dev, dev_before)
