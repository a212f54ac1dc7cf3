"""Reference sparse attention: one softmax over gathered keys plus a per-head sink (spec §6.7).

The key set of every query is given as a row of indices into one flat key buffer (raw window
keys and compressed entries live in the same buffer; -1 marks an empty slot). This is the
formulation the serving engine uses too: its pools are flat buffers and its metadata is index
rows, so the same function checks both paths.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dsv4.kernels.ref.rope_norm import rope_inverse

# Bound on gathered elements per chunk (queries * keys * head_dim) so long sequences fit in memory.
_CHUNK_ELEMS = 1 << 26


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """o[t,h] = Σ_j p[t,h,j] kv[idx[t,j]], p = softmax over valid j with exp(sink[h]) in the
    denominator.

    q: [T, H, D]; kv: [N, D] (K = V, shared by all heads); indices: [T, K] int64, -1 = no key;
    sink: [H] fp32. Returns [T, H, D] in q's dtype. Scores and softmax are fp32. A query with no
    valid key returns zeros (all mass on the sink).
    """
    return sparse_attention_multi(q, [(kv, indices)], sink, scale)


def sparse_attention_multi(q: torch.Tensor, sources: Sequence[tuple[torch.Tensor, torch.Tensor]],
                           sink: torch.Tensor, scale: float, *,
                           inverse_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                           ) -> torch.Tensor:
    """One softmax over the union of several key buffers.

    `sources` = [(kv [N_i, D], indices [T, K_i])]. The serving path uses two: the SWA pool with
    window indices and the compressed pool with entry ids. `inverse_rope` = (cos, sin) [T, rd/2]:
    the output then de-rotated by `rope_inverse` (the serving path's form: K = V carries RoPE).
    """
    o = _attend_sources(q, sources, sink, scale)
    return o if inverse_rope is None else rope_inverse(o, *inverse_rope)


def _attend_sources(q: torch.Tensor, sources: Sequence[tuple[torch.Tensor, torch.Tensor]],
                    sink: torch.Tensor, scale: float) -> torch.Tensor:
    T, _, D = q.shape
    K = sum(idx.shape[1] for _, idx in sources)
    step = max(1, _CHUNK_ELEMS // max(1, K * D))
    outs = []
    for s in range(0, T, step):
        keys = torch.cat([kv[idx[s:s + step].clamp(min=0)] for kv, idx in sources], dim=1)
        valid = torch.cat([idx[s:s + step] >= 0 for _, idx in sources], dim=1)
        outs.append(attend_gathered(q[s:s + step], keys, valid, sink, scale))
    return torch.cat(outs, dim=0) if outs else q.new_zeros(q.shape)


def attend_gathered(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Attention over keys already gathered per query.

    q: [t, H, D]; keys: [t, K, D]; valid: [t, K] bool.
    """
    keys = keys.float()
    logits = torch.einsum("thd,tkd->thk", q.float(), keys) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink_f = sink.float()[None, :]                                # [1, H]
    peak = torch.maximum(logits.amax(dim=-1), sink_f)             # [t, H] (finite: the sink is)
    probs = torch.exp(logits - peak[..., None])
    denom = probs.sum(dim=-1) + torch.exp(sink_f - peak)
    out = torch.einsum("thk,tkd->thd", probs / denom[..., None], keys)
    return out.to(q.dtype)
