"""Reference ragged top-k over indexer scores, and the C4-entry -> pool-slot page translation.

Owns the executable specification of Lightning TopK (`kernels/triton/topk.py::lightning_topk` has
the same signature and must return identical tensors; spec §6.6):

    row b considers only columns j < lengths[b]   (columns beyond are ignored, even if finite)
    rank by (score desc, index asc)               (the lower-index tie rule of
                                                   `ref/indexer.py::topk_lower_index`)
    keep the first k; -inf inside the length is a valid candidate that ranks last
    output: the selected indices in ASCENDING index order, then -1 padding up to k

-0.0 and +0.0 compare equal (ties, lower index first). NaN: on the CPU `torch.sort` ranks every NaN
above +inf (NaNs tie, lower index first), and so does the kernel; CUDA's sort orders NaN by its bits
(a negative NaN ranks last), so this reference is device-dependent for NaN only: compare against it
computed on the CPU.
Test: tests/kernels/test_topk.py.
"""

from __future__ import annotations

import torch


def topk_ragged(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores among columns j < lengths[b] of each row, ascending, -1
    padded.

    scores: [B, N] fp32; lengths: [B] int (clamped to [0, N]); k >= 1. Returns [B, k] int64.
    Selection order is (score desc, index asc), so among equal scores the lower index wins; a row
    with n = min(lengths[b], N) < k candidates returns all n of them followed by k - n times -1.
    """
    B, N = scores.shape
    col = torch.arange(N, device=scores.device)
    visible = col[None, :] < lengths.to(scores.device)[:, None]                     # [B, N]
    # NOTE: hidden columns become -inf; they sit after every visible column, so the stable sort
    # keeps any visible -inf ahead of them and cutting at the visible count drops exactly the hidden
    # ones.
    masked = scores.float().masked_fill(~visible, float("-inf"))
    # [B, min(k, N)]
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :k]
    num_visible = visible.sum(dim=-1, keepdim=True)                                 # [B, 1]
    rank = torch.arange(order.shape[1], device=scores.device)[None, :]
    # N sorts after any index
    picks = torch.where(rank < num_visible, order, N)
    picks = torch.sort(picks, dim=-1).values
    picks = torch.where(picks == N, -1, picks)
    if picks.shape[1] < k:
        picks = torch.nn.functional.pad(picks, (0, k - picks.shape[1]), value=-1)
    return picks


def to_slots(indices: torch.Tensor, page_table: torch.Tensor, page_entries: int) -> torch.Tensor:
    """Map entry indices of each row to pool slots through that row's page table; -1 stays -1.

    indices: [B, k] int (entry i of row b, or -1); page_table: [B, max_pages] int page ids;
    page_entries: entries per page (C4 entries: page_size // 4).
    slot = page_table[b, i // page_entries] * page_entries + i % page_entries. Returns [B, k] int64.
    """
    idx = indices.long()
    safe = idx.clamp(min=0)
    pages = torch.gather(page_table.long(), 1, safe // page_entries)                 # [B, k]
    slots = pages * page_entries + safe % page_entries
    return torch.where(idx < 0, torch.full_like(slots, -1), slots)
