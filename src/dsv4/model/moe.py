"""Mixture of experts of every DeepSeek-V4 layer (spec §8).

Scores s = sqrt(softplus(u W_gate^T)) (fp32). Routed layers select top-k on s + bias (the bias
only steers selection); hash layers select by the fixed table tid2eid[token id]. Weights are the
selected scores renormalised and multiplied by `routed_scaling_factor`. Experts and the shared
expert are SwiGLU with the clamp at `swiglu_limit`. Routed expert weights are stacked [E, ...].

The gate's logits (`moe_gate_logits`: fp32 sums of the 16-bit operands; on the serving path a
decode GEMV when the engine gave the gate split-K counters, `model/decode_gemv.py`), its selection
and weights after them (`moe_gate_select`),
the shared expert's SwiGLU (`swiglu`) and the routed experts with the layer's combine (the shared
expert's output added, one cast: `routed_experts`) are kernel ops: the backend's on the serving
path and under `ForwardMode.values`, the references of `kernels/ref/moe.py` otherwise. On the
serving path a fused shared expert (`model/fused_projections.py`) runs w1 and w3 as one GEMM and
`swiglu` reads its two column halves; where the engine gave w2 decode counters, the SwiGLU and w2
are one op, `swiglu_linear` (on the triton backend one GEMV launch at decode that computes the
SwiGLU as it loads its input, bit-equal to the two ops); a checkpoint-format FP8 w2 runs its
`quant_linear` op in the SwiGLU mode (`up=`) alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dsv4.config.model import ModelConfig
from dsv4.kernels.ref.moe import (
    SharedJoin,
    WaitShared,
    moe_gate_logits,
    moe_gate_select,
    routed_experts,
    routed_experts_dense,
    swiglu,
)
from dsv4.kernels.registry import KernelOps
from dsv4.model.forward_context import ForwardContext
from dsv4.model.forward_mode import ForwardMode
from dsv4.model.kernel_values import kernel_values
from dsv4.model.layers.fused import FusedRows
from dsv4.model.quant_linear import GEMV_COUNTERS, QuantLinear, linear
from dsv4.model.streams import join, side


class Gate(nn.Module):
    def __init__(self, config: ModelConfig, moe_type: str) -> None:
        super().__init__()
        self.is_hash, self.topk = moe_type == "hash", config.num_experts_per_tok
        self.route_scale = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.tid2eid: torch.Tensor | None
        self.register_buffer("tid2eid", torch.zeros(config.vocab_size, self.topk, dtype=torch.int64)
                             if self.is_hash else None)
        self.bias = None if self.is_hash else nn.Parameter(torch.zeros(config.n_routed_experts,
                                                                       dtype=torch.float32))

    def forward(self, u: torch.Tensor, input_ids: torch.Tensor,
                replayed: torch.Tensor | None = None, ctx: ForwardContext | None = None,
                values: KernelOps | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """u: [N, d], input_ids: [N] -> (expert ids [N, k] int64, weights [N, k] fp32).

        `replayed` [N, k] (R3): use these expert ids instead of selecting; the weights are the
        live scores gathered at them, so the gate weight keeps its gradient. -1 rows (padding
        tokens) take experts 0..k-1.

        The logits: the backend's op `moe_gate_logits` with a `ctx` (serving) and the gate's
        split-K counters (`GEMV_COUNTERS`, given by the engine outside its invariant modes);
        otherwise the reference, `F.linear` of the fp32 casts. The rest is the op
        `moe_gate_select`: the backend's with a `ctx` (serving); with `values` (a full-sequence
        `ForwardMode.values`) that op's ids and weights, the weights differentiable through the
        reference at those ids (so the gradient reaches u and the gate weight); otherwise the
        reference (`kernels/ref/moe.py`).
        """
        counters = getattr(self, GEMV_COUNTERS, None)
        if ctx is not None and counters is not None:
            logits = ctx.ops.moe_gate_logits(u, self.weight, counters=counters)
        else:
            logits = moe_gate_logits(u, self.weight)
        hashed = self.tid2eid[input_ids] if self.tid2eid is not None and replayed is None else None
        k, scale = self.topk, self.route_scale
        if ctx is not None:
            return ctx.ops.moe_gate_select(logits, self.bias, hashed, replayed, k, scale)
        if values is None:
            return moe_gate_select(logits, self.bias, hashed, replayed, k, scale)
        with torch.no_grad():
            indices, fast = values.moe_gate_select(logits, self.bias, hashed, replayed, k, scale)
        # the op's weights as they are (computed once, with its ids); gradients of the reference
        # at those ids (a replay of them: the selection carries no gradient)
        weights = kernel_values(lambda _logits: fast,
                                lambda l_: moe_gate_select(l_, None, None, indices, k, scale)[1],
                                logits)
        return indices, weights


@dataclass(frozen=True)
class Combine:
    """What the routed-expert op adds and casts at its end (`kernels/ref/moe.py`): the shared
    expert's output `shared` [N, d] (None: nothing), the result dtype, and the stream join to run
    before `shared` is read (None: it is produced on the current stream)."""

    shared: torch.Tensor | None = None
    out_dtype: torch.dtype = torch.float32
    wait_shared: WaitShared | None = None

    def kwargs(self) -> dict[str, Any]:
        return {"shared": self.shared, "out_dtype": self.out_dtype,
                "wait_shared": self.wait_shared}


NO_COMBINE = Combine()


class Experts(nn.Module):
    """The routed experts, stacked: w1, w3 [E, I, d]; w2 [E, d, I]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        E, inter, d = config.n_routed_experts, config.moe_inter_dim, config.hidden_size
        self.limit = config.swiglu_limit
        self.w1 = nn.Parameter(torch.empty(E, inter, d))
        self.w2 = nn.Parameter(torch.empty(E, d, inter))
        self.w3 = nn.Parameter(torch.empty(E, inter, d))

    def forward(self, u: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                ctx: ForwardContext | None = None, *, mode: ForwardMode | None = None,
                combine: Combine = NO_COMBINE) -> torch.Tensor:
        """u [N, d] -> [N, d] in `combine.out_dtype`, `combine.shared` added in fp32 first.

        Serving (`ctx`): the backend's op. Full sequence: `mode.experts` "sparse" runs the
        per-expert reference (the `ref` backend's op); "dense" runs three GEMMs over all experts
        (no data-dependent shapes or host syncs: what training and torch.compile want; tested
        equal). With `mode.values`: that backend's op's values (its combine included), the
        formulation's gradients (`shared` gets its gradient too).
        """
        if ctx is not None:
            return ctx.ops.routed_experts(u, self.w1, self.w2, self.w3, indices, weights,
                                          self.limit, **combine.kwargs())
        assert mode is not None, "a full-sequence forward needs a ForwardMode"
        fn = routed_experts_dense if mode.experts == "dense" else routed_experts
        limit, out_dtype, wait = self.limit, combine.out_dtype, combine.wait_shared
        if mode.values is not None:
            ops = mode.values
            shared = () if combine.shared is None else (combine.shared,)
            return kernel_values(
                lambda u_, w1, w2, w3, wts, *sh: ops.routed_experts(
                    u_, w1, w2, w3, indices, wts, limit, shared=sh[0] if sh else None,
                    out_dtype=out_dtype, wait_shared=wait),
                lambda u_, w1, w2, w3, wts, *sh: fn(
                    u_, w1, w2, w3, indices, wts, limit, shared=sh[0] if sh else None,
                    out_dtype=out_dtype),
                u.contiguous(), self.w1, self.w2, self.w3, weights, *shared)
        return fn(u, self.w1, self.w2, self.w3, indices, weights, limit, **combine.kwargs())


