"""Index and mask helpers of the full-sequence attention path (`model/attention.py`): which raw keys
and compressed entries each query of a [B, S] batch sees, and the masked dense form of the sparse
softmax (`kernels/ref/attention.py::sparse_attention`) for training-length sequences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def window_indices(batch: int, seq_len: int, window: int, device: torch.device) -> torch.Tensor:
    """[B, S, W] flat ids `b*S + j` of raw keys j in [t-W+1, t] for each query t; -1 where j < 0."""
    t = torch.arange(seq_len, device=device)
    j = t[:, None] - window + 1 + torch.arange(window, device=device)       # [S, W]
    rows = torch.arange(batch, device=device)[:, None, None] * seq_len
    return torch.where(j >= 0, j + rows, torch.full_like(j + rows, -1))


def dense_entry_indices(batch: int, seq_len: int, num_entries: int, ratio: int,
                        device: torch.device) -> torch.Tensor:
    """[B, S, E] entry ids 0..E-1 visible to query t (i < (t+1)//ratio), -1 otherwise (HCA)."""
    visible = (torch.arange(seq_len, device=device) + 1) // ratio
    i = torch.arange(num_entries, device=device)
    ids = torch.where(i < visible[:, None], i, torch.full_like(i, -1))
    return ids.expand(batch, -1, -1)


def dense_masked_attention(q: torch.Tensor, kv: torch.Tensor, entries: torch.Tensor | None,
                           picks: torch.Tensor | None, window: int, sink: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """The sparse softmax of `sparse_attention` as masked dense attention over [keys | entries].

    q: [B, S, H, D]; kv: [B, S, D]; entries: [B, E, D] or None; picks: [B, S, k] entry ids (-1 =
    none). Query t sees raw keys t-W+1..t and its picked entries; the sink joins the softmax
    denominator. Returns [B, S, H, D] in q's dtype. Memory O(B*H*S*(S+E)): for training-length
    sequences.
    """
    B, S, H, _ = q.shape
    t = torch.arange(S, device=q.device)
    mask = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - window)        # [S, S]
    mask = mask.expand(B, S, S)
    keys = kv
    if entries is not None and picks is not None:
        E = entries.shape[1]
        # column E absorbs the -1s
        chosen = torch.zeros(B, S, E + 1, dtype=torch.bool, device=q.device)
        chosen.scatter_(-1, torch.where(picks >= 0, picks, E), True)
        mask = torch.cat((mask, chosen[..., :E]), dim=-1)                         # [B, S, S+E]
        keys = torch.cat((kv, entries.to(kv.dtype)), dim=1)                       # [B, S+E, D]
    logits = torch.einsum("bshd,bkd->bhsk", q, keys).float() * scale
    logits = logits.masked_fill(~mask[:, None], float("-inf"))
    sinks = sink.float()[None, :, None, None].expand(B, H, S, 1)
    probs = torch.softmax(torch.cat((logits, sinks), dim=-1), dim=-1)[..., :-1]
    return torch.einsum("bhsk,bkd->bshd", probs.to(keys.dtype), keys).to(q.dtype)


def pad_columns(ids: torch.Tensor, width: int) -> torch.Tensor:
    """ids [..., w] with -1 columns appended up to `width` (w <= width)."""
    extra = width - ids.shape[-1]
    assert extra >= 0, f"{ids.shape[-1]} index columns exceed the fixed width {width}"
    return F.pad(ids, (0, extra), value=-1) if extra else ids
