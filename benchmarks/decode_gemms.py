"""The decode step's projections one by one, and fused where they read the same input.

Every weight GEMM of a flash-4l layer at decode (M = 1 and 32 tokens), timed as CUDA-graph
replays cycling several weight copies (no L2 reuse), against its bytes' floor at the measured
copy rate; and the fusions a serving engine could make by concatenating weights that read the
same activation (SGLang's fused q_a + kv_a projection): q_a + kv (x, bf16), the four CSA
compressor projections (x, fp32), q_b + the indexer's q_b (q_lat, bf16), the shared expert's
w1 + w3 (u, bf16). A fusion pays when its time is below the sum of its parts'. Prints a table,
then one JSON line (also written to --out).

    PYTHONPATH=src python3 benchmarks/decode_gemms.py --out FILE.json          # CUDA
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent / "kernels"))
from bench_common import HBM_BYTES_PER_S, time_graph_us  # noqa: E402

# (name, [(out, in), ...] concatenated along out, weight dtype, activation)
GEMMS: list[tuple[str, list[tuple[int, int]], torch.dtype]] = [
    ("wq_a", [(1024, 4096)], torch.bfloat16),
    ("wkv", [(512, 4096)], torch.bfloat16),
    ("wq_a+wkv", [(1024, 4096), (512, 4096)], torch.bfloat16),
    ("wq_b", [(32768, 1024)], torch.bfloat16),
    ("idx.wq_b", [(8192, 1024)], torch.bfloat16),
    ("wq_b+idx.wq_b", [(32768, 1024), (8192, 1024)], torch.bfloat16),
    ("wo_b", [(4096, 8192)], torch.bfloat16),
    ("idx.weights_proj", [(64, 4096)], torch.bfloat16),
    ("shared.w1", [(2048, 4096)], torch.bfloat16),
    ("shared.w1+w3", [(2048, 4096), (2048, 4096)], torch.bfloat16),
    ("shared.w2", [(4096, 2048)], torch.bfloat16),
    ("comp.wkv (CSA, fp32)", [(1024, 4096)], torch.float32),
    ("idx.comp.wkv (fp32)", [(256, 4096)], torch.float32),
    ("CSA comps x4 (fp32)", [(1024, 4096)] * 2 + [(256, 4096)] * 2, torch.float32),
    ("HCA comp.wkv (fp32)", [(512, 4096)], torch.float32),
    ("HCA comps x2 (fp32)", [(512, 4096)] * 2, torch.float32),
    ("gate (fp32)", [(256, 4096)], torch.float32),
]


def bench(name: str, parts: list[tuple[int, int]], dtype: torch.dtype, m: int,
          copies: int, args: argparse.Namespace) -> dict[str, Any]:
    out, k = sum(o for o, _ in parts), parts[0][1]
    ws = [torch.randn(out, k, device="cuda").to(dtype) for _ in range(copies)]
    xs = [torch.randn(m, k, device="cuda").to(dtype) for _ in range(copies)]
    us = time_graph_us(F.linear, list(zip(xs, ws, strict=True)), args.iters, args.warmup)
    nbytes = out * k * ws[0].element_size() + m * (k + out) * ws[0].element_size()
    floor = nbytes / HBM_BYTES_PER_S * 1e6
    return {"gemm": name, "m": m, "out": out, "in": k, "dtype": str(dtype).split(".")[-1],
            "us": round(us, 2), "floor_us": round(floor, 2), "x_floor": round(us / floor, 2),
            "gb_s": round(nbytes / us / 1e3, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", default="1,32", help="tokens per GEMM")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_gemms.py times cuBLAS on a CUDA GPU")
    rows = []
    for m in (int(v) for v in args.m.split(",")):
        for name, parts, dtype in GEMMS:
            copies = max(2, int(512e6 // (sum(o for o, _ in parts) * parts[0][1] * 4)))
            rows.append(bench(name, parts, dtype, m, min(copies, 16), args))
            torch.cuda.empty_cache()
    print(f"{'gemm':<22} {'m':>3} {'out x in':>12} {'dtype':>8} {'us':>8} {'floor':>7} "
          f"{'x':>5} {'GB/s':>7}")
    for r in rows:
        print(f"{r['gemm']:<22} {r['m']:>3} {str(r['out']) + 'x' + str(r['in']):>12} "
              f"{r['dtype']:>8} {r['us']:>8.2f} {r['floor_us']:>7.2f} {r['x_floor']:>5.2f} "
              f"{r['gb_s']:>7.1f}")
    line = {"benchmark": "decode_gemms", "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "rows": rows}
    print(json.dumps(line))
    if args.out is not None:
        args.out.write_text(json.dumps(line, indent=2) + "\n")


if __name__ == "__main__":
    main()
