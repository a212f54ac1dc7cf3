"""Reference mHC weight computation: split the mix into pre/post/comb and Sinkhorn-project comb (spec §5)."""

from __future__ import annotations

import torch


def hc_split_sinkhorn(mix: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n: int, iters: int,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mix: [..., (2+n)*n] fp32 (already RMS-scaled) -> pre [..., n], post [..., n], comb [..., n, n].

    comb[j, k] is the weight of input stream j in output stream k; after the final (column) step
    its columns sum to ~1. Orientation matters: consumers contract over the FIRST index.
    """
    scale, base = scale.float(), base.float()
    pre = torch.sigmoid(mix[..., :n] * scale[0] + base[:n]) + eps
    post = 2 * torch.sigmoid(mix[..., n:2 * n] * scale[1] + base[n:2 * n])
    logits = mix[..., 2 * n:].unflatten(-1, (n, n)) * scale[2] + base[2 * n:].view(n, n)
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb
