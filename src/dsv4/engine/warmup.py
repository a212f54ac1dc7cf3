"""Warmup planning: the step shapes `warm_up` runs before an engine serves.

The first step of a new shape pays for Triton's compiles (each kernel specialisation, seconds
when the on-disk cache is cold) and, for a decode step served by CUDA graphs, the capture of its
graph (`engine/cuda_graph.py`: one graph per batch bucket, tokens per request and context bucket).
Warmup runs those steps with dummy requests through the normal engine path, so no request pays.

What a mode covers (`warmup_plan`):
- "none": nothing;
- "fast": two prefill steps, one of `chunked_prefill_size` tokens (the largest step, the common
  one under load) and a short one (`SHORT_PREFILL_TOKENS`: the small-M kernel specialisations);
  where the context is shorter than a chunk, one request cannot fill that step, so several
  requests of the longest prompt prefill together, the first step a full chunk (the kernel
  plans chosen from a step's token count compile there; the FP4 experts' decoded chunks, for
  one);
  with the `triton` kernels a long prefill (`LONG_PREFILL_DEPTH` tokens in whole chunks, then a
  short last chunk: the long-context prefill paths, the top-k's compact forms at a full chunk
  and at a short one, compile there, not in a user's first long prompt); then decode steps at
  batch 1, at the smallest batch bucket >= `FAST_MIN_BATCH` and at the largest bucket, at the
  smallest context bucket (the sampler and the kernels every bucket shares), then, with CUDA
  graphs, the batch-1 graph of every larger context bucket a request can reach (the long-context
  decode paths: the top-k's cooperative form, split-KV attention, compile there): a lone long
  request never compiles or captures. Other batch buckets above the smallest context bucket are
  captured on first use;
- "full": the prefill steps, with the `triton` kernels one more prefill step of every power of
  two in `MID_PREFILL_TOKENS` below the chunk (the plans keyed on a step's token count change
  class at powers of two: the MoE tile map's width, the mHC tiles, the top-k's in-register row
  width, the linears' tiles; each step costs seconds of compiles with a cold cache, and batched
  prefills still meet other classes, so "fast" leaves them out), then a decode step at every
  batch bucket and, with CUDA graphs, the graph of every batch bucket at every reachable context
  bucket: no step of a later request captures a graph. Without CUDA graphs there is nothing per
  bucket to capture: "full" is "fast" plus the mid-size prefills and one batch-1 step per
  context bucket whose whole range fits the context length, the KV cache and
  `FULL_MAX_CONTEXT`.
With speculative decoding every decode step is a verify step of 1 + N tokens per request, and
each graph comes with its drafting graph.

A graph shape ("graph") is captured directly on padding rows (`DecodeGraphs.prepare`): no request
needs to reach its context. An eager decode step at a larger context bucket needs a request whose
context reaches into it: an "anchor" request of `WarmupShape.anchor` prompt tokens (prefilled
once, shared by the shapes of its bucket) decodes together with 1-token requests.
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass
from typing import Literal

from tqdm import tqdm

from dsv4.config.engine import EngineConfig, check_warmup
from dsv4.engine.cuda_graph import batch_buckets, context_bucket
from dsv4.engine.engine import LLMEngine
from dsv4.engine.request import Request
from dsv4.engine.sampling_params import SamplingParams
from dsv4.engine.scheduler import ScheduledStep
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)

SHORT_PREFILL_TOKENS = 16
"""The short prefill step of every plan (capped by `chunked_prefill_size`)."""
LONG_PREFILL_DEPTH = 32768
"""Tokens before the short last chunk of the long warmup prefill (capped by the context length
and the KV cache, rounded down to whole chunks): past the top-k's in-register rows (4096 C4
entries: 16384 tokens), where its compact forms take over."""
MID_PREFILL_TOKENS = (32, 64, 128, 256, 512, 1024, 2048, 4096)
"""With the triton kernels, "full" runs one prefill step of each of these token counts below the
chunk."""
FAST_MIN_BATCH = 8
""""fast" decodes at the smallest batch bucket >= this (besides 1 and the largest)."""
WARMUP_MAX_TRIES = 64
"""Steps a warmup decode shape may take to come up (1, or 2 under speculative decoding, unless
the scheduler splits the admission of its requests) before warmup gives up."""
FULL_MAX_CONTEXT = 131072
""""full" without CUDA graphs warms context buckets up to this many tokens at most (each needs
an anchor request prefilled that far)."""


@dataclass(frozen=True)
class WarmupShape:
    """One warmup step: `kind` "prefill" (`batch` requests of `tokens` prompt tokens, prefilled
    together: the first step takes as many as one chunk holds), "decode"
    (`batch` requests feeding `tokens` tokens each, all with logits: 1, or 1 + N under
    speculative decoding) or "graph" (the decode graph of that shape, captured on padding rows).
    `context`: a decode step's context bucket (prefill: 0). `anchor`: prompt tokens of the long
    request that puts an eager decode step in its context bucket (0: none)."""

    kind: Literal["prefill", "decode", "graph"]
    batch: int
    tokens: int
    context: int = 0
    anchor: int = 0


def warmup_plan(config: EngineConfig, context_length: int, span: int, max_total_tokens: int,
                graph_max_batch: int | None, pool_pages: int | None = None) -> list[WarmupShape]:
    """The steps `config.warmup` runs (module docstring), in order: prefills, then decode steps
    by context bucket, then batch. `context_length`: the engine's; `span`: the request table's
    tokens per request (context buckets are capped there); `max_total_tokens`: the KV cache's
    size; `graph_max_batch`: the largest batch run as a CUDA graph (None: graphs off, decode
    batches go up to `max_running_requests`); `pool_pages`: the usable pages of the smallest KV
    pool (None: not a limit). A decode batch the scheduler can never form is left out: more
    requests than one step's token budget (`chunked_prefill_size` // tokens per request) or the
    pools hold; a larger graph bucket is then captured on first use."""
    mode = check_warmup(config.warmup or "none")
    if mode == "none":
        return []
    longest = min(config.chunked_prefill_size, context_length - 1, max_total_tokens - 1)
    plan = [WarmupShape("prefill", 1, longest)]
    together = _requests_per_chunk(config, longest, max_total_tokens, pool_pages)
    if together > 1:
        plan.append(WarmupShape("prefill", together, longest))
    if min(SHORT_PREFILL_TOKENS, longest) < longest:
        plan.append(WarmupShape("prefill", 1, SHORT_PREFILL_TOKENS))
    chunk = config.chunked_prefill_size
    triton = config.kernel_backend == "triton"
    if triton and mode == "full":
        plan += [WarmupShape("prefill", 1, t) for t in MID_PREFILL_TOKENS
                 if SHORT_PREFILL_TOKENS < t < longest]
    depth = min(LONG_PREFILL_DEPTH, context_length - 1 - SHORT_PREFILL_TOKENS,
                max_total_tokens - 1 - SHORT_PREFILL_TOKENS)
    depth -= depth % chunk
    if triton and depth > chunk:
        plan.append(WarmupShape("prefill", 1, depth + SHORT_PREFILL_TOKENS))
    n = 1 + config.speculative_num_steps
    fits = config.chunked_prefill_size // n
    if pool_pages is not None:     # each decode request holds its pages of (1 + 2 + 2n) tokens
        fits = min(fits, pool_pages // -(-(3 + 2 * n) // config.page_size))
    buckets = [b for b in batch_buckets(graph_max_batch or config.max_running_requests)
               if b <= fits] or [1]
    some = sorted({1, buckets[-1], *[b for b in buckets if b >= FAST_MIN_BATCH][:1]})
    base = context_bucket(1, span)
    plan += [WarmupShape("decode", b, n, base) for b in (buckets if mode == "full" and
                                                          graph_max_batch else some)]
    if graph_max_batch:
        batches = buckets if mode == "full" else [1]
        plan += [WarmupShape("graph", b, n, ctx)
                 for ctx in _graph_contexts(base, span, min(context_length, max_total_tokens))
                 for b in batches]
    elif mode == "full":
        for prev, ctx in _context_buckets(base, span, context_length, max_total_tokens,
                                          config.page_size * buckets[-1], 2 * n):
            plan.append(WarmupShape("decode", 1, n, ctx, prev + 1))
    return plan


def _requests_per_chunk(config: EngineConfig, longest: int, max_total_tokens: int,
                        pool_pages: int | None) -> int:
    """Requests of `longest` prompt tokens that one full step of `chunked_prefill_size` tokens
    takes when one request cannot fill it (a context shorter than the chunk): as many as the
    chunk needs, the running-request cap, the KV cache and the smallest pool allow; 1 when one
    request fills the chunk."""
    chunk = config.chunked_prefill_size
    if longest >= chunk:
        return 1
    fits = (max_total_tokens - 1) // longest
    if pool_pages is not None:
        fits = min(fits, pool_pages // -(-(longest + 1) // config.page_size))
    return max(1, min(-(-chunk // longest), config.max_running_requests, fits))


def _graph_contexts(base: int, span: int, longest: int) -> list[int]:
    """Every context bucket above `base` that a request of at most `longest` tokens reaches."""
    out, prev = [], base
    while prev < span and prev + 1 <= longest:
        prev = context_bucket(prev + 1, span)
        out.append(prev)
    return out


def _context_buckets(base: int, span: int, context_length: int, max_total_tokens: int,
                     others: int, growth: int) -> list[tuple[int, int]]:
    """(previous bucket, bucket) of each context bucket above `base` that "full" warms: an
    anchor of previous + 1 prompt tokens, growing by at most `growth` tokens while its shapes
    run, stays inside the bucket; the bucket lies within the context length and
    `FULL_MAX_CONTEXT`; it and the other requests (`others` tokens of pages) fit the KV cache."""
    out, prev = [], base
    while prev + 2 <= min(span, context_length):
        ctx = context_bucket(prev + 2, span)
        if (ctx > min(context_length, FULL_MAX_CONTEXT) or ctx + others > max_total_tokens
                or prev + 2 + growth > ctx):
            break
        out.append((prev, ctx))
        prev = ctx
    return out


def warm_up(engine: LLMEngine, mode: str | None = None, progress: bool = True) -> float:
    """Run the steps of `warmup_plan` with dummy requests through the engine's normal path, so
    Triton kernels compile and decode graphs are captured before the first request; returns the
    seconds it took (0 for "none"). `mode`: None takes the engine config's (resolved: "fast" on
    CUDA with triton, else "none"). `progress`: a tqdm bar.

    The engine is left as it was: no request, every page and slot free, the prefix cache
    flushed, the step / token / speculation / preemption counters restored. The dummy requests
    carry explicit seeds, so the seed stream of unseeded requests is not drawn from (seeded and
    unseeded outputs are the same with or without warmup). Refused while the engine has
    requests."""
    mode = check_warmup(mode if mode is not None else engine.runner.config.warmup or "none")
    if mode == "none":
        return 0.0
    if engine.has_unfinished() or engine.requests:
        raise RuntimeError("warmup with requests in the engine; allowed: an idle engine")
    graphs, table, sched = engine.runner.graphs, engine.runner.table, engine.scheduler
    plan = warmup_plan(dataclasses.replace(engine.runner.config, warmup=mode),
                       engine.context_length, table.max_pages * table.P, engine.max_total_tokens,
                       graphs.max_batch if graphs is not None else None,
                       min(table.full.num_usable, table.swa.num_usable))
    counters = (engine.steps, engine.prefill_tokens, engine.decode_tokens,
                list(engine.spec_accept_hist), engine.spec_draft_tokens,
                engine.spec_accepted_tokens, sched.num_preemptions, sched.prompt_tokens,
                sched.cached_prompt_tokens, graphs.replays if graphs is not None else 0)
    rng = random.Random(0)           # dummy token ids; never the global RNG
    start = time.perf_counter()
    anchor: Request | None = None
    with tqdm(total=len(plan), desc=f"warmup ({mode})", unit="shape", disable=not progress) as bar:
        for i, shape in enumerate(plan):
            if anchor is not None and shape.anchor != len(anchor.prompt_ids):
                _end(engine, [anchor])
                anchor = None
            if shape.anchor and anchor is None:
                anchor = _anchor(engine, shape, rng)
            if shape.kind == "graph":
                assert graphs is not None, "graph shapes are planned with CUDA graphs only"
                graphs.prepare(shape.batch, shape.tokens, shape.context,
                               engine.runner.config.capture_routing,
                               engine.runner.config.speculative_num_steps)
            else:
                _run_shape(engine, shape, i, anchor, rng)
            bar.update(1)
    if anchor is not None:
        _end(engine, [anchor])
    (engine.steps, engine.prefill_tokens, engine.decode_tokens, engine.spec_accept_hist,
     engine.spec_draft_tokens, engine.spec_accepted_tokens, sched.num_preemptions,
     sched.prompt_tokens, sched.cached_prompt_tokens, replays) = counters
    if graphs is not None:
        graphs.replays = replays
    seconds = time.perf_counter() - start
    logger.info("warmup (%s): %d shapes in %.1f s%s", mode, len(plan), seconds,
                f", {graphs.num_graphs()} decode graphs" if graphs is not None else "")
    return seconds


def _request(engine: LLMEngine, rid: str, num_tokens: int, max_tokens: int,
             rng: random.Random) -> Request:
    """A dummy request: random prompt ids, greedy, ignore_eos, an explicit seed."""
    ids = [rng.randrange(engine.vocab_size) for _ in range(num_tokens)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, seed=0)
    return engine.add_request(ids, params, rid=f"warmup-{rid}")


def _anchor(engine: LLMEngine, shape: WarmupShape, rng: random.Random) -> Request:
    """The long request of a context bucket, prefilled (it has its first token)."""
    anchor = _request(engine, "anchor", shape.anchor, shape.context - shape.anchor - 1, rng)
    while not anchor.output_ids:
        _sync_step(engine)
    return anchor


def _run_shape(engine: LLMEngine, shape: WarmupShape, index: int, anchor: Request | None,
               rng: random.Random) -> None:
    """Run `shape`: a prefill request to its end, or 1-token requests (with the anchor) until a
    step of `shape.batch` requests feeding `shape.tokens` tokens each has run."""
    if shape.kind == "prefill":
        reqs = [_request(engine, f"{index}.{j}", shape.tokens, 1, rng)
                for j in range(shape.batch)]
        while not all(r.is_finished for r in reqs):
            _sync_step(engine)
        _end(engine, reqs)
        return
    n = shape.tokens
    reqs = [_request(engine, f"{index}.{j}", 1, 2 + 2 * n, rng)
            for j in range(shape.batch - (anchor is not None))]
    for _ in range(WARMUP_MAX_TRIES):
        step = _sync_step(engine)
        if (len(step.requests) == shape.batch and all(x == n for x in step.shape.lens)
                and all(k == n for k in step.shape.num_logits)):
            break
    else:
        raise RuntimeError(f"warmup: no step of shape {shape} in {WARMUP_MAX_TRIES} steps")
    _end(engine, reqs)


def _sync_step(engine: LLMEngine) -> ScheduledStep:
    """One synchronous step (also under overlap scheduling); raises if nothing was scheduled."""
    step, _ = engine.step_sync()
    if step is None:
        raise RuntimeError("warmup: no step could be scheduled")
    return step


def _end(engine: LLMEngine, reqs: list[Request]) -> None:
    """Finish and forget warmup requests; the prefix cache drops what they left."""
    for req in reqs:
        engine.finish(req.rid)
        engine.pop(req.rid)
    engine.flush_cache()
