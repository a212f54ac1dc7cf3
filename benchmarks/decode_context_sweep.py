"""Decode vs context sweep (issue 7): ms per decode step against the HBM floor and transformers.

Random weights for a preset generated in memory on the device (default `flash-4l`, bf16). For each
(batch, context): the engine prefills `batch` random prompts of `context` tokens (ignore_eos), then
N decode steps of the whole batch are timed (CUDA events around the engine step loop). Rows: batch
1 at every `--contexts` (default 4K, 16K, 64K, 128K), and every `--batches` at every
`--batch-contexts` (default 4K and 32K, kept where <= the largest `--contexts`; if none is, the
`--contexts` themselves).

HBM floor per step = bytes that must move / the device-to-device copy bandwidth measured in this
run (2 x buffer bytes per copy: read + write). Bytes = active weights (attention, hyper-connections,
norms, gate, shared expert, the routed experts actually hit: distinct experts per MoE layer over
the batch, captured from the routing (`capture_routing`) after the timed steps, or else the
expectation E * (1 - (1 - k/E)^batch); one embedding row per request; the LM head) + per request
the KV / state read: the SWA window (W x head_dim) on every layer; on C4 layers the top-k selected
entries (k x head_dim) and every visible indexer key (context/4 x index_head_dim: the indexer scans
all); on C128 layers every visible entry (context/128 x head_dim); all at the model's element size.

Peer (`--hf`): transformers `DeepseekV4ForCausalLM` (eager) built from the same weights on the same
device, batch 1 at every `--contexts`, its own KV cache (`use_cache=True`), greedy manual loop; an
out-of-memory is recorded as such. Targets: >= 5x faster than transformers at 4K; prefill of 128K
tokens without OOM (results: benchmarks/results/kernels_ii_h200_202611.md).

Timing protocol: the warm-up and timed steps follow the prefill at once (`--settle-s` sleeps that
many seconds in between: on the H200 a 128K step timed right after its 2 s prefill measured up to
110 us slower than 3 s later, the GPU idle between steps). `--step-times` records each timed
step's time on the device timeline and on the host, and the host's time blocked waiting for the
device (the rest is the host's own work), per row. `--prefill-step-times` times each prefill step
to a device sync ([seconds, prefill tokens, decode tokens] per step in `prefill_steps`: where a
slow prefill spends its time), `--stack-dump-s S` prints every thread's Python stack to stderr
every S seconds while a prefill runs (what a stalled prefill waits in), and `--compile-times`
logs every Triton build of a point with its seconds (`compile_times.py`: a cold step's time is
mostly compiles, and one slow specialisation shows with its constexprs).

Any failing configuration (out of memory, error) is a row with its status; the sweep goes on.
Prints a table, writes the plot (`--plot`), then exactly one JSON line (also to `--out`).

    python benchmarks/decode_context_sweep.py --device cuda --hf --plot decode.png --out decode.json
    python benchmarks/decode_context_sweep.py --preset micro --device cpu --dtype float32 \
        --contexts 64,128 --batches 1,2 --steps 4 --copy-gib 0.05 --hf
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import functools
import gc
import json
import math
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from dsv4 import EngineConfig, SamplingParams
from dsv4.checkpoint.presets import first_layers, get_preset
from dsv4.checkpoint.writer import random_model
from dsv4.config.engine_defaults import (
    resolve_index_cache_dtype,
    resolve_kernel_backend,
    resolve_multi_stream,
    resolve_overlap,
    resolve_pdl_early_max_batch,
    resolve_shared_expert_beside_max_tokens,
)
from dsv4.config.model import ModelConfig
from dsv4.engine.engine import LLMEngine
from dsv4.engine.request import Request
from dsv4.engine.warmup import warm_up
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.model.loader import resolve_device, resolve_dtype

sys.path.insert(0, str(Path(__file__).parent / "kernels"))
sys.path.insert(0, str(Path(__file__).parent))
from bench_common import measure_copy_rate  # noqa: E402
from compile_times import CompileLog  # noqa: E402

Row = dict[str, Any]


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="flash-4l")
    p.add_argument("--num-layers", type=int, default=None,
                   help="the preset's first N layers only (default: all; a per-layer cost of a "
                        "geometry too large for the device is the slope between two N)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kernel-backend", default=None, choices=["ref", "triton"],
                   help="default: triton on a GPU")
    p.add_argument("--contexts", type=ints, default=[4096, 16384, 65536, 131072],
                   help="batch-1 contexts")
    p.add_argument("--batches", type=ints, default=[8, 32, 128], help="throughput batch sizes")
    p.add_argument("--batch-contexts", type=ints, default=[4096, 32768],
                   help="contexts of the throughput rows")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps")
    p.add_argument("--warmup-steps", type=int, default=4)
    p.add_argument("--routing-steps", type=int, default=4,
                   help="decode steps with routing capture (0: expect)")
    p.add_argument("--page-size", type=int, default=256)
    p.add_argument("--chunked-prefill-size", type=int, default=8192)
    p.add_argument("--copy-gib", type=float, default=None,
                   help="bandwidth probe buffer (default: 4 GPU, 0.25 CPU)")
    p.add_argument("--hf", action="store_true", help="also time transformers eager at batch 1")
    p.add_argument("--disable-cuda-graph", action="store_true",
                   help="decode eagerly (default: CUDA graphs where "
                   "the engine can capture them: CUDA device, triton backend)")
    p.add_argument("--overlap-schedule", action=argparse.BooleanOptionalAction, default=None,
                   help="the engine's overlap scheduling (the host prepares step N + 1 while "
                   "the device runs step N; default: the engine's, on with CUDA)")
    p.add_argument("--multi-stream", action=argparse.BooleanOptionalAction, default=None,
                   help="the engine's multi-stream branches (default: on with CUDA)")
    p.add_argument("--fuse-projections", action=argparse.BooleanOptionalAction, default=True,
                   help="the engine's fused projection groups (default: on, as the engine's)")
    p.add_argument("--decode-gemv", action=argparse.BooleanOptionalAction, default=True,
                   help="the engine's one-launch decode GEMVs (default: on, as the engine's)")
    p.add_argument("--pdl-early-max-batch", type=int,
                   default=EngineConfig.pdl_early_max_batch,
                   help="decode graphs of batch buckets up to this size in PDL's EARLY mode "
                   "(default: the engine's)")
    p.add_argument("--shared-expert-beside-max-tokens", type=int, default=None,
                   help="with multi-stream, forwards of up to this many tokens run the shared "
                   "expert beside the routed experts (default: the engine's, by the format)")
    p.add_argument("--index-cache-dtype", default=None, choices=["model", "fp8"],
                   help="the indexer-key pools (EngineConfig.index_cache_dtype; default: the "
                        "engine's, fp8 on CUDA with the triton backend, else model)")
    p.add_argument("--weight-format", default="bf16", choices=["bf16", "checkpoint"],
                   help="checkpoint: FP4 routed experts and FP8 linears, as the official "
                   "release stores them (the floor counts their bytes)")
    p.add_argument("--engine-warmup", default="none", choices=["none", "fast", "full"],
                   help="run the engine's warmup (`engine/warmup.py`, what `LLM` and `dsv4 serve` "
                   "run before ready) on each new engine before its point: kernel compiles and "
                   "graph captures leave the prefill time (default none: the first point of a "
                   "shape pays them); its seconds go into the row (engine_warmup_s)")
    p.add_argument("--settle-s", type=float, default=0.0,
                   help="seconds to sleep between the prefill and the decode steps (default 0)")
    p.add_argument("--step-times", action="store_true",
                   help="record every timed step's device ms, host ms and host ms blocked on the "
                        "device in the row")
    p.add_argument("--prefill-step-times", action="store_true",
                   help="sync and time every prefill step: [seconds, prefill tokens, decode "
                        "tokens] per step in the row's prefill_steps (the prefill is slower "
                        "for the syncs)")
    p.add_argument("--stack-dump-s", type=float, default=0.0,
                   help="while a prefill runs, print every thread's Python stack to stderr every "
                        "this many seconds (faulthandler; default 0: off)")
    p.add_argument("--compile-times", action="store_true",
                   help="log every Triton specialisation built during a point (engine warmup, "
                        "then the run) with its seconds: per phase in the row's compiles, the "
                        "slowest with their constexprs in slowest_compiles")
    p.add_argument("--phases", type=int, default=1,
                   help="after the timed steps, time N - 1 more runs of --steps steps, each "
                        "after a device sync and --phase-pause-s: each run's ms / step in "
                        "phase_ms (the 900K slow state changes only between such runs)")
    p.add_argument("--phase-pause-s", type=float, default=0.0,
                   help="seconds to sleep before each extra phase (default 0: a sync only)")
    p.add_argument("--one-engine", action="store_true",
                   help="run every point (and the warm-up) in one engine sized for the largest, "
                        "as a server runs all its requests; default: a fresh engine per point")
    p.add_argument("--order", choices=("asc", "desc"), default="asc",
                   help="order of the points (desc with --one-engine: the 4K step timed after "
                        "the 900K prefill, in the same engine and process state)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="PNG path")
    p.add_argument("--out", default=None, help="JSON path")
    return p.parse_args(argv)


def sweep_points(args: argparse.Namespace) -> list[tuple[int, int]]:
    batch_ctx = [c for c in args.batch_contexts if c <= max(args.contexts)] or list(args.contexts)
    points = [(1, c) for c in args.contexts] + [(b, c) for b in args.batches for c in batch_ctx]
    return sorted(set(points), reverse=args.order == "desc")


# ---- timing --------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], None], device: torch.device) -> float:
    """Seconds of `fn` (CUDA events on a GPU, wall clock otherwise)."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sync(device)
    begin.record()
    fn()
    end.record()
    sync(device)
    return float(begin.elapsed_time(end)) / 1e3