class MLP(nn.Module):
    """The shared expert: SwiGLU with the same clamp as the routed experts."""

    def __init__(self, hidden_size: int, inter_dim: int, limit: float) -> None:
        super().__init__()
        self.limit = limit
        self.w1 = nn.Linear(hidden_size, inter_dim, bias=False)
        self.w2 = nn.Linear(inter_dim, hidden_size, bias=False)
        self.w3 = nn.Linear(hidden_size, inter_dim, bias=False)
        # w1 | w3 as one weight on the serving path (`model/fused_projections.py`; None: two GEMMs)
        self.fused_w13: FusedRows | None = None

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None,
                values: KernelOps | None = None) -> torch.Tensor:
        """x [N, d] -> [N, d] in the weights' dtype. The SwiGLU is the op `swiglu`: the backend's
        with a `ctx` (serving, where a fused w1 | w3 is one GEMM whose two column halves the op
        reads in place); with `values` (`ForwardMode.values`) that op's values and the
        reference's gradient; otherwise the reference. Serving with w2's split-K counters
        (`GEMV_COUNTERS`, `model/decode_gemv.py`), the SwiGLU and w2 are the one op
        `swiglu_linear` (one launch at decode; the same bits as `swiglu` then the `linear` op);
        with an FP8 w2 (`QuantLinear`) the `quant_linear` op in its SwiGLU mode (the same bits as
        `swiglu` then `quant_linear`)."""
        limit = self.limit
        if ctx is not None:
            ops = ctx.ops
            gate, up = (self.fused_w13(x, self.fused_w13.gemm(ops))
                        if self.fused_w13 is not None else
                        (linear(self.w1, x, ops), linear(self.w3, x, ops)))
            if isinstance(self.w2, QuantLinear):
                return self.w2(gate, ops, up=up, limit=limit)
            counters = getattr(self.w2, GEMV_COUNTERS, None)
            if counters is not None:
                return ops.swiglu_linear(gate, up, limit, self.w2.weight, counters=counters)
            return linear(self.w2, ops.swiglu(gate, up, limit), ops)
        gate, up = self.w1(x), self.w3(x)
        if values is not None:
            ops = values
            h = kernel_values(lambda g, u_: ops.swiglu(g, u_, limit),
                              lambda g, u_: swiglu(g, u_, limit), gate, up)
        else:
            h = swiglu(gate, up, limit)
        return self.w2(h)


