"""Warmup planning: the step shapes `LLMEngine.warmup` runs before the engine serves.

The first step of a new shape pays for Triton's compiles (each kernel specialisation, seconds
when the on-disk cache is cold) and, for a decode step served by CUDA graphs, the capture of its
graph (`engine/cuda_graph.py`: one graph per batch bucket, tokens per request and context bucket).
Warmup runs those steps with dummy requests through the normal engine path, so no request pays.

What a mode covers (`warmup_plan`):
- "none": nothing;
- "fast": two prefill steps, one of `chunked_prefill_size` tokens (the largest step, the common
  one under load) and a short one (`SHORT_PREFILL_TOKENS`: the small-M kernel specialisations),
  then decode steps at batch 1, at the smallest batch bucket >= `FAST_MIN_BATCH` and at the
  largest bucket, at the smallest context bucket: the kernel specialisations the other buckets
  share are compiled, and the graphs of the most common batch sizes are captured. The other
  buckets are still captured on first use (hundreds of ms each, no compile);
- "full": the prefill steps, then a decode step at every batch bucket and, with CUDA graphs,
  at every context bucket whose whole range fits the context length, the KV cache and
  `FULL_MAX_CONTEXT` (beyond that cap, prefilling the long anchor request costs more than the
  capture it saves): no step of a later request captures a graph. Without CUDA graphs there is
  nothing per bucket to capture: "full" is "fast" plus one batch-1 step per context bucket.
With speculative decoding every decode step is a verify step of 1 + N tokens per request.

A decode step at a context bucket above the smallest one needs a request whose context reaches
into it: an "anchor" request of `WarmupShape.anchor` prompt tokens (prefilled once, shared by the
shapes of its bucket) decodes together with 1-token requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dsv4.config.engine import EngineConfig, check_warmup
from dsv4.engine.cuda_graph import batch_buckets, context_bucket

SHORT_PREFILL_TOKENS = 16
"""The short prefill step of every plan (capped by `chunked_prefill_size`)."""
FAST_MIN_BATCH = 8
""""fast" decodes at the smallest batch bucket >= this (besides 1 and the largest)."""
FULL_MAX_CONTEXT = 131072
""""full" warms context buckets up to this many tokens at most."""


@dataclass(frozen=True)
class WarmupShape:
    """One warmup step: `kind` "prefill" (one request of `tokens` prompt tokens) or "decode"
    (`batch` requests feeding `tokens` tokens each, all with logits: 1, or 1 + N under
    speculative decoding). `context`: a decode step's context bucket (prefill: 0). `anchor`:
    prompt tokens of the long request that puts the step in its context bucket (0: none)."""

    kind: Literal["prefill", "decode"]
    batch: int
    tokens: int
    context: int = 0
    anchor: int = 0


def warmup_plan(config: EngineConfig, context_length: int, span: int, max_total_tokens: int,
                graph_max_batch: int | None) -> list[WarmupShape]:
    """The steps `config.warmup` runs (module docstring), in order: prefills, then decode steps
    by context bucket, then batch. `context_length`: the engine's; `span`: the request table's
    tokens per request (context buckets are capped there); `max_total_tokens`: the KV cache's
    size; `graph_max_batch`: the largest batch run as a CUDA graph (None: graphs off, decode
    batches go up to `max_running_requests`)."""
    mode = check_warmup(config.warmup or "none")
    if mode == "none":
        return []
    longest = min(config.chunked_prefill_size, context_length - 1, max_total_tokens - 1)
    plan = [WarmupShape("prefill", 1, longest)]
    if min(SHORT_PREFILL_TOKENS, longest) < longest:
        plan.append(WarmupShape("prefill", 1, SHORT_PREFILL_TOKENS))
    n = 1 + config.speculative_num_steps
    buckets = batch_buckets(graph_max_batch or config.max_running_requests)
    some = sorted({1, buckets[-1], *[b for b in buckets if b >= FAST_MIN_BATCH][:1]})
    base = context_bucket(1, span)
    plan += [WarmupShape("decode", b, n, base) for b in (buckets if mode == "full" and
                                                          graph_max_batch else some)]
    if mode == "full":
        batches = buckets if graph_max_batch else [1]
        for prev, ctx in _context_buckets(base, span, context_length, max_total_tokens,
                                          config.page_size * buckets[-1], 2 * n * len(batches)):
            plan += [WarmupShape("decode", b, n, ctx, prev + 1) for b in batches]
    return plan


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