@contextlib.contextmanager
def time_in(cls: type, name: str) -> Iterator[list[float]]:
    """While open, every call of method `cls.name` adds its wall time (s) to the yielded one-cell
    list (the caller reads and resets it); the method is restored on exit."""
    spent = [0.0]
    original = getattr(cls, name)

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    setattr(cls, name, timed)
    try:
        yield spent
    finally:
        setattr(cls, name, original)


def step_times(step: Callable[[], object], n: int, device: torch.device
               ) -> tuple[list[float], list[float], list[float]]:
    """(device ms, host ms, host wait ms) of each of `n` calls of `step`: on a GPU the device
    timeline between events recorded after each call (idle time between steps included), read
    after the loop (no sync inside it); on the host the wall time of each call, and of it the time
    spent blocked in `torch.cuda.Event.synchronize` (the engine's one wait: a step's sampled
    tokens). host - wait is the host's own work: when it reaches the device time, the host, not
    the GPU, sets the pace. Without CUDA the device times are the wall times, the waits 0."""
    host: list[float] = []
    if device.type != "cuda":
        for _ in range(n):
            start = time.perf_counter()
            step()
            host.append(round((time.perf_counter() - start) * 1e3, 4))
        return list(host), host, [0.0] * n
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    wait: list[float] = []
    sync(device)
    with time_in(torch.cuda.Event, "synchronize") as spent:
        marks[0].record()
        for i in range(n):
            spent[0] = 0.0
            start = time.perf_counter()
            step()
            marks[i + 1].record()
            host.append(round((time.perf_counter() - start) * 1e3, 4))
            wait.append(round(spent[0] * 1e3, 4))
    sync(device)
    spans = zip(marks[:-1], marks[1:], strict=True)
    return [round(float(a.elapsed_time(b)), 4) for a, b in spans], host, wait


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def failure(exc: BaseException) -> str:
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
        return "oom"
    return f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


