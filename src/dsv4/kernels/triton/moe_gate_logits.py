"""The MoE gate's logits in one launch: `triton_moe_gate_logits`, the fast form of
`kernels/ref/moe.py::moe_gate_logits` (same signature).

The reference, `F.linear(u.float(), weight.float())`, casts the [E, d] bf16 gate weight to fp32 on
every call (2 bytes read and 4 written per weight, then 4 read by the GEMM) and u too: three
launches per MoE layer. Here the bf16 (or fp16 / fp32) operands are read as they are and
multiplied in fp32 on the CUDA cores:

    logits[m, e] = sum over K blocks b, in order, of tl.sum_k(u[m, k] * w[e, k]) (fp32)

Grid (cdiv(E, BLOCK_E), cdiv(M, BLOCK_M)). A program owns BLOCK_E weight rows, one per warp, and
BLOCK_M token rows: for each K block it loads its [BLOCK_E, BLOCK_K] weight tile once (pipelined,
`tl.range(num_stages=)`), then for each token row sums the tile times that row within each warp
(BLOCK_K covers the 32 lanes' 16-byte vectors exactly, so no sum crosses warps) and adds the
block's partial to the row's accumulator. Rows past M / E are clamped to the last real row (never
stored); only a K tail is masked.

Batch invariance (what the RL "values" mode needs: the trainer's full-sequence call reproduces
the engine's one-token rows bit for bit): the tile config is a function of (K, the weight dtype)
alone (`gate_logits_config`), never of M; a row's logits are the same in-warp tree per K block and
the same sequential sum over the blocks wherever the row sits and however many rows the call has.
Precision: bf16 / fp16 products are exact in fp32, so the logits differ from the reference's only
by the fp32 sum order (~1e-7 relative); fp32 operands round each product (or fuse it: FMA).

No host sync, no workspace: CUDA-graph capturable. Test: tests/kernels/test_moe_gate_logits.py.
Benchmark: benchmarks/kernels/bench_moe_gate.py ("logits").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels.triton.launch import X_DTYPES

BLOCK_M = 8             # token rows per program (the padding rows of a smaller call are clamped)
NUM_WARPS = 2           # = BLOCK_E: one weight row per warp
NUM_STAGES = 4
_LANE_BYTES = 16 * 32   # a warp's 32 lanes, one 16-byte vector each


@triton.jit(do_not_specialize=["M"])
def _gate_logits_kernel(  # type: ignore[no-untyped-def]
    u_ptr, w_ptr, out_ptr, M, E, K, stride_u, stride_w,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr,
):
    offs_e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    rows_w = tl.minimum(offs_e, E - 1).to(tl.int64)
    w_ptrs = w_ptr + rows_w[:, None] * stride_w + offs_k[None, :]
    first = tl.program_id(1).to(tl.int64) * BLOCK_M
    acc = tl.zeros([BLOCK_E, BLOCK_M], tl.float32)              # logits^T tile
    cols_m = tl.arange(0, BLOCK_M)[None, :]
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        k_ok = k0 + offs_k < K                                   # used only if not EVEN_K
        if EVEN_K:
            wf = tl.load(w_ptrs + k0).to(tl.float32)
        else:
            wf = tl.load(w_ptrs + k0, mask=k_ok[None, :], other=0.0).to(tl.float32)
        for m in tl.static_range(BLOCK_M):       # one token row at a time: in-warp sums
            row = tl.minimum(first + m, M - 1)
            if EVEN_K:
                um = tl.load(u_ptr + row * stride_u + k0 + offs_k)
            else:
                um = tl.load(u_ptr + row * stride_u + k0 + offs_k, mask=k_ok, other=0.0)
            part = tl.sum(wf * um.to(tl.float32)[None, :], axis=1)
            acc += tl.where(cols_m == m, part[:, None], 0.0)
    out = tl.trans(acc)                                          # [BLOCK_M, BLOCK_E]
    mask = (offs_m < M)[:, None] & (offs_e < E)[None, :]
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * E + offs_e[None, :], out, mask=mask)


def gate_logits_config(K: int, w_dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_E, BLOCK_K) from the weight's K and dtype only (module docstring: the row count
    never enters, which is what makes the op batch-invariant)."""
    block_k = min(_LANE_BYTES // w_dtype.itemsize, max(16, triton.next_power_of_2(K)))
    return NUM_WARPS, block_k


def _check(u: torch.Tensor, weight: torch.Tensor) -> None:
    if u.dim() != 2 or weight.dim() != 2 or u.shape[1] != weight.shape[1]:
        raise ValueError(f"expected u [N, d] and weight [E, d]; got {tuple(u.shape)}, "
                         f"{tuple(weight.shape)}")
    for name, t in (("u", u), ("weight", weight)):
        if t.dtype not in X_DTYPES:
            raise ValueError(f"{name} dtype {t.dtype} is not supported; allowed: "
                             f"{[str(d) for d in X_DTYPES]}")
    if u.device != weight.device:
        raise ValueError(f"u and weight must be on one device; got {u.device}, {weight.device}")


def triton_moe_gate_logits(u: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Same contract as `moe_gate_logits`: u [N, d], weight [E, d] (bf16 / fp16 / fp32; any row
    stride) -> logits [N, E] fp32, contiguous, in one launch; a row's bits do not depend on N."""
    _check(u, weight)
    (M, K), E = u.shape, weight.shape[0]
    out = torch.empty(M, E, dtype=torch.float32, device=u.device)
    if M == 0 or E == 0:
        return out
    if K == 0:
        return out.zero_()
    if K > 1 and u.stride(1) != 1:
        u = u.contiguous()
    if K > 1 and weight.stride(1) != 1:
        weight = weight.contiguous()
    block_e, block_k = gate_logits_config(K, weight.dtype)
    _gate_logits_kernel[(triton.cdiv(E, block_e), triton.cdiv(M, BLOCK_M))](
        u, weight, out, M, E, K, u.stride(0), weight.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_E=block_e, BLOCK_K=block_k, NUM_STAGES=NUM_STAGES,
        EVEN_K=K % block_k == 0, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out
