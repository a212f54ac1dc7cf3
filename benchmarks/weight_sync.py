"""Weight sync time and bandwidth (issue 24): the trainer's weights into a rollout engine.

Two placements of the same model (`--model in-memory:<preset>`, random weights, `--dtype`):

- "disaggregated": two processes, the trainer (rank 0) on the first device and an engine (rank 1)
  on the second, joined by the RL sync group (`rl/bucket_sync.py`: NCCL on CUDA, gloo on the
  CPU). Per sync the trainer broadcasts its state dict in `--bucket-mb` buckets and the engine
  applies each (`LLMEngine.update_weights`: validated, in place); timed on rank 0 from the first
  broadcast to the engine's acknowledgement (a last 1-element broadcast from rank 1);
- "colocated": one process, the engine's `update_weights` with every tensor of its model, held
  on its own device (what the colocated trainer does after each step), in chunks of at most
  `--chunk-gb` (a second full copy of a large model does not fit beside the engine). A chunk holds
  at least one whole tensor (flash-4l's largest: a 4.3 GB routed-expert stack); the update's
  finite check works in slices, so a chunk costs only its own bytes beside the 68 GB engine. On
  an H200, `--chunk-gb 4.5`: 0.181 s per sync (benchmarks/results/rl_h200_202612.md); an 80 GB
  H100 ran out of memory before the check was sliced, and has not run it since.

`--syncs` timed syncs after one untimed; rows: seconds per sync, GB moved, GB/s. Prints a table,
then exactly one JSON line (also to `--out`).

    python benchmarks/weight_sync.py --model in-memory:flash-4l --placements disaggregated,colocated
    python benchmarks/weight_sync.py --model in-memory:micro --device cpu --dtype float32 --syncs 2
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsv4 import LLM
from dsv4.checkpoint.source import resolve_model_source
from dsv4.checkpoint.writer import random_model
from dsv4.config.model import ModelConfig
from dsv4.model.loader import resolve_dtype
from dsv4.rl.bucket_sync import (
    free_port,
    join_group,
    leave_group,
    plan_buckets,
    receive_weights,
    send_weights,
)

Row = dict[str, Any]
TIMEOUT_S = 600.0


def devices(args: argparse.Namespace) -> tuple[torch.device, torch.device]:
    """(trainer, engine) devices: two GPUs, or the CPU twice."""
    if args.device == "cpu":
        return torch.device("cpu"), torch.device("cpu")
    return torch.device("cuda:0"), torch.device("cuda:1")


def engine_on(args: argparse.Namespace, device: torch.device) -> LLM:
    return LLM(args.model, dtype=args.dtype, device=str(device), page_size=args.page_size,
               max_total_tokens=args.page_size * 4, max_running_requests=1, seed=1)


def trainer_state(args: argparse.Namespace, device: torch.device) -> dict[str, torch.Tensor]:
    """The trainer's weights to push: another random model of the geometry (seed 2)."""
    path, _ = resolve_model_source(args.model, "auto")
    model = random_model(ModelConfig.from_hf(path), resolve_dtype(args.dtype), device, seed=2)
    return dict(model.state_dict())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rank(rank: int, args: argparse.Namespace, address: str, out: Path) -> None:
    """One process of the disaggregated placement; rank 0 writes its timings to `out`."""
    if args.device == "cpu":
        torch.set_num_threads(1)
    device = devices(args)[rank]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    join_group(address, rank, 2, device, TIMEOUT_S)
    try:
        if rank == 0:
            state = trainer_state(args, device)
            plan = plan_buckets(state, int(args.bucket_mb * 2**20))
            dist.broadcast_object_list([plan], src=0)
        else:
            llm = engine_on(args, device)
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0)
            plan = box[0]
        ack = torch.zeros(1, device=device)
        seconds, sent = [], 0
        for _ in range(args.syncs + 1):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                sent = send_weights(plan, state)
            else:
                receive_weights(plan, device, llm.engine.update_weights)
                _sync(device)
            dist.broadcast(ack, src=1)                    # the engine has applied every bucket
            _sync(device)
            seconds.append(time.perf_counter() - start)
        if rank == 0:
            out.write_text(json.dumps({"seconds": seconds[1:], "bytes": sent,
                                       "buckets": len(plan), "tensors": len(state)}))
        # both ranks done with every collective before either tears the group down: else rank
        # 1 (the ack's source) may close its gloo pairs while rank 0 still reads from them, and
        # rank 0 aborts ("terminate called without an active exception")
        dist.barrier()
    finally:
        leave_group()