# ---- HBM floor -----------------------------------------------------------------------------------
# Checkpoint-precision weights are buffers (`QuantExperts`: w13 / w2 codes and scales,
# `QuantLinear`: weight and scale); their split-K counters and the hash table are not weights.
CODED_BUFFERS = (".w13", ".w13_scale", ".w2", ".w2_scale", ".weight", ".scale")


def weight_bytes(model: DeepSeekV4ForCausalLM, batch: int, experts_hit: list[float]) -> float:
    """Active weight bytes of one decode step (no MTP): dense weights, routed experts hit, head."""
    cfg = model.config
    dense, per_expert = 0.0, [0.0] * cfg.num_layers
    coded = [(n, b) for n, b in model.named_buffers() if n.endswith(CODED_BUFFERS)]
    for name, p in list(model.named_parameters()) + coded:
        nbytes = p.numel() * p.element_size()
        if name.startswith("layers."):
            layer = int(name.split(".")[1])
            if ".ffn.experts." in name:
                per_expert[layer] += nbytes / cfg.n_routed_experts
            else:
                dense += nbytes
        elif name.startswith(("head.", "norm.", "hc_head.")):
            dense += nbytes
    embed = model.embed.weight
    rows = batch * embed.shape[1] * embed.element_size()
    return dense + rows + sum(b * e for b, e in zip(per_expert, experts_hit, strict=True))


