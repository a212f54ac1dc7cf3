"""Reference HiSparse copies: C4 entries from the host mirror into the device hot pool
(`swap_in_ref`), and new entries into the host mirror (`write_rows_ref`).

The executable specifications of `kernels/triton/hisparse.py` (`cache/hisparse.py::HotSet` calls
them through its `swap_in` / `write_rows` hooks, the engine with its kernel backend's ops):

    device_pool[dst_slots[i]] = host_pool[src_entries[i]]     for every i with dst_slots[i] >= 0
    pool[rows[i]] = values[i]                                 for every i with rows[i] >= 0

Rows with `dst_slots[i] == -1` (`rows[i] == -1`) copy nothing and their source is ignored. The
non-negative `dst_slots` of one call are distinct (each hot row receives one entry); repeated
`rows` carry equal values (the tokens that complete no entry all write the null page's row). A
pool's last row is its trash row (`cache/pools.py` convention): skipped copies land there, so each
copy is one branch-free `index_copy_` of fixed size, the shape a CUDA graph can hold.

When the two sides live on different devices, the rows cross with blocking copies (a host sync);
the Triton kernels read and write pinned host memory in place (UVA) with no sync.
Test: tests/cache/test_hisparse.py, tests/kernels/test_hisparse_swap.py.
"""

from __future__ import annotations

import torch


def swap_in_ref(host_pool: torch.Tensor, device_pool: torch.Tensor, src_entries: torch.Tensor,
                dst_slots: torch.Tensor) -> None:
    """Copy host rows `src_entries` into device rows `dst_slots`, in place; -1 in dst: no copy.

    host_pool: [N_host, D]; device_pool: [N_dev + 1, D] (last row: trash, overwritten freely);
    src_entries, dst_slots: [n] int rows (on either device). Casts to the device pool's dtype.
    """
    keep = dst_slots >= 0
    rows = torch.where(keep, dst_slots.long(), device_pool.shape[0] - 1)
    src = torch.where(keep, src_entries.long(), 0).to(host_pool.device)
    entries = host_pool[src].to(device_pool.device, device_pool.dtype)       # [n, D]
    device_pool.index_copy_(0, rows.to(device_pool.device), entries)


def write_rows_ref(pool: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """Write `values` into rows `rows` of `pool`, in place; -1 in rows: no write.

    pool: [N, D] (last row: trash, overwritten freely), e.g. one layer of the host mirror;
    rows: [n] int; values: [n, D] (on either device). Casts to the pool's dtype.
    """
    keep = rows >= 0
    dst = torch.where(keep, rows.long(), pool.shape[0] - 1)
    pool.index_copy_(0, dst.to(pool.device), values.to(pool.device, pool.dtype))
