"""The MoE gate's logits on the serving path: `triton_moe_gate_logits`, the fast form of
`kernels/ref/moe.py::moe_gate_logits` (same signature, plus the call site's split-K `counters`).

The reference, `F.linear(u.float(), weight.float())`, casts the [E, d] 16-bit gate weight to fp32
on every call (2 bytes read and 4 written per weight, then 4 read by the GEMM) and u too: three
launches, ~25 us per MoE layer at batch-1 decode on the H200 against a 2 MB (0.5 us) byte floor.
Here a decode call (at most `gemv.FMA_MAX_M` token rows, 16-bit u and weight of one dtype, the
call site's counters) is one launch of the decode GEMV (`gemv.py::triton_linear`, FMA path): the
operands are read as they are, multiplied in fp32 on the CUDA cores, and the fp32 sums stored as
the logits, with the cross-split reduction inside the launch:

    grid = cdiv(E, DECODE_BLOCK_N) expert tiles x (d / GATE_K_PER_SPLIT) K splits
           (V4-Flash, E 256, d 4096: 16 x 8 = 128 programs, about one per SM)

A call of more rows with bf16 operands and the counters (prefill) is the compressors' prefill
product, `project.py::prefill_project`: on CUDA the tensor cores on the operands as they are with
fp32 out (the reference's products, exact in fp32, summed by cuBLAS in fp32) instead of an fp32
SGEMM on the casts (0.41 ms per V4-Flash layer at 8K tokens on an H100, no tensor cores:
benchmarks/results/quant_moe_h200_202612.md); off CUDA the reference's own `F.linear`. Every
other call (fp32 / fp16 operands, no counters) runs the reference (cuBLAS on the casts).
The counters are the gate's own buffer (`model/decode_gemv.py` gives it one: the gate runs on the
main stream while the shared expert runs on the side one, so no other call shares it).

Precision: 16-bit products are exact in fp32, so the logits differ from the reference's only by
the fp32 sum order (~1e-7 relative). Not batch-invariant (the split and the path depend on the
row count): the engine's invariant modes take the counters away, so they run the reference.

No host sync, no memset (the counters are left zero): CUDA-graph capturable.
Test: tests/kernels/test_moe_gate_logits.py. Benchmark: benchmarks/kernels/bench_moe_gate.py
("logits").
"""

from __future__ import annotations

import torch
import triton

from dsv4.kernels.ops import DECODE_BLOCK_N
from dsv4.kernels.ref.moe import moe_gate_logits
from dsv4.kernels.triton.gemv import FMA_MAX_M, triton_linear
from dsv4.kernels.triton.project import prefill_project

GATE_K_PER_SPLIT = 512          # K elements per split (16 KB of bf16 weight per program at E 16)
_HALF = (torch.bfloat16, torch.float16)


def gate_plan(E: int, K: int) -> tuple[int, int]:
    """(expert rows per program, K splits) of a decode call: from E and K only."""
    return DECODE_BLOCK_N, max(1, K // GATE_K_PER_SPLIT)


def triton_moe_gate_logits(u: torch.Tensor, weight: torch.Tensor, *,
                           counters: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `moe_gate_logits`: u [N, d], weight [E, d] -> logits [N, E] fp32.
    `counters`: the call site's zeroed int32 buffer of >= cdiv(E, DECODE_BLOCK_N) words, left
    zero (module docstring); without it the reference runs, past the decode shape the prefill
    GEMM (bf16 on CUDA) or the reference."""
    E = weight.shape[0]
    if (counters is not None and u.dim() == 2 and u.shape[0] > FMA_MAX_M
            and u.dtype == weight.dtype == torch.bfloat16):
        return prefill_project(u, weight)
    if (counters is None or u.dim() != 2 or not 0 < u.shape[0] <= FMA_MAX_M
            or u.dtype != weight.dtype or u.dtype not in _HALF
            or triton.cdiv(E, DECODE_BLOCK_N) > counters.numel()):
        return moe_gate_logits(u, weight)
    block_n, splits = gate_plan(E, u.shape[1])
    return triton_linear(u, weight, block_n=block_n, split_k=splits, dot=False,
                         counters=counters, out_dtype=torch.float32)
