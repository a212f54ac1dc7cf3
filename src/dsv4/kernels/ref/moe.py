"""Reference routed-expert application (spec §8): SwiGLU with clamp, weights applied before W2.

Tokens are grouped by expert with one sort; the per-expert counts come to the host once
(the named sync point of this op) so each expert runs one dense matmul over its tokens.

The routed-expert ops end with the layer's combine: an optional `shared` addend [N, d] (the shared
expert's output, any float dtype) is added in fp32 and the sum cast to `out_dtype` once
(`add_shared`), so the MoE layer needs no glue of its own. `wait_shared` (None: nothing to wait
for) is called once, after the routed sums and before `shared` is read: the caller's stream join
when `shared` is produced on a side stream (`model/streams.py`), so the two branches overlap up to
the combine. `moe_combine` is the fixed-order sum over k the Triton kernels' combine launch
computes (`kernels/triton/moe_combine.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dsv4.kernels.ref.act_quant import fake_act_quant
from dsv4.kernels.ref.fp8_linear import dense_linear
from dsv4.kernels.ref.swiglu import swiglu

WaitShared = Callable[[], None]


@dataclass(frozen=True)
class SharedJoin:
    """A `wait_shared` that says where the Triton ops call it: before the expert GEMMs (the
    default; the side branch ran beside the gate) or, with `beside_gemms`, only before the combine
    reads `shared`, so the side branch runs beside the GEMMs (`model/moe.py`, EngineConfig
    `shared_expert_beside_max_tokens`). The reference ops always call it at the combine."""

    wait: WaitShared
    beside_gemms: bool = False

    def __call__(self) -> None:
        self.wait()


def swiglu_linear(gate: torch.Tensor, up: torch.Tensor, limit: float, w: torch.Tensor, *,
                  counters: torch.Tensor | None = None) -> torch.Tensor:
    """The shared expert's output projection of its SwiGLU: `dense_linear(swiglu(gate, up,
    limit), w)` (gate, up [N, I], w [d, I] -> [N, d] in gate's dtype). `counters` (the kernel's
    split-K scratch) is unused here."""
    return dense_linear(swiglu(gate, up, limit), w)


def moe_gate_logits(u: torch.Tensor, weight: torch.Tensor, *,
                    counters: torch.Tensor | None = None) -> torch.Tensor:
    """The gate's fp32 logits: u [N, d] (any float dtype) times weight [E, d]^T -> [N, E] fp32,
    both operands cast to fp32 first (bf16 / fp16 products are then exact). `counters` (the
    kernel's split-K scratch) is unused here."""
    return F.linear(u.float(), weight.float())


def moe_gate_select(logits: torch.Tensor, bias: torch.Tensor | None, hashed: torch.Tensor | None,
                    replayed: torch.Tensor | None, k: int,
                    route_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate's expert ids and weights from its fp32 logits [N, E] (= u W_gate^T) (spec §8).

    Scores s = sqrt(softplus(logits)). Ids [N, k] int64: `replayed` (R3: recorded ids, -1 slots
    take expert j in slot j) if given, else `hashed` (the hash layers' tid2eid[token id]) if
    given, else top-k of s + `bias` [E] (the bias only steers selection; descending order).
    Weights [N, k] fp32: s at the ids, divided by their sum (+ 1e-20), times `route_scale`;
    differentiable in `logits` (the selection is not).
    """
    scores = F.softplus(logits).sqrt()
    if replayed is not None:
        fill = torch.arange(k, device=logits.device).expand_as(replayed)
        indices = torch.where(replayed >= 0, replayed, fill).long()
    elif hashed is not None:
        indices = hashed.long()
    else:
        assert bias is not None, "routed gate without a bias"
        indices = torch.topk(scores.detach() + bias.float(), k, dim=-1).indices
    weights = scores.gather(1, indices)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return indices, weights * route_scale


def add_shared(routed: torch.Tensor, shared: torch.Tensor | None, out_dtype: torch.dtype,
               wait_shared: WaitShared | None = None) -> torch.Tensor:
    """The combine's tail: `(routed + shared.float()).to(out_dtype)` (`routed` alone if `shared`
    is None): routed [N, d] fp32; `wait_shared` is called first (module docstring). With no
    shared and fp32 out this returns `routed` itself."""
    if wait_shared is not None:
        wait_shared()
    out = routed if shared is None else routed + shared.float()
    return out.to(out_dtype)


def moe_combine(parts: torch.Tensor, shared: torch.Tensor | None,
                out_dtype: torch.dtype) -> torch.Tensor:
    """parts [N, k, d] fp32 (one routed expert's weighted output per slot) -> [N, d] `out_dtype`:
    the slots summed in ascending order in fp32, ((p0 + p1) + p2) + ..., plus `shared` [N, d]
    (any float dtype, added in fp32 last), one rounding to `out_dtype`. k >= 1."""
    acc = parts[:, 0]
    for j in range(1, parts.shape[1]):
        acc = acc + parts[:, j]
    return add_shared(acc, shared, out_dtype)


def routed_experts(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                   indices: torch.Tensor, weights: torch.Tensor, limit: float, *,
                   shared: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
                   wait_shared: WaitShared | None = None) -> torch.Tensor:
    """y[t] = Σ_k weights[t,k] * W2_e (swiglu(W1_e x, W3_e x)) with e = indices[t,k].

    x: [N, d]; w1, w3: [E, I, d]; w2: [E, d, I]; indices: [N, k] int64; weights: [N, k] fp32.
    Returns [N, d] `out_dtype`: y in fp32 plus `shared` (`add_shared`, the module docstring), cast
    once. Rounding as the grouped kernel's (`kernels/triton/moe.py`): the GEMMs accumulate and
    return fp32, SwiGLU and the routing weight run in fp32, and only the hidden h is rounded to x's
    dtype.
    """
    N, k = indices.shape
    num_experts = w1.shape[0]
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # sync point: per-expert token counts
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    out = torch.zeros(N, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        slots = order[start:start + count]
        start += count
        tokens = slots // k
        # index_select: its backward is index_add, not a sorted scatter
        xe = x.index_select(0, tokens).float()
        h = swiglu(F.linear(xe, w1[e].float()), F.linear(xe, w3[e].float()), limit)
        h = (h * weights.reshape(-1).index_select(0, slots)[:, None]).to(x.dtype)
        # .float(): under autocast (the trainer's bf16 evaluation) F.linear returns bf16
        out.index_add_(0, tokens, F.linear(h.float(), w2[e].float()).float())
    return add_shared(out, shared, out_dtype, wait_shared)


def routed_experts_a8(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                      indices: torch.Tensor, weights: torch.Tensor, limit: float, *,
                      shared: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
                      wait_shared: WaitShared | None = None) -> torch.Tensor:
    """`routed_experts` with the reference model's FP8 activations (spec §11.1-2): each expert
    linear reads its input through `act_quant` (per token, per 128 channels, e4m3 with a
    power-of-two scale), as the W8A8 kernels (`kernels/triton/moe_w8a8.py`) compute it.

    y[t] = Σ_k weights[t,k] * W2_e q(h), h = swiglu(W1_e q(x_t), W3_e q(x_t)) rounded to x's
    dtype, q = `fake_act_quant`: the routing weight multiplies W2's product (as the reference
    model's MoE does), not h, whose quantisation it would change. Products and sums in fp32.
    """
    N, k = indices.shape
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # sync point: per-expert token counts
    counts = torch.bincount(flat, minlength=w1.shape[0]).tolist()
    xq = fake_act_quant(x)
    out = torch.zeros(N, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        slots = order[start:start + count]
        start += count
        tokens = slots // k
        xe = xq.index_select(0, tokens)
        h = swiglu(F.linear(xe, w1[e].float()), F.linear(xe, w3[e].float()), limit).to(x.dtype)
        y = F.linear(fake_act_quant(h), w2[e].float()).float()
        out.index_add_(0, tokens, y * weights.reshape(-1).index_select(0, slots)[:, None])
    return add_shared(out, shared, out_dtype, wait_shared)


def routed_experts_dense(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                         indices: torch.Tensor, weights: torch.Tensor, limit: float, *,
                         shared: torch.Tensor | None = None,
                         out_dtype: torch.dtype = torch.float32,
                         wait_shared: WaitShared | None = None) -> torch.Tensor:
    """Same contract as `routed_experts`, computed for every expert on every token.

    Three dense GEMMs over the experts stacked as one [E*I]-wide SwiGLU, its hidden units scaled by
    the combine weights scattered into [N, E] (zero for unselected experts, so they add nothing to
    the output nor to any gradient).

    No data-dependent shapes and no host sync, so it traces under torch.compile and costs a handful
    of launches; but it does E/k times the expert FLOPs and holds [N, E*I] activations, so it only
    pays when E*I is small (the `tiny` preset: E=16, I=256, d=256). The training path of
    `model/moe.py::Experts` uses it.
    """
    N, d = x.shape
    E, inter, _ = w1.shape
    combine = torch.zeros(N, E, dtype=weights.dtype,
                          device=x.device).scatter_add(1, indices, weights)
    gate = F.linear(x, w1.reshape(E * inter, d)).view(N, E, inter)
    up = F.linear(x, w3.reshape(E * inter, d)).view(N, E, inter)
    h = (swiglu(gate, up, limit).float() * combine[:, :, None]).to(x.dtype)
    w2_flat = w2.permute(1, 0, 2).reshape(d, E * inter)        # column e*I+i is w2[e, :, i]
    return add_shared(F.linear(h.reshape(N, E * inter), w2_flat).float(), shared, out_dtype,
                      wait_shared)


def routed_experts_grouped(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                           indices: torch.Tensor, weights: torch.Tensor, limit: float, *,
                           shared: torch.Tensor | None = None,
                           out_dtype: torch.dtype = torch.float32,
                           wait_shared: WaitShared | None = None) -> torch.Tensor:
    """Same contract as `routed_experts`, as three grouped GEMMs.

    `torch._grouped_mm` (CUDA bf16, Hopper) with the token-to-expert grouping on the device: no
    host sync and three launches instead of three per expert.
    """
    N, k = indices.shape
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # per-expert counts by a scatter-add: bincount would sync (it sizes its output by the max)
    counts = torch.zeros(w1.shape[0], dtype=torch.int32, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    tokens = order // k
    xs = x[tokens]                                          # [N*k, d] grouped by expert
    gate = torch._grouped_mm(xs, w1.transpose(1, 2), offs=offs)             # [N*k, I]
    up = torch._grouped_mm(xs, w3.transpose(1, 2), offs=offs)
    h = (swiglu(gate, up, limit).float() * weights.reshape(-1)[order, None]).to(x.dtype)
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)                 # [N*k, d]
    out = torch.zeros(N, x.shape[1], dtype=torch.float32,
                      device=x.device).index_add_(0, tokens, y.float())
    return add_shared(out, shared, out_dtype, wait_shared)


def pack_w13(w1: torch.Tensor, s1: torch.Tensor | None, w3: torch.Tensor, s3: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate stacked [E, I, *] w1 and w3 (and scales) into the `w13` layout: [W1; W3], dim 1.

    fp4 scales are per row, fp8 scales per 128-row block: either way the scale tensors concatenate
    along dim 1 too (w3's fp8 blocks start on a fresh block row, so I need not be a multiple of
    128).
    """
    w13 = torch.cat((w1, w3), dim=1).contiguous()
    if s1 is None or s3 is None:
        return w13, None
    return w13, torch.cat((s1, s3), dim=1).contiguous()


def _dequant_stack(w: torch.Tensor, scale: torch.Tensor | None, fmt: str,
                   dtype: torch.dtype) -> torch.Tensor:
    """[E, out, in(/2)] codes + scales -> [E, out, in] `dtype`.

    One expert at a time with `dsv4.kernels.ref.quant`.
    """
    from dsv4.kernels.ref.quant import dequant_fp4_group, dequant_fp8_block

    if fmt == "bf16":
        return w.to(dtype)
    if scale is None or fmt not in ("fp8", "fp4"):
        raise ValueError(f"fmt must be bf16, fp8 or fp4 (with scales); got {fmt!r}")
    fn = dequant_fp8_block if fmt == "fp8" else dequant_fp4_group
    return torch.stack([fn(w[e], scale[e], dtype) for e in range(w.shape[0])])


def routed_experts_quant(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor | None,
                         w2: torch.Tensor, w2_scale: torch.Tensor | None, indices: torch.Tensor,
                         weights: torch.Tensor, limit: float, fmt: str, *,
                         shared: torch.Tensor | None = None,
                         out_dtype: torch.dtype = torch.float32,
                         wait_shared: WaitShared | None = None,
                         act_quant: bool = False) -> torch.Tensor:
    """`routed_experts` on quantised experts: dequantise to x.dtype, then the bf16 reference;
    with `act_quant` (fmt "fp8" or "fp4") the activations FP8 too: `routed_experts_a8`.

    fmt "fp4": w13 [E, 2I, d/2] e2m1 packed + e8m0 [E, 2I, d/32]; w2 [E, d, I/2] + [E, d, I/32].
    fmt "fp8": w13 [E, 2I, d] e4m3 + e8m0 [E, 2 * ceil(I/128), ceil(d/128)]; w2 [E, d, I] +
    [E, ceil(d/128), ceil(I/128)]. fmt "bf16": w13 [E, 2I, d], w2 [E, d, I], scales None.
    w13 = `pack_w13(w1, s1, w3, s3)`.
    """
    if act_quant and fmt == "bf16":
        raise ValueError("act_quant=True needs quantised experts; allowed fmt: 'fp8', 'fp4'")
    w1, w3, w2d = dequant_experts(w13, w13_scale, w2, w2_scale, fmt, x.dtype)
    apply = routed_experts_a8 if act_quant else routed_experts
    return apply(x, w1, w2d, w3, indices, weights, limit, shared=shared, out_dtype=out_dtype,
                 wait_shared=wait_shared)


def dequant_experts(w13: torch.Tensor, w13_scale: torch.Tensor | None, w2: torch.Tensor,
                    w2_scale: torch.Tensor | None, fmt: str, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w1, w3, w2) as dense [E, I, d], [E, I, d], [E, d, I] `dtype`.

    The inputs are in the `routed_experts_quant` layouts.
    """
    inter = w13.shape[1] // 2
    # scale rows of w1: blocks (fp8) or rows (fp4)
    split = -(-inter // 128) if fmt == "fp8" else inter
    s1 = w13_scale[:, :split] if w13_scale is not None else None
    s3 = w13_scale[:, split:] if w13_scale is not None else None
    return (_dequant_stack(w13[:, :inter], s1, fmt, dtype),
            _dequant_stack(w13[:, inter:], s3, fmt, dtype),
            _dequant_stack(w2, w2_scale, fmt, dtype))
