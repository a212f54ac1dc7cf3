"""`fuse_projections(model)`: the serving path's fused projection groups, built in place.

A batch-1 decode step is launch-bound: each small projection GEMM costs a launch whatever its size.
Each group of projections that read the same input becomes one weight [sum(out), in]
(`layers/fused.py::FusedRows`), run as one GEMM by the serving path (the `forward_cached` paths of
attention, indexer and compressor, and the shared expert under a `ForwardContext`), which then
reads the output's column slices. The groups:

- attention, input x: wq_a | wkv (| the indexer's weights_proj on CSA layers), in the model dtype;
- attention, input q_lat: wq_b | the indexer's wq_b (CSA layers);
- compressors, input x in fp32: wkv | wgate of the layer's compressor (| wkv | wgate of its
  indexer's compressor), through the backend's `project` op (raw scores: the compress ops add
  each compressor's ape as they pool);
- shared expert, input u: w1 | w3, then `swiglu` on the two halves.

Checkpoint-format FP8 linears (`model/quant_linear.py`) fuse among themselves: codes and 128x128
block scales stacked (`FusedRows.scale`), one `quant_linear` call, when every member but the last
holds whole 128-row scale blocks. On the official checkpoint that is wq_a | wkv (the float
weights_proj then runs alone, in the indexer's branch), wq_b | the indexer's wq_b and w1 | w3; a
group mixing FP8 and float members never fuses. The members' `weight` and `scale` buffers become
views like the parameters.

The members' parameters become views of the stacked weight's row blocks (`nn.Parameter(buf[a:b])`:
same names, shapes, dtypes and bytes, no second copy), so `state_dict`, in-place weight updates
(`engine/weight_sync.py::update_weights` copies into them, so the fused GEMM sees the new values)
and tensor-parallel shards (fused per rank, after `distributed/tp.py` has cut them) work as
before, and the full-sequence path, which reads the parameters, is unchanged. A member parameter
*replaced* after fusion rather than written in place (`param.data = ...`,
`load_state_dict(assign=True)`, `module.to(...)`) leaves the fused weight stale: run
`fuse_projections` again (it re-fuses a group whose members are no longer its views).

The engine fuses its model at start-up (`engine/runner.py`, `EngineConfig.fuse_projections`), not
in its invariant modes (`invariant_plans`, `batch_invariant`), where a token's bits must equal
those of the trainer's unfused full-sequence forward and a GEMM of another width may run another
kernel; the training model is never fused. Fused outputs equal the unfused ones to GEMM rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dsv4.kernels.ref.quant import FP8_BLOCK
from dsv4.model.attention import Attention
from dsv4.model.layers.fused import FusedRows
from dsv4.model.moe import MLP
from dsv4.model.quant_linear import QuantLinear


def fuse_projections(model: nn.Module, query_group: bool = True) -> int:
    """Fuse every group (module docstring) of `model`'s attention layers and shared experts in
    place; returns the number of fused groups (a group already fused counts, unchanged). A group
    whose members are not bias-free `nn.Linear`s of one dtype, device and input width stays
    unfused: one with a checkpoint-format FP8 member (`model/quant_linear.py`) among them.

    `query_group=False` leaves wq_b | the indexer's wq_b unfused (and undoes that group): with
    multi-stream branches (`model/streams.py`) the indexer's query projection then runs on the
    side stream beside wq_b, instead of holding the indexer branch behind the wider GEMM."""
    fused = 0
    for module in model.modules():
        if isinstance(module, Attention):
            x_group = _x_group(module)
            module.fused_x = (_fuse(module.fused_x, x_group)
                              or _fuse(module.fused_x, x_group[:2]))   # FP8 wq_a | wkv
            module.fused_q = (_fuse(module.fused_q, _q_group(module)) if query_group else
                              None)
            module.fused_compress = _fuse(module.fused_compress, _compress_group(module))
            fused += sum(g is not None for g in (module.fused_x, module.fused_q,
                                                 module.fused_compress))
        elif isinstance(module, MLP):
            module.fused_w13 = _fuse(module.fused_w13, [module.w1, module.w3])
            fused += module.fused_w13 is not None
    return fused


def unfuse_projections(model: nn.Module) -> None:
    """Back to one GEMM per projection on the serving path. The parameters stay views of the
    stacked weights (which they keep alive): the same values, read alone."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.fused_x = module.fused_q = module.fused_compress = None
        elif isinstance(module, MLP):
            module.fused_w13 = None


