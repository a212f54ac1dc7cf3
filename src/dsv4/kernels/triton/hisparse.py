"""HiSparse swap-in in Triton: copy C4 entries from the host mirror's rows into hot rows.

Owns `triton_swap_in`, the fast form of `kernels/ref/hisparse.py::swap_in_ref` (same signature,
same semantics): device_pool[dst_slots[i]] = host_pool[src_entries[i]] for every i with
dst_slots[i] >= 0, cast to the device pool's dtype. `cache/hisparse.py::HotSet` calls it through
its `swap_in` hook with one layer's pools (`host_pool[layer]`, `device_pool[layer]`); it is not
registered in `registry.py`: the engine's HotSet (`--enable-hisparse`) keeps its host pool in
pinned CPU memory on a GPU and copies with `swap_in_ref` (see "Host memory" below).

Kernel design: grid (n, cdiv(D, BLOCK_D)); each program reads its row's dst slot, and when it is
>= 0 its src entry, then copies BLOCK_D elements. Rows with dst == -1 read nothing else and write
nothing: their src entry is never dereferenced (it may be garbage), and the trash row (the device
pool's last, which the reference overwrites with host row 0) is left alone, which its "overwritten
freely" contract allows. Row offsets are int64 (entry * row stride passes 2^31 at V4 sizes).
Fixed grid for a fixed n, no host syncs: CUDA-graph safe.

Contract not checked (a check would read device memory on the host): the non-negative dst slots of
one call are distinct (as the reference requires; duplicates with different sources leave the row
undefined, possibly mixed across D blocks) and all indices are in range.

Host memory: on a GPU the HotSet's host pool is pinned CPU memory, which a Triton kernel cannot
read through its pointer. This wrapper therefore requires both pools (and the indices) on one
device and raises ValueError otherwise; moving the rows host -> device is the copy engine's job
(a later step stages the missed rows through a pinned buffer, or maps the pool with UVA) and is
not done here.

Test: tests/kernels/test_hisparse_swap.py. Benchmark: benchmarks/kernels/bench_hisparse_swap.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from dsv4.kernels.triton.launch import X_DTYPES, pow2
from dsv4.kernels.triton.pdl import pdl_args

# Same dtype: a bit copy (uint8: packed FP8 entries); different dtypes: cast within X_DTYPES.
POOL_DTYPES = (*X_DTYPES, torch.uint8)
INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _swap_in_kernel(host_ptr, dev_ptr, src_ptr, dst_ptr, D,  # type: ignore[no-untyped-def]
                    stride_host, stride_dev, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
                    PDL: tl.constexpr):
    if PDL:  # programmatic dependent launch: the prior kernel's writes first
        gdc_wait()
    i = tl.program_id(0)
    dst = tl.load(dst_ptr + i).to(tl.int64)
    if dst >= 0:
        src = tl.load(src_ptr + i).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        if EVEN_D:
            row = tl.load(host_ptr + src * stride_host + offs)
            tl.store(dev_ptr + dst * stride_dev + offs, row.to(dev_ptr.dtype.element_ty))
        else:
            ok = offs < D
            row = tl.load(host_ptr + src * stride_host + offs, mask=ok)
            tl.store(dev_ptr + dst * stride_dev + offs, row.to(dev_ptr.dtype.element_ty), mask=ok)


def default_block_d(D: int) -> int:
    """The whole row up to 1024 elements (one program per row at V4-Flash's D = 512)."""
    return min(1024, triton.next_power_of_2(D))


def _check(host_pool: torch.Tensor, device_pool: torch.Tensor, src_entries: torch.Tensor,
           dst_slots: torch.Tensor) -> None:
    devices = {t.device for t in (host_pool, device_pool, src_entries, dst_slots)}
    if len(devices) != 1:
        raise ValueError(
            "triton_swap_in needs host_pool, device_pool, src_entries and dst_slots on one device; "
            f"got host_pool on {host_pool.device}, device_pool on {device_pool.device}, "
            f"src_entries on {src_entries.device}, dst_slots on {dst_slots.device} (a pinned host "
            "pool reaches the device through the copy engine, not this kernel)")
    if host_pool.dim() != 2 or device_pool.dim() != 2 or host_pool.shape[1] != device_pool.shape[1]:
        raise ValueError(f"host_pool must be [N_host, D] and device_pool [N_dev + 1, D]; got "
                         f"{list(host_pool.shape)} and {list(device_pool.shape)}")
    for name, pool in (("host_pool", host_pool), ("device_pool", device_pool)):
        if pool.dtype not in POOL_DTYPES or (pool.shape[1] > 1 and pool.stride(1) != 1):
            raise ValueError(f"{name} must be of {[str(d) for d in POOL_DTYPES]} with unit stride "
                             f"in D; got {pool.dtype} strides {pool.stride()}")
    if host_pool.dtype != device_pool.dtype and torch.uint8 in (host_pool.dtype, device_pool.dtype):
        raise ValueError(f"uint8 pools copy bits only: both pools must be uint8; got "
                         f"{host_pool.dtype} -> {device_pool.dtype}")
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
    int64. All four on ONE device (ValueError otherwise): a pinned CPU host pool must first reach
    the device through the copy engine (module docstring). Graph-capture safe; no host sync.
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
        num_warps=num_warps or max(1, min(8, bd * elt // 512)), **pdl_args(device_pool.device))
