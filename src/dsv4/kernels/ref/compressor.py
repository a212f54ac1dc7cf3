"""Reference gated pooling of the token compressor (spec §6.5), before norm and RoPE.

Entry i of a non-overlap compressor pools the window [m*i, m*i + m) with a per-channel softmax
over positions. The overlap (C4) compressor pools 8 slots: the Ca half of window i-1 (slots 0..m-1)
and the Cb half of window i (slots m..2m-1); window 0's Ca slots have weight 0.
"""

from __future__ import annotations

import torch


def compress_windows(kv: torch.Tensor, score: torch.Tensor, ratio: int, overlap: bool) -> torch.Tensor:
    """Pool complete windows. kv, score: [B, S, c*Dc] fp32 (score already includes `ape`).

    Returns [B, S // ratio, Dc] fp32; the incomplete tail window (S % ratio tokens) is dropped.
    """
    B, S, width = kv.shape
    E = S // ratio
    kv = kv[:, :E * ratio].reshape(B, E, ratio, width)
    score = score[:, :E * ratio].reshape(B, E, ratio, width)
    if overlap:
        kv, score = _overlap_slots(kv, score)
    weights = torch.softmax(score, dim=2)
    return (kv * weights).sum(dim=2)


def _overlap_slots(kv: torch.Tensor, score: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # [B, E, m, 2*Dc] -> [B, E, 2m, Dc]: slots [0, m) = Ca of the previous window, [m, 2m) = Cb of this one
    dc = kv.shape[-1] // 2
    prev_kv = torch.cat((torch.zeros_like(kv[:, :1, :, :dc]), kv[:, :-1, :, :dc]), dim=1)
    prev_score = torch.cat((torch.full_like(score[:, :1, :, :dc], float("-inf")), score[:, :-1, :, :dc]), dim=1)
    return (torch.cat((prev_kv, kv[..., dc:]), dim=2), torch.cat((prev_score, score[..., dc:]), dim=2))


def pool_sources(kv: torch.Tensor, score: torch.Tensor, valid: torch.Tensor, ratio: int, overlap: bool) -> torch.Tensor:
    """Pool per-token source slots (serving path). kv, score: [T, S, c*Dc] fp32 for source positions
    p-S+1 .. p (S = 2*ratio with overlap, else ratio); valid: [T, S]. Returns [T, Dc] fp32.

    With overlap, slots [0, ratio) contribute their Ca half and slots [ratio, 2*ratio) their Cb half.
    """
    if overlap:
        dc = kv.shape[-1] // 2
        kv = torch.cat((kv[:, :ratio, :dc], kv[:, ratio:, dc:]), dim=1)
        score = torch.cat((score[:, :ratio, :dc], score[:, ratio:, dc:]), dim=1)
    score = score.masked_fill(~valid[..., None], float("-inf"))
    kv = kv.masked_fill(~valid[..., None], 0.0)
    return (kv * torch.softmax(score, dim=1)).sum(dim=1)