def kv_bytes(cfg: ModelConfig, context: int, elt: int) -> float:
    """KV / state bytes one request reads per decode step at `context` visible tokens."""
    total = 0
    for kind in cfg.attn_types:
        total += min(context, cfg.window) * cfg.head_dim
        if kind == "csa":
            entries = context // cfg.csa_ratio
            total += min(entries, cfg.index_topk) * cfg.head_dim + entries * cfg.index_head_dim
        elif kind == "hca":
            total += context // cfg.hca_ratio * cfg.head_dim
    return float(total * elt)


def expected_experts(cfg: ModelConfig, batch: int) -> list[float]:
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    return [min(float(e), e * (1 - (1 - k / e) ** batch))] * cfg.num_layers


def captured_experts(reqs: list[Request], steps: int, num_layers: int) -> list[float]:
    """Mean distinct experts per MoE layer over the last `steps` decode steps of the batch."""
    # [steps, layers, k] each
    per_req = [torch.cat(r.routing["experts"])[-steps:] for r in reqs]
    hits = torch.zeros(num_layers)
    for s in range(steps):
        for layer in range(num_layers):
            hits[layer] += torch.cat([t[s, layer] for t in per_req]).unique().numel()
    return (hits / steps).tolist()


def add_floor(row: Row, model: DeepSeekV4ForCausalLM, gbps: float) -> Row:
    """The row's HBM floor (from captured routing, else the expectation) and measured / floor."""
    batch, context = row["batch"], row["context"]
    w = weight_bytes(model, batch, row.get("experts_hit") or expected_experts(model.config, batch))
    kv = batch * kv_bytes(model.config, context, model.embed.weight.element_size())
    floor_ms = (w + kv) / (gbps * 1e9) * 1e3
    row.update(weight_gb=round(w / 1e9, 4), kv_gb=round(kv / 1e9, 6), floor_ms=round(floor_ms, 4))
    if row["status"] == "ok":
        row["ratio"] = round(row["ms_per_step"] / floor_ms, 2)
    return row


# ---- dsv4 engine ---------------------------------------------------------------------------------
def prompts_for(batch: int, context: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed + 1000 * batch + context)
    return [torch.randint(2, vocab, (context,), generator=g).tolist() for _ in range(batch)]


def point_max_tokens(args: argparse.Namespace, batch: int, context: int) -> int:
    """Output tokens a point's requests may make: prefill chunks (early decodes), warm-up, timed
    and routing-capture steps, with a margin; none finishes inside the timed loop."""
    prefill_steps = math.ceil(batch * context / args.chunked_prefill_size) + batch + 2
    return (prefill_steps + args.warmup_steps + args.steps * max(1, args.phases)
            + args.routing_steps + 2)


def make_engine(model: DeepSeekV4ForCausalLM, args: argparse.Namespace,
                points: list[tuple[int, int]]) -> LLMEngine:
    """An engine whose pools and context length hold every (batch, context) point: one point for
    a fresh engine per point, all of them under `--one-engine`."""
    longest = max(c + point_max_tokens(args, b, c) + 1 for b, c in points)
    total = max(b * (c + point_max_tokens(args, b, c) + 1 + args.page_size) for b, c in points)
    config = EngineConfig(page_size=args.page_size, max_running_requests=max(b for b, _ in points),
                          chunked_prefill_size=args.chunked_prefill_size,
                          kernel_backend=args.kernel_backend,
                          max_total_tokens=total,
                          context_length=longest + 1, disable_prefix_cache=True,
                          disable_cuda_graph=args.disable_cuda_graph, seed=args.seed,
                          overlap_schedule=args.overlap_schedule,
                          multi_stream=args.multi_stream,
                          fuse_projections=args.fuse_projections,
                          decode_gemv=args.decode_gemv,
                          pdl_early_max_batch=args.pdl_early_max_batch,
                          shared_expert_beside_max_tokens=args.shared_expert_beside_max_tokens,
                          index_cache_dtype=args.index_cache_dtype)
    return LLMEngine(model, config)


def engine_warmup(engine: LLMEngine, args: argparse.Namespace) -> float | None:
    """`--engine-warmup` on a new engine: its seconds, or None when not asked for."""
    if args.engine_warmup == "none":
        return None
    return round(warm_up(engine, args.engine_warmup, progress=False), 3)


