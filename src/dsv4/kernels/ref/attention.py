"""Reference sparse attention: one softmax over gathered keys plus a per-head sink (spec §6.7).

The key set of every query is given as a row of indices into one flat key buffer (raw window
keys and compressed entries live in the same buffer; -1 marks an empty slot). This is the
formulation the serving engine uses too: its pools are flat buffers and its metadata is index
rows, so the same function checks both paths.
"""

from __future__ import annotations

import torch

# Bound on gathered elements per chunk (queries * keys * head_dim) so long sequences fit in memory.
_CHUNK_ELEMS = 1 << 26


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """o[t,h] = Σ_j p[t,h,j] kv[idx[t,j]], p = softmax over valid j with exp(sink[h]) in the denominator.

    q: [T, H, D]; kv: [N, D] (K = V, shared by all heads); indices: [T, K] int64, -1 = no key;
    sink: [H] fp32. Returns [T, H, D] in q's dtype. Scores and softmax are fp32. A query with no
    valid key returns zeros (all mass on the sink).
    """
    T, _, D = q.shape
    K = indices.shape[1]
    step = max(1, _CHUNK_ELEMS // max(1, K * D))
    outs = [_attend(q[s:s + step], kv, indices[s:s + step], sink, scale) for s in range(0, T, step)]
    return torch.cat(outs, dim=0) if outs else q.new_zeros(q.shape)


def _attend(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
            scale: float) -> torch.Tensor:
    valid = indices >= 0                                          # [t, K]
    keys = kv[indices.clamp(min=0)].float()                       # [t, K, D]
    logits = torch.einsum("thd,tkd->thk", q.float(), keys) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink_f = sink.float()[None, :]                                # [1, H]
    peak = torch.maximum(logits.amax(dim=-1), sink_f)             # [t, H] (finite: the sink is)
    probs = torch.exp(logits - peak[..., None])
    denom = probs.sum(dim=-1) + torch.exp(sink_f - peak)
    out = torch.einsum("thk,tkd->thd", probs / denom[..., None], keys)
    return out.to(q.dtype)