def is_fused(model: nn.Module) -> bool:
    """Whether any group of `model` is fused."""
    for m in model.modules():
        groups = ((m.fused_x, m.fused_q, m.fused_compress) if isinstance(m, Attention) else
                  (m.fused_w13,) if isinstance(m, MLP) else ())
        if any(g is not None for g in groups):
            return True
    return False


def _x_group(attn: Attention) -> list[nn.Module]:
    """The projections of the layer input x, in `Attention._x_projections`' order."""
    extra = [attn.indexer.weights_proj] if attn.indexer is not None else []
    return [attn.wq_a, attn.wkv, *extra]


def _q_group(attn: Attention) -> list[nn.Module]:
    """The projections of q_lat (wq_b | the indexer's wq_b): a group only with an indexer."""
    return [attn.wq_b, attn.indexer.wq_b] if attn.indexer is not None else []


def _compress_group(attn: Attention) -> list[nn.Linear]:
    """wkv, wgate of each compressor, in `Attention._compress_projections`' order."""
    if attn.compressor is None:
        return []
    group: list[nn.Linear] = []
    for c in attn.compressors():
        group += [c.wkv, c.wgate]
    return group


def _fuse(current: FusedRows | None, members: Sequence[nn.Module]) -> FusedRows | None:
    """`current` while it still holds `members`' weights; else a new stacked weight whose row
    blocks the members' weights become (copied in, then rebound); None for fewer than two
    members or members that cannot share one GEMM. Checkpoint-format FP8 members
    (`QuantLinear`) fuse among themselves: codes and scales stacked (`_fuse_quant`)."""
    if len(members) < 2:
        return None
    if all(isinstance(m, QuantLinear) for m in members):
        return _fuse_quant(current, [m for m in members if isinstance(m, QuantLinear)])
    linears = [m for m in members if isinstance(m, nn.Linear) and m.bias is None]
    if len(linears) != len(members):
        return None
    weights = [_tensor(m, "weight") for m in linears]
    if current is not None and current.holds(weights):
        return current
    if not _stackable(weights):
        return None
    stacked = _stack(members, weights, "weight")
    return FusedRows(stacked, [w.shape[0] for w in weights])


def _fuse_quant(current: FusedRows | None, members: Sequence[QuantLinear]) -> FusedRows | None:
    """The FP8 form of `_fuse`: codes [sum(out), in] and scales stacked, the members' `weight`
    and `scale` buffers rebound to their blocks; None unless every member but the last holds
    whole 128-row scale blocks (so the stacked blocks stay each member's own)."""
    weights, scales = [m.weight for m in members], [m.scale for m in members]
    if current is not None and current.holds(weights, scales):
        return current
    if not _stackable(weights) or any(w.shape[0] % FP8_BLOCK for w in weights[:-1]) or \
            any(sc.shape[1] != scales[0].shape[1] for sc in scales):
        return None
    stacked = _stack(members, weights, "weight")
    stacked_scale = _stack(members, scales, "scale")
    return FusedRows(stacked, [w.shape[0] for w in weights], stacked_scale)


def _tensor(module: nn.Module, name: str) -> torch.Tensor:
    t = getattr(module, name)
    assert isinstance(t, torch.Tensor)
    return t


def _stackable(weights: Sequence[torch.Tensor]) -> bool:
    """Matrices of one dtype, device and input width, not on the meta device."""
    first = weights[0]
    return first.device.type != "meta" and all(
        w.dim() == 2 and w.dtype == first.dtype and w.device == first.device
        and w.shape[1] == first.shape[1] for w in weights)


def _stack(members: Sequence[nn.Module], tensors: Sequence[torch.Tensor],
           name: str) -> torch.Tensor:
    """One [sum(rows), cols] tensor holding `tensors` in order; each member's `name` (a
    parameter keeps its requires_grad; a buffer stays a buffer) rebound to its row block."""
    stacked = torch.empty(sum(t.shape[0] for t in tensors), tensors[0].shape[1],
                          dtype=tensors[0].dtype, device=tensors[0].device)
    row = 0
    with torch.no_grad():
        for member, t in zip(members, tensors, strict=True):
            block = stacked[row:row + t.shape[0]]
            block.copy_(t)
            if isinstance(t, nn.Parameter):
                setattr(member, name, nn.Parameter(block, requires_grad=t.requires_grad))
            else:
                setattr(member, name, block)
            row += t.shape[0]
    return stacked
