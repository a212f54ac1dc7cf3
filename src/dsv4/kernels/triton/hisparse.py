"""HiSparse copies in Triton: hot rows from the host mirror (`triton_swap_in`) and new entries
into the host mirror (`triton_write_rows`), reading and writing pinned host memory in place.

The fast forms of `kernels/ref/hisparse.py::swap_in_ref` / `write_rows_ref` (same signatures,
same semantics):
    device_pool[dst_slots[i]] = host_pool[src_entries[i]]   for every i with dst_slots[i] >= 0
    pool[rows[i]] = values[i]                               for every i with rows[i] >= 0
cast to the destination's dtype. The `triton` backend's `swap_in` / `write_rows` ops
(`registry.py`); `cache/hisparse.py::HotSet` calls them with one layer's pools.

Kernel design (both): grid (n, cdiv(D, BLOCK_D)); each program reads its row's destination, and
when it is >= 0 its source, then copies BLOCK_D elements. Rows with a -1 destination read nothing
else and write nothing: their source is never dereferenced (it may be garbage), and the trash row
(the last, which the references overwrite) is left alone, which its "overwritten freely" contract
allows. Row offsets are int64 (entry * row stride passes 2^31 at V4 sizes). Fixed grid for a
fixed n, no host syncs: CUDA-graph safe.

Host memory (UVA): on a GPU the HotSet's host mirror is pinned CPU memory, which is mapped into
the device's address space under unified virtual addressing, so the kernels take it as it is:
each program's loads (swap-in) or stores (write) of a host row cross PCIe / NVLink-C2C as memory
transactions, with no copy-engine call and no host sync, inside a CUDA graph too. Every other
argument is on one CUDA device. Without CUDA (the interpreter) every tensor is on the CPU.

Contract not checked (a check would read device memory on the host): the non-negative dst slots of
one swap-in are distinct (as the reference requires; duplicates with different sources leave the
row undefined, possibly mixed across D blocks), repeated rows of one write carry equal values, and
all indices are in range.

Test: tests/kernels/test_hisparse_swap.py. Benchmark: benchmarks/kernels/bench_hisparse_swap.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels.triton.launch import X_DTYPES, pow2
from dsv4.kernels.triton.pdl import pdl_args
from dsv4.kernels.triton.pdl_enter import pdl_enter

# Same dtype: a bit copy (uint8: packed FP8 entries); different dtypes: cast within X_DTYPES.
POOL_DTYPES = (*X_DTYPES, torch.uint8)
INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _copy_row(src, dst, D, BLOCK_D: tl.constexpr,  # type: ignore[no-untyped-def]
              EVEN_D: tl.constexpr):
    """This program's BLOCK_D elements of one row: src row -> dst row, cast to dst's dtype."""
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    if EVEN_D:
        tl.store(dst + offs, tl.load(src + offs).to(dst.dtype.element_ty))
    else:
        ok = offs < D
        tl.store(dst + offs, tl.load(src + offs, mask=ok).to(dst.dtype.element_ty), mask=ok)


@triton.jit
def _swap_in_kernel(host_ptr, dev_ptr, src_ptr, dst_ptr, D,  # type: ignore[no-untyped-def]
                    stride_host, stride_dev, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
                    PDL: tl.constexpr):
    pdl_enter(PDL)
    i = tl.program_id(0)
    dst = tl.load(dst_ptr + i).to(tl.int64)
    if dst >= 0:
        src = tl.load(src_ptr + i).to(tl.int64)
        _copy_row(host_ptr + src * stride_host, dev_ptr + dst * stride_dev, D, BLOCK_D, EVEN_D)


def default_block_d(D: int) -> int:
    """The whole row up to 1024 elements (one program per row at V4-Flash's D = 512)."""
    return min(1024, triton.next_power_of_2(D))


def check_devices(host: torch.Tensor, others: dict[str, torch.Tensor], host_name: str) -> None:
    """`others` on one device; `host` there too, or pinned CPU memory beside a CUDA device."""
    devices = {t.device for t in others.values()}
    where = ", ".join(f"{k} on {t.device}" for k, t in {host_name: host, **others}.items())
    if len(devices) != 1:
        raise ValueError(f"{', '.join(others)} must be on one device; got {where}")
    device = devices.pop()
    # no driver query while a CUDA graph is captured: the engine's eager warm-up before every
    # capture has validated the same tensors
    uva = host.device.type == "cpu" and device.type == "cuda" and (
        torch.cuda.is_current_stream_capturing() or host.is_pinned())
    if host.device != device and not uva:
        raise ValueError(f"{host_name} must be on the device of the others or in pinned CPU "
                         f"memory beside a CUDA device (UVA); got {where}")


def check_rows(src: tuple[str, str, torch.Tensor], dst: tuple[str, str, torch.Tensor]) -> None:
    """(name, shape label, tensor) of the copy's source and destination: both 2-D with one D, of
    POOL_DTYPES with unit stride in D, uint8 only into uint8 (a bit copy)."""
    (s_name, s_shape, s), (d_name, d_shape, d) = src, dst
    if s.dim() != 2 or d.dim() != 2 or s.shape[1] != d.shape[1]:
        raise ValueError(f"{s_name} must be {s_shape} and {d_name} {d_shape}; got "
                         f"{list(s.shape)} and {list(d.shape)}")
    for name, t in ((s_name, s), (d_name, d)):
        if t.dtype not in POOL_DTYPES or (t.shape[1] > 1 and t.stride(1) != 1):
            raise ValueError(f"{name} must be of {[str(x) for x in POOL_DTYPES]} with unit stride "
                             f"in D; got {t.dtype} strides {t.stride()}")
    if s.dtype != d.dtype and torch.uint8 in (s.dtype, d.dtype):
        raise ValueError(f"uint8 rows copy bits only: {s_name} and {d_name} must both be uint8; "
                         f"got {s.dtype} -> {d.dtype}")


def _check(host_pool: torch.Tensor, device_pool: torch.Tensor, src_entries: torch.Tensor,
           dst_slots: torch.Tensor) -> None:
    check_devices(host_pool, {"device_pool": device_pool, "src_entries": src_entries,
                               "dst_slots": dst_slots}, "host_pool")
    check_rows(("host_pool", "[N_host, D]", host_pool),
                ("device_pool", "[N_dev + 1, D]", device_pool))
    if device_pool.shape[0] < 1:
        raise ValueError("device_pool needs at least its trash row")
    if (src_entries.dim() != 1 or src_entries.shape != dst_slots.shape
            or src_entries.dtype not in INDEX_DTYPES or dst_slots.dtype not in INDEX_DTYPES):
        raise ValueError(f"src_entries and dst_slots must be [n] of int32 / int64; got "
                         f"{list(src_entries.shape)} {src_entries.dtype} and "
                         f"{list(dst_slots.shape)} {dst_slots.dtype}")


def triton_swap_in(host_pool: torch.Tensor, device_pool: torch.Tensor, src_entries: torch.Tensor,
                   dst_slots: torch.Tensor, *, block_d: int | None = None,
                   num_warps: int | None = None) -> None:
    """Same contract as `swap_in_ref`: copy host rows `src_entries` into device rows `dst_slots`,
    in place; -1 in dst: no copy (src ignored). Casts to the device pool's dtype.

    host_pool: [N_host, D]; device_pool: [N_dev + 1, D] (last row: trash), both with unit stride
    in D (any row stride), bf16 / fp16 / fp32 (or both uint8); src_entries, dst_slots: [n] int32 /
    int64. All on one device, or host_pool in pinned CPU memory and the rest on one CUDA device
    (read in place: module docstring); ValueError otherwise. Graph-capture safe; no host sync.
    """
    _check(host_pool, device_pool, src_entries, dst_slots)
    n, D = src_entries.shape[0], host_pool.shape[1]
    if n == 0 or D == 0:
        return
    bd = pow2("block_d", block_d or default_block_d(D), 1)
    elt = device_pool.element_size()
    _swap_in_kernel[(n, triton.cdiv(D, bd))](
        host_pool, device_pool, src_entries.contiguous(), dst_slots.contiguous(), D,
        host_pool.stride(0), device_pool.stride(0), BLOCK_D=bd, EVEN_D=D % bd == 0,
        num_warps=num_warps or max(1, min(8, bd * elt // 512)), **pdl_args(src_entries.device))


@triton.jit
def _write_rows_kernel(pool_ptr, rows_ptr, val_ptr, D,  # type: ignore[no-untyped-def]
                       stride_pool, stride_val, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
                       PDL: tl.constexpr):
    pdl_enter(PDL)
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    if row >= 0:
        _copy_row(val_ptr + i.to(tl.int64) * stride_val, pool_ptr + row * stride_pool, D,
                  BLOCK_D, EVEN_D)


def triton_write_rows(pool: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, *,
                      block_d: int | None = None, num_warps: int | None = None) -> None:
    """Same contract as `write_rows_ref`: pool[rows[i]] = values[i] in place; -1 in rows: no
    write. Casts to the pool's dtype.

    pool: [N, D] with unit stride in D (any row stride); rows: [n] int32 / int64; values: [n, D]
    with unit stride in D; dtypes as `triton_swap_in` (values -> pool). rows and values on one
    device; pool there too or in pinned CPU memory beside a CUDA device (written in place: module
    docstring); ValueError otherwise. Graph-capture safe; no host sync.
    """
    check_devices(pool, {"rows": rows, "values": values}, "pool")
    check_rows(("values", "[n, D]", values), ("pool", "[N, D]", pool))
    if rows.dim() != 1 or rows.shape[0] != values.shape[0] or rows.dtype not in INDEX_DTYPES:
        raise ValueError(f"rows must be [n] of int32 / int64 with n = values.shape[0]; got "
                         f"{list(rows.shape)} {rows.dtype} for {values.shape[0]} values")
    n, D = rows.shape[0], pool.shape[1]
    if n == 0 or D == 0:
        return
    bd = pow2("block_d", block_d or default_block_d(D), 1)
    _write_rows_kernel[(n, triton.cdiv(D, bd))](
        pool, rows.contiguous(), values, D, pool.stride(0), values.stride(0), BLOCK_D=bd,
        EVEN_D=D % bd == 0, num_warps=num_warps or max(1, min(8, bd * pool.element_size() // 512)),
        **pdl_args(values.device))