@contextlib.contextmanager
def point_compiles(args: argparse.Namespace, row: Row, phase: str) -> Iterator[CompileLog | None]:
    """`--compile-times`: the Triton builds of the scope, from `phase` on (`engine_steps` moves
    the log's phase), into the row's compiles / slowest_compiles and every build after the
    warmup with its constexprs (builds_after_warmup: what a served request would wait for), also
    when the point fails; without the flag nothing (None)."""
    if not args.compile_times:
        yield None
        return
    log = CompileLog(phase)
    try:
        with log:
            yield log
    finally:
        row["compiles"], row["slowest_compiles"] = log.summary(), log.slowest()
        row["builds_after_warmup"] = log.builds(skip=("warmup",))


def run_shared(engine: LLMEngine, args: argparse.Namespace, batch: int, context: int,
               row: Row) -> None:
    """One point in the shared engine; its requests are aborted after (their pages freed) and
    a step still in flight resolved, so the next point starts on an idle engine."""
    try:
        with point_compiles(args, row, "run") as log:
            engine_steps(engine, args, batch, context, point_max_tokens(args, batch, context),
                         row, log)
    finally:
        for r in list(engine.requests.values()):
            if not r.is_finished:
                engine.abort(r.rid)
        while engine.has_unfinished():
            engine.step()


def run_engine(model: DeepSeekV4ForCausalLM, args: argparse.Namespace, batch: int, context: int,
               row: Row) -> None:
    """Prefill the batch, time `args.steps` decode steps, capture routing; fills `row`."""
    engine = make_engine(model, args, [(batch, context)])
    try:
        with point_compiles(args, row, "warmup") as log:
            seconds = engine_warmup(engine, args)
            if seconds is not None:
                row["engine_warmup_s"] = seconds
            engine_steps(engine, args, batch, context, point_max_tokens(args, batch, context),
                         row, log)
    finally:
        for r in list(engine.requests.values()):
            engine.abort(r.rid)
        del engine
        free_memory(model.embed.weight.device)


def engine_steps(engine: LLMEngine, args: argparse.Namespace, batch: int, context: int,
                 max_tokens: int, row: Row, log: CompileLog | None = None) -> None:
    """Prefill the point's requests, time the decode steps, capture routing; `log` (with
    `--compile-times`) files the builds under the phase they ran in: prefill, decode (the warm-up
    and timed steps) and routing (the capture steps)."""

    def phase(name: str) -> None:
        if log is not None:
            log.phase = name

    device, cfg = engine.runner.device, engine.runner.model.config
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(p, params)
            for p in prompts_for(batch, context, cfg.vocab_size, args.seed)]

    def prefill() -> None:
        while not all(r.output_ids for r in reqs):
            if not args.prefill_step_times:
                engine.step()
                continue
            tokens = (engine.prefill_tokens, engine.decode_tokens)
            start = time.perf_counter()
            engine.step()
            sync(device)
            row.setdefault("prefill_steps", []).append(
                [round(time.perf_counter() - start, 4), engine.prefill_tokens - tokens[0],
                 engine.decode_tokens - tokens[1]])

    def decode(n: int) -> Callable[[], None]:
        def loop() -> None:
            for _ in range(n):
                engine.step()
        return loop

    if args.stack_dump_s > 0:
        faulthandler.dump_traceback_later(args.stack_dump_s, repeat=True, file=sys.stderr)
    phase("prefill")
    try:
        row["prefill_s"] = round(timed(prefill, device), 4)
    finally:
        faulthandler.cancel_dump_traceback_later()
    row["prefill_end_unix"] = round(time.time(), 3)   # aligns the row with a clock / power log
    row["prefill_fit"] = True
    if args.settle_s > 0:
        time.sleep(args.settle_s)
    phase("decode")
    timed(decode(args.warmup_steps), device)
    graphs = engine.runner.graphs
    replays = graphs.replays if graphs is not None else 0
    if args.step_times:
        device_ms, host_ms, wait_ms = step_times(engine.step, args.steps, device)
        row["step_ms_device"], row["step_ms_host"] = device_ms, host_ms
        row["step_ms_host_wait"] = wait_ms
        seconds = sum(device_ms) / 1e3
    else:
        seconds = timed(decode(args.steps), device)
    row["cuda_graph"] = graphs is not None and graphs.replays - replays == args.steps
    assert not any(r.is_finished for r in reqs), "a request finished inside the timed loop"
    row["ms_per_step"] = round(seconds / args.steps * 1e3, 4)
    row["tok_s"] = round(batch * args.steps / seconds, 2)
    if args.phases > 1:
        ms, starts = extra_phases(engine, args, device)
        row["phase_ms"], row["phase_start_unix"] = [row["ms_per_step"]] + ms, starts
    phase("routing")
    row["experts_hit"], row["routing"] = capture(engine, reqs, args.routing_steps, cfg, batch)


