"""Profile training steps of `dsv4 train run` (torch.profiler): where does a step's time go?

    PYTHONPATH=src python3 benchmarks/profile_train_step.py --data .data/tiny --device cuda \
        --batch-size 16

Prints per-variant step times (full, without indexer distillation, QAT on) and the top ops by
device and host time of the full variant.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from dsv4.train.config import TrainConfig
from dsv4.train.trainer import Trainer


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_steps(trainer: Trainer, n: int, device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    for _ in range(n):
        trainer.train_step()
    _sync(device)
    return (time.perf_counter() - start) / n


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--rows", type=int, default=30)
    args = p.parse_args()
    base = TrainConfig(data_dir=args.data, out_dir=tempfile.mkdtemp(), steps=100,
                       batch_size=args.batch_size, seq_len=args.seq_len, warmup_steps=1,
                       qat_start=1.0, device=args.device)
    variants = {"full": base, "no_indexer_kl": base.replace(indexer_weight=0.0),
                "qat": base.replace(qat_start=0.0)}
    for name, cfg in variants.items():
        trainer = Trainer(cfg)
        if name == "no_indexer_kl":
            trainer.distiller.enabled = False
        time_steps(trainer, 2, args.device)
        ms = time_steps(trainer, 3, args.device) * 1e3
        print(f"{name:>14}: {ms:8.1f} ms/step  {cfg.tokens_per_step / ms * 1e3:10.0f} tok/s",
              flush=True)
        if name == "full":
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                             if args.device.startswith("cuda") else [])
            with profile(activities=acts) as prof:
                time_steps(trainer, 2, args.device)
            key = ("self_cuda_time_total" if args.device.startswith("cuda")
                   else "self_cpu_time_total")
            print(prof.key_averages().table(sort_by=key, row_limit=args.rows,
                                            max_name_column_width=60))
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15,
                                            max_name_column_width=60))
        del trainer


if __name__ == "__main__":
    main()
