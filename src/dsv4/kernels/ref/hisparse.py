"""Reference HiSparse swap-in: copy C4 entries from the host mirror into the device hot pool.

The executable specification of the swap-in kernel (not built yet; `cache/hisparse.py::HotSet`
calls this through its `swap_in` hook):

    device_pool[dst_slots[i]] = host_pool[src_entries[i]]     for every i with dst_slots[i] >= 0

Rows with `dst_slots[i] == -1` copy nothing and their `src_entries[i]` is ignored. The
non-negative `dst_slots` of one call are distinct (each hot row receives one entry). The device
pool's last row is its trash row (`cache/pools.py` convention): skipped copies land there, so the
copy is one branch-free `index_copy_` of fixed size, the shape a CUDA graph can hold.

When the two pools live on different devices, the source rows cross to the host and the gathered
entries back with blocking copies (a host sync); the kernel is to read pinned host memory in place
with no sync. Test: tests/cache/test_hisparse.py.
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
