"""Benchmark: the MoE gate's selection and weights in one launch (`triton_moe_gate_select`), the
shared expert's SwiGLU in one launch (`triton_swiglu`) and the gate's logits
(`triton_moe_gate_logits`: at N <= 4 the decode GEMV, one launch; above, the reference) vs their
torch forms (`ref/moe.py::moe_gate_select`: softplus, sqrt, bias add, top-k, gather, sum,
division, scaling; `ref/moe.py::swiglu`: two clamps, silu, product; `ref/moe.py::moe_gate_logits`:
the two fp32 casts and an fp32 GEMM).

Shapes: V4-Flash routing (E = 256, k = 6, top-k on scores + bias, from the gate GEMM's fp32
logits) and shared expert (gate / up [N, 2048] bf16) at N = 1, 8, 32, 128, 512 tokens. Bytes the
op must move (the floor): gate: logits and bias read, ids and weights written (N E 4 + E 4 +
N k 12); SwiGLU: gate and up read, h written (N I 2 x 3); logits: u and the bf16 gate weight read
(d 4096), the fp32 logits written (N d 2 + E d 2 + N E 4; LOGIT_SETS weight copies cycled, 128 MB,
so the weight comes from HBM). Each form timed as CUDA-graph replays;
parity first: equal expert ids (asserted), the weights' / SwiGLU's bit-equality and max |diff|
recorded (SwiGLU bit-equal on the GPU; the gate's weights within ~1 ulp past a few rows, where
torch's k-sum changes order; the interpreter's smoke run differs by a few ulp). Prints a table,
then ONE JSON line (also written to --out).

    PYTHONPATH=src python3 benchmarks/kernels/bench_moe_gate.py --out FILE.json   # CUDA
    PYTHONPATH=src python3 benchmarks/kernels/bench_moe_gate.py --cpu-smoke       # interpreter
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import torch
from bench_common import (
    HBM_BYTES_PER_S,
    base_parser,
    bench_rows,
    emit,
    print_table,
    record_header,
    select_device,
    time_us,
)

SETS = 8             # input sets cycled inside one graph
LOGIT_SETS = 64      # gate weight copies (2 MB each) cycled: more than the H200's L2
E, K, INTER, SCALE, LIMIT, D = 256, 6, 2048, 2.5, 10.0, 4096


def gate_inputs(N: int, E: int, device: torch.device,
                seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device).manual_seed(seed)
    return (torch.randn(N, E, generator=g, device=device) * 3,
            torch.randn(E, generator=g, device=device) * 0.2)


def swiglu_inputs(N: int, inter: int, device: torch.device,
                  seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device).manual_seed(seed)
    return ((torch.randn(N, inter, generator=g, device=device) * 6).bfloat16(),
            (torch.randn(N, inter, generator=g, device=device) * 6).bfloat16())


def logits_inputs(N: int, E: int, d: int, device: torch.device,
                  seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device).manual_seed(seed)
    return (torch.randn(N, d, generator=g, device=device).bfloat16(),
            (torch.randn(E, d, generator=g, device=device) * d ** -0.5).bfloat16())


def bench_case(c: tuple[str, int], args: argparse.Namespace,
               device: torch.device) -> dict[str, Any]:
    from dsv4.kernels.ref.moe import moe_gate_logits, moe_gate_select, swiglu
    from dsv4.kernels.triton.moe_gate import triton_moe_gate_select
    from dsv4.kernels.triton.moe_gate_logits import triton_moe_gate_logits
    from dsv4.kernels.triton.swiglu import triton_swiglu

    op, N = c
    cuda = device.type == "cuda"
    n_sets = SETS if cuda else 1
    e, k, inter, d = (E, K, INTER, D) if cuda else (16, 2, 64, 128)
    if op == "gate":
        sets: list[tuple[Any, ...]] = [(*gate_inputs(N, e, device, args.seed + i), None, None,
                                        k, SCALE) for i in range(n_sets)]
        fast: Any = triton_moe_gate_select
        ref: Any = moe_gate_select
        nbytes = N * e * 4 + e * 4 + N * k * 12
    elif op == "logits":
        sets = [logits_inputs(N, e, d, device, args.seed + i)
                for i in range(LOGIT_SETS if cuda else 1)]
        held = torch.zeros(e, dtype=torch.int32, device=device)     # split-K counters
        fast, ref = functools.partial(triton_moe_gate_logits, counters=held), moe_gate_logits
        nbytes = N * d * 2 + e * d * 2 + N * e * 4
    else:
        sets = [(*swiglu_inputs(N, inter, device, args.seed + i), LIMIT) for i in range(n_sets)]
        fast, ref = triton_swiglu, swiglu
        nbytes = N * inter * 2 * 3
    want, got = ref(*sets[0]), fast(*sets[0])
    if op == "gate":
        assert torch.equal(want[0], got[0]), f"parity failed: expert ids at N={N}"
        want, got = want[1], got[1]
    diff = float((want.float() - got.float()).abs().max()) if N else 0.0
    us, ref_us = time_us(fast, sets, args, cuda), time_us(ref, sets, args, cuda)
    return {"case": f"{op} N={N}", "op": op, "N": N, "us": us, "ref_us": ref_us,
            "speedup_vs_ref": ref_us / us, "bytes": nbytes,
            "floor_us": nbytes / HBM_BYTES_PER_S * 1e6, "bit_equal": bool(torch.equal(want, got)),
            "max_abs_diff": diff}


TABLE = [("case", "{:<14}", "case"), ("bytes", "{:>10.3e}", "bytes"),
         ("floor_us", "{:>8.2f}", "floor us"), ("us", "{:>8.2f}", "us"),
         ("ref_us", "{:>8.2f}", "ref us"), ("speedup_vs_ref", "{:>6.1f}", "x ref"),
         ("bit_equal", "{!s:>9}", "bit-equal")]


def main() -> None:
    args = base_parser(__doc__.splitlines()[0], "(no sweep)").parse_args()
    device = select_device(args.cpu_smoke)      # before the first `import triton` (done lazily)
    sizes = [3] if args.cpu_smoke else [1, 8, 32, 128, 512]
    logit_sizes = [3] if args.cpu_smoke else [1, 4, 32]          # decode GEMV up to 4 rows
    cases = ([(op, n) for op in ("gate", "swiglu") for n in sizes]
             + [("logits", n) for n in logit_sizes])
    rows = bench_rows(cases, lambda c: bench_case(c, args, device), device)
    print_table(rows, TABLE)
    emit({**record_header("moe_gate", device), "results": rows}, args.out)


if __name__ == "__main__":
    main()
