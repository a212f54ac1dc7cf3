"""Token compressor shared by CSA (overlap, ratio 4), HCA (ratio m') and the indexer (spec §6.5).

Entry i summarises the tokens of window i (and, for overlap, the Ca half of window i-1) by gated
per-channel softmax pooling; then a weighted RMSNorm and RoPE at position i*ratio (the first
token of its own window). Projections and pooling run in fp32, as in the DeepSeek reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.cache.pools import RingState
from dsv4.kernels.ref.compressor import CompressTarget, compress_windows
from dsv4.kernels.ref.rope_norm import apply_rope
from dsv4.model.forward_context import CompressPlan, ForwardContext
from dsv4.model.layers.norm import RMSNorm


class Compressor(nn.Module):
    def __init__(self, hidden_size: int, out_dim: int, ratio: int, overlap: bool,
                 eps: float) -> None:
        super().__init__()
        self.ratio, self.overlap, self.out_dim = ratio, overlap, out_dim
        width = (2 if overlap else 1) * out_dim
        self.wkv = nn.Linear(hidden_size, width, bias=False, dtype=torch.float32)
        self.wgate = nn.Linear(hidden_size, width, bias=False, dtype=torch.float32)
        self.ape = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32))
        self.norm = RMSNorm(out_dim, eps)

    def project(self, x: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [..., d], positions: [...] -> (kv, score) [..., c*Dc] fp32.

        score includes `ape[pos % ratio]`.
        """
        xf = x.float()
        kv = F.linear(xf, self.wkv.weight.float())
        score = F.linear(xf, self.wgate.weight.float())
        return kv, score + self.ape.float()[positions % self.ratio]

    def finish(self, pooled: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
        """Norm + RoPE of pooled entries.

        pooled: [B, E, Dc] fp32; cos/sin: [E, rd/2] at positions i*ratio.
        """
        return apply_rope(self.norm(pooled), cos, sin).to(dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Full-sequence path: x [B, S, d] -> entries [B, S // ratio, Dc]; cos/sin: [S, rd/2]."""
        kv, score = self.project(x, torch.arange(x.shape[1], device=x.device))
        pooled = compress_windows(kv, score, self.ratio, self.overlap)
        E = pooled.shape[1]
        return self.finish(pooled, cos[: E * self.ratio: self.ratio],
                           sin[: E * self.ratio: self.ratio], x.dtype)

    def target(self, x: torch.Tensor, ctx: ForwardContext, state: RingState,
               out: torch.Tensor) -> CompressTarget:
        """This step's projections of x [T, d] with the ring and entry pool they go to.

        These are the compress ops' inputs.
        """
        kv, score = self.project(x, ctx.positions)                              # [T, c*Dc] fp32
        return CompressTarget(kv, score, state.kv, state.score, self.norm.weight, out)

    def forward_cached(self, x: torch.Tensor, ctx: ForwardContext, plan: CompressPlan,
                       state: RingState, out: torch.Tensor) -> None:
        """Serving path: pool each window the new tokens complete into `out`; keep the ring current.

        x: [T, d] new tokens. The `compress` op (`kernels/ref/compressor.py::compress_cached`)
        pools, norms, ropes and writes the entries, reading older sources from the ring BEFORE
        overwriting any ring row. (A CSA layer serves this and its indexer's compressor in one
        `compress_pair` op: `model/attention.py`.)
        """
        assert plan.entry_cos is not None and plan.entry_sin is not None
        c = self.target(x, ctx, state, out)
        ctx.ops.compress(c.kv, c.score, c.ring_kv, c.ring_score, plan.index, c.norm_weight,
                         self.norm.eps, plan.entry_cos, plan.entry_sin, c.out)
