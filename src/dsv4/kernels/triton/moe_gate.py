"""The MoE gate's selection and weights in one launch: `triton_moe_gate_select`, the fast form of
`kernels/ref/moe.py::moe_gate_select` (same signature).

After the gate GEMM (logits = u W_gate^T in fp32, a torch GEMM) the reference is a dozen small
torch launches per MoE layer: softplus, sqrt, the bias add, top-k, a gather, the sum, the division
and the scaling. Here one program per token row does all of it:

    scores s = sqrt(softplus(logits))              (torch's CUDA math: `libm.py`, `sqrt_rn`)
    ids      = replayed (-1 -> slot j takes expert j) | hashed | top-k of s + bias
    weights  = s[ids] / (s[ids][0] + ... + s[ids][k-1] + 1e-20) * route_scale

Top-k is k rounds of (max, lowest column holding it, knock it out): the ids come in descending
key order as torch.topk's do; among equal keys the lower expert id comes first (torch leaves the
order of ties unspecified, so a tie may order differently than the reference); NaN keys count as
the largest (as torch.topk's). The k weights are summed in one fixed order, that of torch's CUDA
reduction of a few rows of k <= 32 values (lane j of the largest power of two w <= k adds slots j
and j + w, then the lanes pairwise: for k = 6, ((s0 + s4) + (s1 + s5)) + (s2 + s3)). On a GPU the
scores, ids and the division are bit-equal to the reference's; torch's own summation order changes
with the row count, so the weights are bit-equal to the reference's at a few rows and within
~1 ulp at more (tests/kernels/test_moe_gate.py: the measured bound, and the exact check against
the reference formula in this order). Under the interpreter softplus and sqrt differ from torch's
CPU ones by a few ulp; the ids are equal.

Hashed / replayed ids must lie in [0, E) (-1 allowed in `replayed`); not checked (a host sync).
E up to `MAX_EXPERTS` in one block. No host sync: CUDA-graph capturable; a row's result does not
depend on the row count. Benchmark: benchmarks/kernels/bench_moe_gate.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels.triton.libm import libdevice_math, softplus_f32
from dsv4.kernels.triton.pdl import pdl_args
from dsv4.kernels.triton.pdl_enter import pdl_enter

MAX_EXPERTS = 4096
_TOPK, _HASH, _REPLAY = 0, 1, 2


@triton.jit(do_not_specialize=["stride_l", "stride_s"])
def _gate_select_kernel(logits_ptr, bias_ptr, sel_ptr, ids_ptr,  # type: ignore[no-untyped-def]
                        w_ptr, E, stride_l, stride_s, route_scale,
                        K: tl.constexpr, MODE: tl.constexpr, BLOCK_E: tl.constexpr,
                        WIDTH: tl.constexpr, LOG_WIDTH: tl.constexpr, LIBDEVICE: tl.constexpr,
                        PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    slot = tl.arange(0, 2 * WIDTH)
    live_k = slot < K
    if MODE == 0:
        cols = tl.arange(0, BLOCK_E)
        live = cols < E
        x = tl.load(logits_ptr + row * stride_l + cols, mask=live, other=0.0)
        bias = tl.load(bias_ptr + cols, mask=live, other=0.0).to(tl.float32)
        key = tl.sqrt_rn(softplus_f32(x, LIBDEVICE)) + bias
        key = tl.where(key != key, float("inf"), key)                   # NaN: the largest
        key = tl.where(live, key, float("-inf"))
        ids = tl.zeros([2 * WIDTH], dtype=tl.int64)
        for j in tl.static_range(K):
            best = tl.max(key, axis=0)
            pick = tl.min(tl.where(key == best, cols, BLOCK_E), axis=0)
            ids = tl.where(slot == j, pick.to(tl.int64), ids)
            key = tl.where(cols == pick, float("-inf"), key)
    else:
        ids = tl.load(sel_ptr + row * stride_s + slot, mask=live_k, other=0).to(tl.int64)
        if MODE == 2:
            ids = tl.where(ids >= 0, ids, slot.to(tl.int64))
    x_sel = tl.load(logits_ptr + row * stride_l + ids, mask=live_k, other=0.0)
    w = tl.where(live_k, tl.sqrt_rn(softplus_f32(x_sel, LIBDEVICE)), 0.0)
    # torch's CUDA row sum of k values: lane j (of WIDTH = the largest power of two <= k) adds
    # slots j and j + WIDTH, then the lanes combine pairwise, (0+1)+(2+3) ...; every reduce below
    # adds exactly two values, so its order is fixed
    part = tl.sum(tl.reshape(w, [2, WIDTH]), axis=0)
    for i in tl.static_range(LOG_WIDTH):
        part = tl.sum(tl.reshape(part, [WIDTH >> (i + 1), 2]), axis=1)
    total = tl.sum(part, axis=0)
    w = tl.math.div_rn(w, total + 1e-20) * route_scale
    tl.store(ids_ptr + row * K + slot, ids, mask=live_k)
    tl.store(w_ptr + row * K + slot, w, mask=live_k)


_LIBDEVICE = libdevice_math(_gate_select_kernel)


def _rows(name: str, t: torch.Tensor, N: int, k: int, device: torch.device) -> torch.Tensor:
    if (t.shape != (N, k) or t.dtype not in (torch.int64, torch.int32)
            or t.device != device):
        raise ValueError(f"{name} must be [N, k] = [{N}, {k}] int64 / int32 on {device}; got "
                         f"{tuple(t.shape)} {t.dtype} {t.device}")
    return t if t.stride(1) == 1 or k == 1 else t.contiguous()


def triton_moe_gate_select(logits: torch.Tensor, bias: torch.Tensor | None,
                           hashed: torch.Tensor | None, replayed: torch.Tensor | None, k: int,
                           route_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `moe_gate_select`: logits [N, E] fp32, bias [E] (float) or None, hashed /
    replayed [N, k] int64 / int32 or None (replayed wins over hashed, hashed over the top-k, which
    needs the bias) -> (ids [N, k] int64, weights [N, k] fp32), contiguous."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be [N, E] float32; got {tuple(logits.shape)} "
                         f"{logits.dtype}")
    N, E = logits.shape
    if not 1 <= k <= min(E, 32) or E > MAX_EXPERTS:
        raise ValueError(f"need 1 <= k <= E <= {MAX_EXPERTS} and k <= 32; got k={k}, E={E}")
    device = logits.device
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    sel = replayed if replayed is not None else hashed
    mode = _REPLAY if replayed is not None else _HASH if hashed is not None else _TOPK
    if sel is not None:
        sel = _rows("replayed" if mode == _REPLAY else "hashed", sel, N, k, device)
    elif bias is None or bias.shape != (E,) or bias.device != device:
        raise ValueError(f"top-k selection needs a bias [E] = [{E}] on {device}; got "
                         f"{None if bias is None else (tuple(bias.shape), bias.device)}")
    ids = torch.empty(N, k, dtype=torch.int64, device=device)
    weights = torch.empty(N, k, dtype=torch.float32, device=device)
    if N == 0:
        return ids, weights
    block_e = triton.next_power_of_2(E)
    log_width = k.bit_length() - 1                    # WIDTH <= k < 2 WIDTH
    bias_arg = bias.contiguous() if bias is not None and mode == _TOPK else logits
    sel_arg = sel if sel is not None else ids
    _gate_select_kernel[(N,)](
        logits, bias_arg, sel_arg, ids, weights, E, logits.stride(0), sel_arg.stride(0),
        float(route_scale), K=k, MODE=mode, BLOCK_E=block_e, WIDTH=1 << log_width,
        LOG_WIDTH=log_width, LIBDEVICE=_LIBDEVICE,
        num_warps=max(1, min(8, block_e // 256)), **pdl_args(logits.device))
    return ids, weights