def disaggregated(args: argparse.Namespace, tmp: Path) -> Row:
    out = tmp / "disaggregated.json"
    address = f"tcp://127.0.0.1:{free_port()}"
    mp.start_processes(_rank, args=(args, address, out), nprocs=2, start_method="spawn")
    got = json.loads(out.read_text())
    return _row("disaggregated", got["seconds"], got["bytes"],
                buckets=got["buckets"], tensors=got["tensors"])


def colocated(args: argparse.Namespace) -> Row:
    """In-process syncs: the engine's own weights, cloned on its device in chunks of at most
    `--chunk-gb` (a trainer's copy of a large model does not fit beside the engine's), each chunk
    applied by `update_weights`; only the update calls are timed (each then a device sync)."""
    device = devices(args)[0]                  # one GPU: the trainer's and the engine's
    llm = engine_on(args, device)
    state = llm.engine.runner.model.state_dict()
    chunks: list[list[str]] = [[]]
    size = 0
    for name, t in state.items():
        n = t.numel() * t.element_size()
        if chunks[-1] and size + n > args.chunk_gb * 1e9:
            chunks.append([])
            size = 0
        chunks[-1].append(name)
        size += n
    seconds = []
    for _ in range(args.syncs + 1):
        total = 0.0
        for names in chunks:
            part = {n: state[n].clone() for n in names}
            _sync(device)
            start = time.perf_counter()
            llm.engine.update_weights(part)
            _sync(device)
            total += time.perf_counter() - start
            del part
        seconds.append(total)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    return _row("colocated", seconds[1:], nbytes, tensors=len(state), chunks=len(chunks))


def _row(placement: str, seconds: list[float], nbytes: int, **extra: int) -> Row:
    mean = sum(seconds) / len(seconds)
    return {"placement": placement, "sync_s": [round(s, 4) for s in seconds],
            "mean_s": round(mean, 4), "gb": round(nbytes / 1e9, 3),
            "gb_s": round(nbytes / 1e9 / mean, 2), **extra}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="in-memory:flash-4l")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--placements", default="disaggregated,colocated")
    p.add_argument("--bucket-mb", type=float, default=512.0)
    p.add_argument("--syncs", type=int, default=3)
    p.add_argument("--chunk-gb", type=float, default=8.0)
    p.add_argument("--page-size", type=int, default=256)
    p.add_argument("--tmp", default="/tmp", help="where rank 0 leaves its timings")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    placements = args.placements.split(",")
    unknown = set(placements) - {"disaggregated", "colocated"}
    if unknown:
        raise ValueError(f"placements {sorted(unknown)} are invalid; allowed: disaggregated, "
                         "colocated")
    if args.device == "cuda" and "disaggregated" in placements and torch.cuda.device_count() < 2:
        raise ValueError("the disaggregated placement needs 2 GPUs; allowed: --device cpu, or "
                         "--placements colocated")
    rows = []
    for placement in placements:
        rows.append(disaggregated(args, Path(args.tmp)) if placement == "disaggregated"
                    else colocated(args))
    print("placement | mean s | GB | GB/s | syncs")
    for r in rows:
        print(f"{r['placement']} | {r['mean_s']} | {r['gb']} | {r['gb_s']} | {r['sync_s']}")
    result = {"bench": "weight_sync", "model": args.model, "dtype": args.dtype,
              "device": args.device, "bucket_mb": args.bucket_mb, "rows": rows}
    line = json.dumps(result)
    if args.out:
        Path(args.out).write_text(line + "\n")
    print(line)
    return result


if __name__ == "__main__":
    main()
