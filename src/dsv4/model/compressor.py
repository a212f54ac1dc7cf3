"""Token compressor shared by CSA (overlap, ratio 4), HCA (ratio m') and the indexer (spec §6.5).

Entry i summarises the tokens of window i (and, for overlap, the Ca half of window i-1) by gated
per-channel softmax pooling; then a weighted RMSNorm and RoPE at position i*ratio (the first
token of its own window). Projections and pooling run in fp32, as in the DeepSeek reference. The
projection weights are held in fp32, or, in a checkpoint-format model (`weight_format=
"checkpoint"`), in bf16 as the checkpoint stores them (`DeepSeekV4ForCausalLM.cast_`): the same
values, read at half the bytes and widened to fp32 where they are multiplied.

On the serving path the layer projects (`Attention._compress_projections`): where it is fused
(`model/fused_projections.py`) all its compressors' wkv and wgate are one `project` op, and the
compress ops read the column slices (kv and score of one row stride). The gate scores stay raw
there, in the rings too: the compress ops add the position embedding `ape` per source slot as
they pool (`kernels/ref/compressor.py`: the same fp32 add as the full-sequence path's
`score + ape[position % ratio]`, which needs no launch of its own).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.cache.pools import RingState
from dsv4.kernels.ref.compressor import CompressTarget, compress_windows, sequence_index
from dsv4.kernels.ref.rope_norm import apply_rope, rms_norm
from dsv4.kernels.registry import KernelOps
from dsv4.model.forward_context import CompressPlan, ForwardContext
from dsv4.model.kernel_values import kernel_values
from dsv4.model.layers.norm import RMSNorm


def _project(x: torch.Tensor, wkv: torch.Tensor, wgate: torch.Tensor,
             ops: KernelOps | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv, score) fp32 of x [..., d], the raw projections (no ape): x's fp32 values (an fp32 x
    used as is, any other dtype cast once, or, by the `project` op, widened as it reads it).

    `ops`: the backend's `project` op on x as [T, d] rows and the weights as they are held (fp32,
    or bf16 under the checkpoint format: widened as it reads them); else F.linear."""
    if ops is None:
        xf = x.float()
        return F.linear(xf, wkv.float()), F.linear(xf, wgate.float())
    rows = x.reshape(-1, x.shape[-1])
    kv, score = ops.project(rows, wkv), ops.project(rows, wgate)
    return kv.view(*x.shape[:-1], -1), score.view(*x.shape[:-1], -1)


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
                ops: KernelOps | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [..., d] -> the raw projections (kv, score) [..., c*Dc] fp32 (score without `ape`,
        which the compress ops add). `ops`: the GEMMs as that backend's `project` op (x [T, d]),
        else F.linear."""
        return _project(x, self.wkv.weight, self.wgate.weight, ops)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                values: KernelOps | None = None, paired: Compressor | None = None) -> torch.Tensor:
        """Full-sequence path: x [B, S, d] -> entries [B, S // ratio, Dc]; cos/sin: [S, rd/2].

        `values` (`ForwardMode.values`): the entries' values from that backend's serving ops, run
        as one step over all B * S tokens (`sequence_index`): the projections through `project`,
        pooling + norm + RoPE through `compress`, or with `paired` (a CSA layer's indexer
        compressor) through `compress_pair` as the engine runs them; the gradients from the
        formulation here."""
        params = (self.wkv.weight, self.wgate.weight, self.ape, self.norm.weight)
        if values is None:
            return self._entries(cos, sin, x, *params)
        ops = values
        return kernel_values(lambda *a: self._entries_op(ops, paired, cos, sin, *a),
                             lambda *a: self._entries(cos, sin, *a), x, *params)

    def _entries(self, cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor, wkv: torch.Tensor,
                 wgate: torch.Tensor, ape: torch.Tensor, norm_w: torch.Tensor) -> torch.Tensor:
        kv, score = _project(x, wkv, wgate, None)
        positions = torch.arange(x.shape[1], device=x.device)
        pooled = compress_windows(kv, score + ape.float()[positions % self.ratio], self.ratio,
                                  self.overlap)
        E, step = pooled.shape[1], self.ratio
        return apply_rope(rms_norm(pooled, norm_w, self.norm.eps), cos[: E * step: step],
                          sin[: E * step: step]).to(x.dtype)

    def _entries_op(self, ops: KernelOps, paired: Compressor | None, cos: torch.Tensor,
                    sin: torch.Tensor, x: torch.Tensor, wkv: torch.Tensor, wgate: torch.Tensor,
                    ape: torch.Tensor, norm_w: torch.Tensor) -> torch.Tensor:
        B, S = x.shape[:2]
        E = S // self.ratio
        index, entry_pos = sequence_index(B, S, self.ratio, self.overlap, x.device)
        rows = x.reshape(B * S, -1).float()              # cast once, shared with `paired`
        first = self._step_target(ops, rows, (wkv, wgate, ape, norm_w), B * E)
        if paired is None:
            ops.compress(*first[:4], index, first.norm_weight, self.norm.eps, cos[entry_pos],
                         sin[entry_pos], first.out, ape=first.ape)
        else:
            second = paired._step_target(ops, rows, (paired.wkv.weight, paired.wgate.weight,
                                                     paired.ape, paired.norm.weight), B * E)
            ops.compress_pair(first, second, index, self.norm.eps, cos[entry_pos],
                              sin[entry_pos])
        return first.out[:B * E].view(B, E, self.out_dim)

    def _step_target(self, ops: KernelOps, rows: torch.Tensor, params: tuple[torch.Tensor, ...],
                     entries: int) -> CompressTarget:
        """The compress ops' tensors for `rows` [T, d] as one step: the raw projections with the
        ape to add, a 1-row (trash) ring and `entries` + 1 output rows (the last: trash)."""
        wkv, wgate, ape, norm_w = params
        kv, score = _project(rows, wkv, wgate, ops)
        ring = kv.new_zeros(1, kv.shape[-1])
        out = rows.new_empty(entries + 1, self.out_dim)
        return CompressTarget(kv, score, ring, ring.clone(), norm_w, out, ape.float())

    def target(self, projected: tuple[torch.Tensor, torch.Tensor], state: RingState,
               out: torch.Tensor, out_scale: torch.Tensor | None = None,
               key_dtype: torch.dtype = torch.float32) -> CompressTarget:
        """This step's raw projections (kv, score) [T, c*Dc] fp32 (`project` with the step's ops,
        or the columns of the layer's fused projection) with the ring and entry pool they go to
        and the ape the op adds per slot: the compress ops' inputs. `out_scale`: `out` is an FP8
        pool (the indexer's), entries rounded to `key_dtype` before they are quantised."""
        kv, score = projected
        return CompressTarget(kv, score, state.kv, state.score, self.norm.weight, out,
                              self.ape.float(), out_scale, key_dtype)

    def forward_cached(self, projected: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext,
                       plan: CompressPlan, state: RingState, out: torch.Tensor) -> None:
        """Serving path: pool each window the new tokens complete into `out`; keep the ring current.

        projected: this step's (kv, score) [T, c*Dc] fp32 (`target`). The `compress` op
        (`kernels/ref/compressor.py::compress_cached`) pools, norms, ropes and writes the entries,
        reading older sources from the ring BEFORE overwriting any ring row. (A CSA layer serves
        this and its indexer's compressor in one `compress_pair` op: `model/attention.py`.)
        """
        assert plan.entry_cos is not None and plan.entry_sin is not None
        c = self.target(projected, state, out)
        ctx.ops.compress(c.kv, c.score, c.ring_kv, c.ring_score, plan.index, c.norm_weight,
                         self.norm.eps, plan.entry_cos, plan.entry_sin, c.out, ape=c.ape)
