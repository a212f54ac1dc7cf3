"""`attach_decode_gemv(model, on)`: split-K counters for the serving path's float projections.

A batch-1 decode step's projections are skinny GEMMs (one token row against a weight of up to 64
MB) that cuBLAS runs as a split-K kernel plus a reduce kernel at ~1.2-5x the weight's byte floor.
The triton backend's `linear` op (`kernels/triton/gemv.py::triton_decode_linear`) runs them in one
launch with the cross-split reduction inside it, which needs per call site a zeroed int32 buffer
of arrival counters that every call leaves zero (no memset per step). This module gives each
projection of the decode path its own: the bias-free 16-bit `nn.Linear`s of attention (wq_a, wkv,
wq_b, wo_b), the indexer (wq_b, weights_proj) and the shared expert (w1, w2, w3) a non-persistent
buffer `GEMV_COUNTERS` (not in `state_dict`), and each fused group (`layers/fused.py::FusedRows`)
its `counters`. The MoE gate (`moe.py::Gate`, 16-bit weight) gets the same buffer: its logits then
go through the backend's `moe_gate_logits` op (a decode GEMV with fp32 sums, no fp32 copy of the
weight per step) instead of the reference's casts. `model/quant_linear.py::linear` and
`FusedRows.gemm` route a projection to the `linear` op only when it has counters, so a model
without them (training, the reference path) runs `F.linear` exactly as before. The shared expert's
w2 with counters takes the `swiglu_linear` op instead (`MLP.forward`: its SwiGLU computed inside
the w2 GEMV, one launch, the bits of the `swiglu` op then the `linear` op).

Own buffers per call site, not one shared one: under multi-stream branches (`model/streams.py`)
the indexer's wq_b runs on the side stream while wq_b runs on the main one; calls that share a
counter buffer must never overlap. CUDA-graph replays of one engine run one at a time.

The engine attaches them at start-up (`engine/runner_setup.py`, `EngineConfig.decode_gemv`), after
fusing, and removes them in its invariant modes (`invariant_plans`, `batch_invariant`: a token's
bits must equal the trainer's full-sequence forward, which runs cuBLAS at every row count).
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.kernels.ops import DECODE_BLOCK_N
from dsv4.model.attention import Attention
from dsv4.model.layers.fused import FusedRows
from dsv4.model.moe import MLP, Gate
from dsv4.model.quant_linear import GEMV_COUNTERS

_ATTENTION = ("wq_a", "wkv", "wq_b", "wo_b")
_INDEXER = ("wq_b", "weights_proj")
_MLP = ("w1", "w2", "w3")


def attach_decode_gemv(model: nn.Module, on: bool = True) -> int:
    """Give (on) or take (off) the decode path's projections and fused groups their split-K
    counters (module docstring); returns the number of call sites that have them."""
    sites = 0
    for module in model.modules():
        if isinstance(module, Attention):
            linears = [getattr(module, n) for n in _ATTENTION]
            if module.indexer is not None:
                linears += [getattr(module.indexer, n) for n in _INDEXER]
            groups = [module.fused_x, module.fused_q]
        elif isinstance(module, MLP):
            linears, groups = [getattr(module, n) for n in _MLP], [module.fused_w13]
        elif isinstance(module, Gate):
            sites += _set_buffer(module, module.weight, on)
            continue
        else:
            continue
        sites += sum(_set_module(m, on) for m in linears)
        sites += sum(_set_group(g, on) for g in groups if g is not None)
    return sites


def _counters(rows: int, device: torch.device) -> torch.Tensor:
    return torch.zeros(-(-rows // DECODE_BLOCK_N), dtype=torch.int32, device=device)


def _eligible(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.dtype in (torch.bfloat16, torch.float16)


def _set_module(module: nn.Module, on: bool) -> bool:
    """Counters on a bias-free 16-bit nn.Linear (a `QuantLinear` has its own op and buffer)."""
    if not (isinstance(module, nn.Linear) and module.bias is None):
        return False
    return _set_buffer(module, module.weight, on)


def _set_buffer(module: nn.Module, weight: torch.Tensor, on: bool) -> bool:
    """Give (on) or take (off) `module` its counters buffer for `weight` [rows, K]; False (and
    no buffer) when the weight is not a 16-bit matrix."""
    if not _eligible(weight):
        on = False
    if on and getattr(module, GEMV_COUNTERS, None) is None:
        module.register_buffer(GEMV_COUNTERS, _counters(weight.shape[0],  # (TP shards)
                                                        weight.device), persistent=False)
    elif not on and GEMV_COUNTERS in module._buffers:
        del module._buffers[GEMV_COUNTERS]
    return on


def _set_group(group: FusedRows, on: bool) -> bool:
    if group.scale is not None:      # FP8 codes: the `quant_linear` op's counters, always held
        return False
    if not _eligible(group.weight):
        group.counters = None
        return False
    if on and group.counters is None:
        group.counters = _counters(group.weight.shape[0], group.weight.device)
    elif not on:
        group.counters = None
    return on
