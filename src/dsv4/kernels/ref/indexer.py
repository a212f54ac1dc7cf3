"""Reference lightning indexer scoring and deterministic top-k (spec §6.6).

Tie-breaking rule shared by every dsv4 top-k implementation: higher score first; among equal
scores the LOWER entry index wins. With ReLU scores exact ties are common (spec §13), so the
reference, the Triton kernel, the engine and the trainer must agree on this to select the same
set.
"""

from __future__ import annotations

import torch

from dsv4.kernels.ref.index_keys import dequantize_index_keys
from dsv4.kernels.ref.topk import topk_ragged


def index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """I[b,t,i] = Σ_h weights[b,t,h] * ReLU(q[b,t,h] · keys[b,i]).

    q: [B, S, Ih, Id]; keys: [B, E, Id]; weights: [B, S, Ih] (already scaled by Id^-1/2 Ih^-1/2).
    Returns [B, S, E] fp32 (no causal mask).
    """
    dots = torch.einsum("bshd,bed->bshe", q.float(), keys.float())
    return torch.einsum("bshe,bsh->bse", torch.relu(dots), weights.float())


def paged_index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                       candidates: torch.Tensor, *, weight_scale: float = 1.0,
                       key_scales: torch.Tensor | None = None,
                       q_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Serving-path scores over paged keys.

    I[t,j] = Σ_h w[t,h] * ReLU(q[t,h] · keys[candidates[t,j]]),  w = weights.float() * weight_scale
    (an fp32 multiply).

    q: [T, Ih, Id]; weights: [T, Ih] any float dtype and strides (the raw `weights_proj` output
    with the indexer's Id^-1/2 Ih^-1/2 as `weight_scale`, or weights already scaled in fp32 with
    the default 1.0); keys: [N, Id] the indexer-key pool: float, or float8_e4m3fn codes with
    `key_scales` [N] fp32 (`ref/index_keys.py`: a key's values are its codes times its scale);
    `q_scales` [T, Ih] fp32 (FP8 keys only): q is float8_e4m3fn codes, each head's values its
    codes times its scale (`rope_norm.rope_fp8`); candidates: [T, V] int64 pool slots, -1 = none.
    Returns [T, V] fp32, -inf where candidates < 0.
    """
    check_fp8_q(q, keys, key_scales, q_scales)
    slots = candidates.clamp(min=0)
    if key_scales is None:
        gathered = keys[slots].float()                                       # [T, V, Id]
    else:
        gathered = dequantize_index_keys(keys[slots], key_scales[slots])
    qf = q.float() if q_scales is None else dequantize_index_keys(q, q_scales)
    dots = torch.einsum("thd,tvd->thv", qf, gathered)
    scores = torch.einsum("thv,th->tv", torch.relu(dots), weights.float() * weight_scale)
    return scores.masked_fill(candidates < 0, float("-inf"))


def check_fp8_q(q: torch.Tensor, keys: torch.Tensor, key_scales: torch.Tensor | None,
                q_scales: torch.Tensor | None) -> None:
    """FP8 queries: float8_e4m3fn q with [T, Ih] fp32 `q_scales`, and only over FP8 keys (one FP8
    dot); ValueError names the field."""
    fp8 = q.dtype == torch.float8_e4m3fn
    if fp8 != (q_scales is not None):
        raise ValueError(f"q_scales go with float8_e4m3fn q, and only with it; got q {q.dtype}, "
                         f"q_scales {'given' if q_scales is not None else None}")
    if q_scales is None:
        return
    if key_scales is None or keys.dtype != torch.float8_e4m3fn:
        raise ValueError("q_scales (FP8 queries) need FP8 keys (float8_e4m3fn with key_scales)")
    if (q_scales.shape != q.shape[:2] or q_scales.dtype != torch.float32
            or q_scales.device != q.device or not q_scales.is_contiguous()):
        raise ValueError(f"q_scales must be [{q.shape[0]}, {q.shape[1]}] fp32, contiguous, on q's "
                         f"device; got {tuple(q_scales.shape)} {q_scales.dtype} on "
                         f"{q_scales.device}")


def topk_lower_index(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries along the last dim, ties -> lower index first.

    scores: [..., E]; returns [..., min(k, E)] int64, ordered by (score desc, index asc).
    """
    k = min(k, scores.shape[-1])
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[..., :k]


def causal_topk(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k over the visible entries of every query (the serving path's `topk_ragged`, batched).

    scores: [B, S, E]; visible: [B, S] number of visible entries per query (entries i < visible).
    Returns [B, S, k] int64 entry ids, -1 = none.
    """
    rows = visible.numel()
    picks = topk_ragged(scores.reshape(rows, scores.shape[-1]), visible.reshape(rows), k)
    return picks.view(*scores.shape[:-1], k)


def pick_slots(picks: torch.Tensor,
               candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's top-k picks as (entry ids, pool slots), each [T, K] int64, -1 = none.

    picks: [T, K] candidate columns (-1 = none; every pick < V); candidates: [T, V] pool slots
    (-1 = not visible, V >= 1). A pick counts only where its candidate is visible: ids = picks
    there, -1 elsewhere; slots = candidates at the ids.
    """
    visible = (candidates >= 0).gather(1, picks.clamp(min=0))
    ids = torch.where((picks >= 0) & visible, picks, -1)
    return ids, torch.where(ids >= 0, candidates.gather(1, ids.clamp(min=0)), -1)
