"""One rank of the tensor-parallel equivalence test (`test_tp.py` launches it).

    python tp_worker.py RANK WORLD STORE JOB [JOB ...]      JOB: CKPT,OUT[,ep][,checkpoint]

For each JOB in turn, in one process group: loads CKPT (fp32, CPU; `checkpoint`: FP4 experts and
FP8 linears kept in their encoding), shards it for RANK of WORLD (gloo, file store STORE; WORLD
1: no process group; `ep`: experts split by id), then runs the full-sequence forward in both
formulations and the engine (chunked prefill, a prefix-cache hit, a preemption) on fixed inputs;
rank 0 saves the logits, tokens and log-probs to OUT. After `destroy_process_group` no gloo
thread may be left: one that outlives the interpreter aborts the process at exit, at random
("terminate called without an active exception")."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from dsv4.config.engine import EngineConfig
from dsv4.distributed.group import join_default_group
from dsv4.distributed.tp import TPGroup, shard_model
from dsv4.engine.engine import LLMEngine
from dsv4.engine.sampling_params import SamplingParams
from dsv4.model.forward_mode import INFERENCE, TRAINING
from dsv4.model.loader import load_model
from dsv4.model.quant_linear import QuantLinear


def main() -> None:
    rank, world, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    if world > 1:
        join_default_group("gloo", f"file://{store}", rank, world)
    for job in sys.argv[4:]:
        ckpt, out, *flags = job.split(",")
        run_job(ckpt, out, rank, world, set(flags))
    if world > 1:
        dist.destroy_process_group()
        left = [t for t in thread_names() if "gloo" in t]
        assert not left, f"threads of the destroyed group still run: {left}"


def run_job(ckpt: str, out: str, rank: int, world: int, flags: set[str]) -> None:
    assert flags <= {"ep", "checkpoint"}, flags
    full = load_model(ckpt, dtype="float32", device="cpu", progress=False,
                      weight_format="checkpoint" if "checkpoint" in flags else "bf16")
    fp8 = sum(isinstance(m, QuantLinear) for m in full.modules())
    model = shard_model(full, TPGroup(rank, world), expert_parallel="ep" in flags)
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == fp8, "FP8 dequantised"
    assert "checkpoint" not in flags or fp8 > 0
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(2, model.config.vocab_size, (2, 40), generator=gen)
    with torch.no_grad():
        logits = {"inference": model(ids, INFERENCE)}
        if "checkpoint" not in flags:     # checkpoint-format experts run the sparse form only
            logits["training"] = model(ids, TRAINING)
    engine = LLMEngine(model, EngineConfig(page_size=16, max_total_tokens=160,
                                           chunked_prefill_size=24, max_running_requests=4))
    prompts = [torch.randint(2, model.config.vocab_size, (n,), generator=gen).tolist()
               for n in (37, 5, 50)]
    prompts.append(prompts[0][:33] + [7, 8])         # shares two whole pages: a cache hit
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    reqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    done = [engine.pop(r.rid) for r in reqs]
    result = {"logits": logits, "tokens": [d.output_ids for d in done],
              "logprobs": [d.logprobs for d in done], "cached": [d.cached_tokens for d in done],
              "preemptions": engine.scheduler.num_preemptions}
    if rank == 0:
        torch.save(result, out)


def thread_names() -> list[str]:
    """The names of this process's threads (Linux)."""
    tasks = "/proc/self/task"
    return [open(f"{tasks}/{t}/comm").read().strip() for t in os.listdir(tasks)]


if __name__ == "__main__":
    main()