class MoE(nn.Module):
    def __init__(self, config: ModelConfig, moe_type: str, layer_id: int = -1) -> None:
        super().__init__()
        # index into Replay.experts' layer axis; None for MTP blocks (never replayed)
        self.replay_index = layer_id if 0 <= layer_id < config.num_layers else None
        self.gate = Gate(config, moe_type)
        self.experts = Experts(config)
        self.shared_experts = MLP(config.hidden_size, config.moe_inter_dim, config.swiglu_limit)
        # the fp32 output's reduction across tensor-parallel ranks (`distributed/tp.py` swaps in
        # an all-reduce; one process: identity)
        self.reduce: nn.Module = nn.Identity()

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, ctx: ForwardContext | None = None,
                *, mode: ForwardMode | None = None) -> torch.Tensor:
        """x: [B, S, d], input_ids: [B, S] -> [B, S, d]; accumulated in fp32, cast back once.

        The routed-expert op adds the shared expert's output and casts (`Combine`): one launch on
        the kernel backend. On one process the cast is the op's; under tensor parallelism
        (`self.reduce` an all-reduce) the op returns the fp32 sum, reduced across ranks, then cast
        (the ranks' partial sums are never rounded before the reduction)."""
        u = x.reshape(-1, x.shape[-1])
        replayed = None
        if mode is not None and mode.replay is not None and mode.replay.experts is not None \
                and self.replay_index is not None:
            replayed = mode.replay.experts[:, :, self.replay_index].reshape(u.shape[0], -1)
        values = mode.values if mode is not None else None
        # the shared expert on the side stream: beside the gate (joined before the routed GEMMs)
        # or, in forwards of up to `ctx.shared_beside_max_tokens` tokens, forked after the gate
        # and beside the routed experts (joined before the combine); one stream: in program
        # order, the same values either way
        stream = ctx.side_stream if ctx is not None else None
        beside = (stream is not None and ctx is not None
                  and u.shape[0] <= ctx.shared_beside_max_tokens)
        if not beside:
            with side(stream):
                shared = self.shared_experts(u, ctx, values)
        indices, weights = self.gate(u, input_ids.reshape(-1), replayed, ctx, values)
        if beside:
            with side(stream):
                shared = self.shared_experts(u, ctx, values)
        if ctx is not None and ctx.captured is not None:
            ctx.captured.setdefault("experts", []).append(indices)
        local = isinstance(self.reduce, nn.Identity)
        combine = Combine(shared, x.dtype if local else torch.float32,
                          SharedJoin(lambda: join(stream), beside) if stream is not None else None)
        out = self.experts(u, indices, weights, ctx, mode=mode, combine=combine)
        if not local:
            out = self.reduce(out).to(x.dtype)
        return out.view_as(x)