def extra_phases(engine: LLMEngine, args: argparse.Namespace, device: torch.device
                 ) -> tuple[list[float], list[float]]:
    """(ms / step, start unix time) of `args.phases - 1` more runs of `args.steps` steps, each
    after a device sync and `args.phase_pause_s` of sleep (device timeline, as `step_times`)."""
    out, starts = [], []
    for _ in range(args.phases - 1):
        sync(device)
        if args.phase_pause_s > 0:
            time.sleep(args.phase_pause_s)
        starts.append(round(time.time(), 3))
        device_ms, _, _ = step_times(engine.step, args.steps, device)
        out.append(round(sum(device_ms) / len(device_ms), 4))
    return out, starts


def capture(engine: LLMEngine, reqs: list[Request], steps: int, cfg: ModelConfig,
            batch: int) -> tuple[list[float], str]:
    """Turn routing capture on for `steps` more decode steps (after timing: it syncs to host),
    then off again: with `--one-engine` the next point's steps must not capture."""
    if steps <= 0:
        return [round(x, 2) for x in expected_experts(cfg, batch)], "expected"
    runner = engine.runner
    before = runner.config
    runner.config = dataclasses.replace(before, capture_routing=True)
    try:
        # with overlap scheduling a call resolves the step the call before launched: one more
        for _ in range(steps + int(engine.overlap)):
            engine.step()
    finally:
        runner.config = before
    hits = captured_experts(reqs, steps, cfg.num_layers)
    return [round(x, 2) for x in hits], "captured"


# ---- transformers --------------------------------------------------------------------------------
def load_group(official_name: str) -> str:
    """Per layer, with the routed w2 apart from w1 + w3: bounds the copies `to_hf_state_dict`
    stacks at once."""
    if not official_name.startswith("layers."):
        return "top"
    layer = official_name.split(".")[1]
    return (f"{layer}.w2" if ".experts." in official_name and official_name.endswith(".w2.weight")
            else layer)


def hf_dtype(hf: torch.nn.Module, key: str, dtype: torch.dtype) -> torch.dtype:
    """What `from_pretrained(dtype=...)` gives a tensor: fp32 for `_keep_in_fp32_modules_strict`
    (substring match, as transformers' dtype plan) under fp16 / bf16, else the model dtype (ours
    keeps more in fp32)."""
    keep = getattr(hf, "_keep_in_fp32_modules_strict", None) or ()
    low = dtype in (torch.float16, torch.bfloat16)
    return torch.float32 if low and any(name in key for name in keep) else dtype


