"""Weight memory of a preset in each weight format, by component, and per GPU under expert
parallelism: what the model holds once loaded (issue 21: checkpoint precision <= 0.35x of bf16;
the full V4-Flash geometry on 1, 2, 4 or 8 H200s).

The model is built on the meta device by the loader's own code (`model/loader.py::empty_model`,
the classes `LLM(..., weight_format=...)` loads into), so the bytes are those of the real
parameters and buffers (FP4 codes and UE8M0 scales for `checkpoint` experts), not a formula.
No tensor is allocated: any geometry runs on a laptop.

Per GPU: the routed experts split by expert across N ranks (expert parallelism, as with DP
attention + EP: everything else replicated on every rank), so bytes per GPU = other + experts / N.
Not counted: the KV cache, the RoPE cache, CUDA graphs, activations, the CUDA context.

    PYTHONPATH=src python3 benchmarks/model_memory.py --presets flash-4l,flash --out F.json
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from dsv4.checkpoint.presets import get_preset
from dsv4.model.loader import empty_model

FORMATS = ("bf16", "checkpoint")
GPU_BYTES = 141e9          # an H200's memory (143,771 MiB on the device; what fits is below it)


def component(name: str) -> str:
    """The component a parameter or buffer belongs to, from its module path."""
    parts = name.split(".")
    if parts[0] == "layers":
        sub = parts[2]
        if sub == "ffn":
            return {"experts": "routed experts", "shared_experts": "shared expert"}.get(
                parts[3], "gate")
        return "attention" if sub == "attn" else "mHC / norms"
    return {"embed": "embedding", "head": "LM head", "mtp": "MTP block"}.get(parts[0], "other")


def bytes_by_component(preset: str, weight_format: str) -> dict[str, int]:
    model = empty_model(get_preset(preset), torch.bfloat16, torch.device("meta"), weight_format)
    out: dict[str, int] = defaultdict(int)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name.startswith("rope_"):        # position tables, not weights
            continue
        out[component(name)] += t.numel() * t.element_size()
    return dict(out)


def record(preset: str, ranks: list[int]) -> dict[str, object]:
    by = {fmt: bytes_by_component(preset, fmt) for fmt in FORMATS}
    total = {fmt: sum(v.values()) for fmt, v in by.items()}
    per_gpu = {fmt: {str(n): (total[fmt] - by[fmt].get("routed experts", 0)
                              + by[fmt].get("routed experts", 0) / n) for n in ranks}
               for fmt in FORMATS}
    return {"preset": preset, "bytes": by, "total": total,
            "ratio_checkpoint_vs_bf16": total["checkpoint"] / total["bf16"],
            "per_gpu_ep": per_gpu}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", default="flash-4l,flash-43l-e16,flash")
    p.add_argument("--ranks", default="1,2,4,8", help="expert-parallel ranks for the per-GPU rows")
    p.add_argument("--out", default=None, help="JSON path")
    args = p.parse_args()
    ranks = [int(x) for x in args.ranks.split(",")]
    rows = [record(name, ranks) for name in args.presets.split(",")]
    print(f"{'preset':<15}{'format':<12}{'total GB':>10}" + "".join(f"{f'EP{n} GB/GPU':>14}"
                                                                   for n in ranks))
    for r in rows:
        for fmt in FORMATS:
            gpu = r["per_gpu_ep"][fmt]  # type: ignore[index]
            cells = "".join(f"{gpu[str(n)] / 1e9:>13.1f}{'*' if gpu[str(n)] > GPU_BYTES else ' '}"
                            for n in ranks)
            print(f"{r['preset']:<15}{fmt:<12}{r['total'][fmt] / 1e9:>10.1f}{cells}")  # type: ignore[index]
        print(f"{'':<15}checkpoint / bf16 = {r['ratio_checkpoint_vs_bf16']:.3f}")
    print(f"(* over one H200's {GPU_BYTES / 1e9:.0f} GB before any KV cache)")
    line = json.dumps({"benchmark": "model_memory", "gpu_bytes": GPU_BYTES, "rows": rows})
    if args.out:
        Path(args.out).write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
