"""Weight memory of a preset in each weight format, by component, and per GPU under expert
parallelism: what the model holds once loaded (issue 21: checkpoint precision <= 0.35x of bf16;
the full V4-Flash geometry on 1, 2, 4 or 8 H200s).

The model is built on the meta device by the loader's own code (`model/loader.py::empty_model`,
the classes `LLM(..., weight_format=...)` loads into), so the bytes are those of the real
parameters and buffers (FP4 codes and UE8M0 scales for `checkpoint` experts), not a formula.
No tensor is allocated: any geometry runs on a laptop.

Per GPU, from the layouts' own code on the meta device (what `load_shard` / `load_dp_shard` give
each rank): "dp_ep", DP attention + EP over N ranks (`enable_dp_attention`: the routed experts by
id, the shared expert's intermediate dim split, everything else whole on every rank); "tp_ep", TP
+ EP (`shard_model`: also the query heads, output groups and vocabulary split; FP8 linears cut on
their scale blocks). Rank 0's bytes (the ranks are equal). Not counted: the KV cache, the RoPE
cache, CUDA graphs, activations, the CUDA context.

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
from dsv4.distributed.dp import enable_dp_attention
from dsv4.distributed.tp import TPGroup, shard_model
from dsv4.model.loader import empty_model

FORMATS = ("bf16", "checkpoint")
LAYOUTS = ("dp_ep", "tp_ep")
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


def rank_bytes(preset: str, weight_format: str, layout: str, n: int) -> int:
    """Rank 0's weight bytes under `layout` ("dp_ep" or "tp_ep") over `n` ranks."""
    model = empty_model(get_preset(preset), torch.bfloat16, torch.device("meta"), weight_format)
    if n > 1:
        group = TPGroup(0, n)
        model = (enable_dp_attention(model, group, True) if layout == "dp_ep"
                 else shard_model(model, group, True))
    return sum(t.numel() * t.element_size()
               for name, t in [*model.named_parameters(), *model.named_buffers()]
               if not name.startswith("rope_"))


def record(preset: str, ranks: list[int]) -> dict[str, object]:
    by = {fmt: bytes_by_component(preset, fmt) for fmt in FORMATS}
    total = {fmt: sum(v.values()) for fmt, v in by.items()}
    per_gpu = {layout: {fmt: {str(n): rank_bytes(preset, fmt, layout, n) for n in ranks}
                        for fmt in FORMATS} for layout in LAYOUTS}
    return {"preset": preset, "bytes": by, "total": total,
            "ratio_checkpoint_vs_bf16": total["checkpoint"] / total["bf16"],
            "per_gpu": per_gpu}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", default="flash-4l,flash-43l-e16,flash")
    p.add_argument("--ranks", default="1,2,4,8", help="ranks for the per-GPU rows")
    p.add_argument("--out", default=None, help="JSON path")
    args = p.parse_args()
    ranks = [int(x) for x in args.ranks.split(",")]
    rows = [record(name, ranks) for name in args.presets.split(",")]
    print(f"{'preset':<15}{'format':<12}{'layout':<8}{'total GB':>10}"
          + "".join(f"{f'{n} GB/GPU':>12}" for n in ranks))
    for r in rows:
        for fmt in FORMATS:
            for layout in LAYOUTS:
                gpu = r["per_gpu"][layout][fmt]  # type: ignore[index]
                cells = "".join(f"{gpu[str(n)] / 1e9:>11.1f}"
                                f"{'*' if gpu[str(n)] > GPU_BYTES else ' '}" for n in ranks)
                total = r["total"][fmt] / 1e9  # type: ignore[index]
                print(f"{r['preset']:<15}{fmt:<12}{layout:<8}{total:>10.1f}{cells}")
        print(f"{'':<15}checkpoint / bf16 = {r['ratio_checkpoint_vs_bf16']:.3f}")
    print(f"(* over one H200's {GPU_BYTES / 1e9:.0f} GB before any KV cache)")
    line = json.dumps({"benchmark": "model_memory", "gpu_bytes": GPU_BYTES, "rows": rows})
    if args.out:
        Path(args.out).write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