def build_hf(model: DeepSeekV4ForCausalLM) -> torch.nn.Module:
    """transformers' model sharing our weights: built on the meta device, then loaded layer by
    layer with `assign=True` (dense tensors are views of ours; only stacked experts are new)."""
    import transformers

    from dsv4.model.state_dict_adapter import to_hf_state_dict
    from dsv4.model.weights import official_state_dict

    device, weight_dtype = model.embed.weight.device, model.embed.weight.dtype
    hf_cfg = transformers.DeepseekV4Config(**model.config.to_hf_dict())
    hf_cfg._attn_implementation = "eager"
    with torch.device("meta"):
        hf = transformers.DeepseekV4ForCausalLM(hf_cfg)
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in official_state_dict(model).items():
        groups.setdefault(load_group(name), {})[name] = t
    expected = set(hf.state_dict())
    for group in groups.values():
        part = {k: v.to(hf_dtype(hf, k, weight_dtype)) if v.is_floating_point() else v
                for k, v in to_hf_state_dict(group).items()}
        assert set(part) <= expected, \
            f"unexpected transformers names {sorted(set(part) - expected)[:5]}"
        hf.load_state_dict(part, strict=False, assign=True)
        expected -= set(part)
    assert not expected, f"transformers weights not loaded: {sorted(expected)[:5]}"
    # non-persistent buffers (RoPE inv_freq): rebuild on device
    for name, module in list(hf.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            parent, _, attr = name.rpartition(".")
            setattr(hf.get_submodule(parent), attr, type(module)(module.config, device=device))
    meta = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    assert not meta, f"transformers tensors left on the meta device: {meta[:5]}"
    return hf.eval()


@torch.no_grad()
def run_hf(hf: torch.nn.Module, args: argparse.Namespace, context: int, vocab: int,
           row: Row) -> None:
    device = next(hf.parameters()).device
    ids = torch.tensor(prompts_for(1, context, vocab, args.seed), device=device)
    state: dict[str, Any] = {}

    def prefill() -> None:
        out = hf(input_ids=ids, use_cache=True, logits_to_keep=1)
        state["cache"], state["tok"] = out.past_key_values, out.logits[:, -1:].argmax(-1)

    def decode(n: int) -> Callable[[], None]:
        def loop() -> None:
            for _ in range(n):
                out = hf(input_ids=state["tok"], past_key_values=state["cache"], use_cache=True)
                state["cache"], state["tok"] = out.past_key_values, out.logits[:, -1:].argmax(-1)
        return loop

    try:
        row["prefill_s"] = round(timed(prefill, device), 4)
        row["prefill_fit"] = True
        timed(decode(args.warmup_steps), device)
        seconds = timed(decode(args.steps), device)
        row["ms_per_step"] = round(seconds / args.steps * 1e3, 4)
        row["tok_s"] = round(args.steps / seconds, 2)
    finally:
        state.clear()
        free_memory(device)


# ---- sweep ---------------------------------------------------------------------------------------
def measure(system: str, batch: int, context: int, fn: Callable[[Row], None]) -> Row:
    """One configuration; `fn` fills the row as it goes: a failure keeps what it measured."""
    row: Row = {"system": system, "batch": batch, "context": context, "status": "ok",
                "prefill_fit": False}
    try:
        fn(row)
    except Exception as exc:  # noqa: BLE001 — one failing configuration must not end the sweep
        row["status"] = failure(exc)
    gc.collect()  # the traceback held the failed step's tensors
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    print(f"  {system} batch {batch} context {context}: {row['status']} "
          f"{row.get('ms_per_step', '')}", flush=True)
    return row


def hf_rows(model: DeepSeekV4ForCausalLM, args: argparse.Namespace) -> tuple[list[Row], str | None]:
    try:
        import transformers
    except ImportError:
        print("note: transformers is not installed; skipping the transformers peer (--hf)",
              flush=True)
        return [], None
    device = model.embed.weight.device
    try:
        hf = build_hf(model)
    except Exception as exc:  # noqa: BLE001 — e.g. no memory left for the stacked experts
        status = f"build {failure(exc)}"
        print(f"note: could not build the transformers model ({status}); skipping it", flush=True)
    else:
        vocab, warm = model.config.vocab_size, argparse.Namespace(**{**vars(args), "steps": 2,
                                                                     "warmup_steps": 1})
        measure("warm-up", 1, 128, functools.partial(run_hf, hf, warm, 128, vocab))
        rows = [measure("transformers", 1, c, functools.partial(run_hf, hf, args, c, vocab))
                for c in args.contexts]
        del hf
        free_memory(device)
        return rows, transformers.__version__
    free_memory(device)
    return [{"system": "transformers", "batch": 1, "context": c, "status": status,
             "prefill_fit": False} for c in args.contexts], transformers.__version__


def speedups(rows: list[Row]) -> dict[str, float | None]:
    ours = {r["context"]: r for r in rows
            if r["system"] == "dsv4" and r["batch"] == 1 and r["status"] == "ok"}
    out: dict[str, float | None] = {}
    for r in rows:
        if r["system"] == "transformers" and r["context"] in ours:
            ok = r["status"] == "ok"
            out[str(r["context"])] = (round(r["ms_per_step"] / ours[r["context"]]["ms_per_step"], 2)
                                      if ok else None)
    return out


def print_table(rows: list[Row]) -> None:
    print(f"{'system':<13}{'batch':>6}{'context':>9}{'status':>8}{'prefill s':>11}{'ms/step':>10}"
          f"{'tok/s':>11}{'floor ms':>10}{'ratio':>8}{'experts hit':>13}")
    for r in rows:
        experts = r.get("experts_hit")
        hit = f"{sum(experts) / len(experts):.1f}" if experts else "-"
        print(f"{r['system']:<13}{r['batch']:>6}{r['context']:>9}{r['status'][:7]:>8}"
              f"{r.get('prefill_s', '-'):>11}{r.get('ms_per_step', '-'):>10}"
              f"{r.get('tok_s', '-'):>11}{r.get('floor_ms', '-'):>10}"
              f"{r.get('ratio', '-'):>8}{hit:>13}")


def plot(rows: list[Row], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system, style in (("dsv4", "o-"), ("transformers", "s-")):
        pts = [(r["context"], r["ms_per_step"]) for r in rows
               if r["system"] == system and r["batch"] == 1 and r["status"] == "ok"]
        if pts:
            ax.plot(*zip(*pts, strict=True), style, label=f"{system} batch 1")
    floor = [(r["context"], r["floor_ms"]) for r in rows
             if r["system"] == "dsv4" and r["batch"] == 1 and "floor_ms" in r]
    if floor:
        ax.plot(*zip(*floor, strict=True), "k--", label="HBM floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("ms per decode token")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device, dtype = resolve_device(args.device), resolve_dtype(args.dtype)
    args.kernel_backend = args.kernel_backend or ("triton" if device.type == "cuda" else "ref")
    config = get_preset(args.preset)
    if args.num_layers is not None:
        config = first_layers(config, args.num_layers)
    model = random_model(config, dtype, device, args.seed, args.weight_format)
    gib = args.copy_gib or (4.0 if device.type == "cuda" else 0.25)
    gbps = measure_copy_rate(device, gib) / 1e9
    print(f"{args.preset} on {device}: device copy {gbps:.1f} GB/s", flush=True)
    warm = argparse.Namespace(**{**vars(args), "steps": 2, "warmup_steps": 1, "routing_steps": 0})
    points = sweep_points(args)
    shared_warmup_s = None
    if args.one_engine:
        shared = make_engine(model, args, points)
        shared_warmup_s = engine_warmup(shared, args)
        run: Callable[..., None] = functools.partial(run_shared, shared)
        del shared
    else:
        run = functools.partial(run_engine, model)
    measure("warm-up", 1, min(args.contexts), functools.partial(run, warm, 1, min(args.contexts)))
    rows = [measure("dsv4", b, c, functools.partial(run, args, b, c)) for b, c in points]
    del run  # the shared engine's pools
    free_memory(device)
    peer, hf_version = hf_rows(model, args) if args.hf else ([], None)
    rows = [add_floor(row, model, gbps) for row in rows + peer]
    print_table(rows)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if args.plot:
        plot(rows, args.plot, f"{args.preset} {args.dtype} decode on {name}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    result = {"benchmark": "decode_context_sweep", "preset": args.preset,
              "num_layers": config.num_layers, "device": name,
              "dtype": args.dtype, "weight_format": args.weight_format,
              "kernel_backend": args.kernel_backend, "steps": args.steps,
              "page_size": args.page_size, "chunked_prefill_size": args.chunked_prefill_size,
              "settle_s": args.settle_s, "one_engine": args.one_engine,
              "engine_warmup": args.engine_warmup, "shared_engine_warmup_s": shared_warmup_s,
              "order": args.order, "copy_gb_s": round(gbps, 1),
              "cuda_graph": not args.disable_cuda_graph,
              "overlap_schedule": resolve_overlap(args.overlap_schedule,
                                                  torch.device(args.device).type, 0),
              "fuse_projections": args.fuse_projections, "decode_gemv": args.decode_gemv,
              "pdl_early_max_batch": resolve_pdl_early_max_batch(
                  args.pdl_early_max_batch, args.weight_format == "checkpoint"),
              "multi_stream": resolve_multi_stream(args.multi_stream,
                                                   torch.device(args.device).type),
              "shared_expert_beside_max_tokens": resolve_shared_expert_beside_max_tokens(
                  args.shared_expert_beside_max_tokens, args.weight_format == "checkpoint"),
              "index_cache_dtype": resolve_index_cache_dtype(
                  args.index_cache_dtype, torch.device(args.device).type,
                  resolve_kernel_backend(args.kernel_backend, torch.device(args.device).type)),
              "torch": torch.__version__, "transformers": hf_version, "commit": commit,
              "speedup_vs_transformers": speedups(rows), "rows": rows}
    line = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    print(line)
    return result


if __name__ == "__main__":
    main()
