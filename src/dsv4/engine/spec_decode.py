"""MTP speculative decoding: verify a step's drafted tokens, then draft the next ones.

A speculative engine (`EngineConfig.speculative_num_steps = N > 0`) feeds a decoding request its
pending token x followed by the N drafts d_1..d_N of the previous step, at positions c..c+N, and
asks for logits at all N + 1 positions. Every sampling request of a step is a *segment* of
consecutive logit rows: k rows for k - 1 drafts (plain decode and the last chunk of a prefill:
k = 1, no draft). Row i of a segment predicts the token at position start + i + 1; the draft fed
after row i (the input token of row i + 1) is its proposal.

Verification (`verify`, one pass over all rows, no host sync). Per row, the target's sampling
distribution p (penalties counting the drafts fed before the row, then the structured-output
mask, then temperature, top-k, top-p, min-p, exactly as `sampler.sample` for one row):
    greedy row:  ok = argmax p == draft;                 final token: argmax p
    sampled row: ok = u < p(draft), u uniform (top-1 drafter: q = one-hot(draft));
                 final token: a race draw from p without the draft (rejection residual), or from
                 p itself on the segment's last row (the bonus token)
The segment accepts its leading run of ok rows (a drafts), then emits the drafts and the final
token of row a: a + 1 tokens, distributed exactly as a + 1 plain samples of the target
(speculative rejection sampling with a one-hot proposal). A k = 1 segment is the plain sampler
bit for bit: the same race uniforms, keyed by (seed, output index).

Structured output: row i of a constrained segment is masked with its grammar's state after the
request's tokens and the drafts fed before the row (`grammar.draft_token_bitmask`), so p above is
the target's constrained distribution and a draft the grammar disallows has p(draft) = 0: it is
rejected (greedy: it is never the masked argmax). Rows after a draft the grammar rejects, or
after one that ends the grammar, carry some valid mask: the former come after the segment's final
row and emit nothing, the latter's tokens are dropped as the request finishes on that draft.

Drafting (`draft`, after verification): the MTP block runs once over every token of the step
(its SWA cache must cover every position), fed each token's successor: the next input token, or
for the row where a segment's new tokens begin, its first emitted token. Its logits at that row
give d_1 (greedy). The chain then runs the block N - 1 times more, one token per drafting
request, at the following positions, on the block's own output streams (EAGLE): d_2..d_N. Chain
positions get the block's KV; the next step's first pass overwrites every one of them (it
starts at the first of them), so a rejected draft never reaches a later token.

The target's caches at rejected positions (SWA rows, compressor ring rows, compressed entries,
indexer keys) are likewise rewritten by the next step before any token reads them: a token only
reads positions at or before its own, and the next step starts at the first rejected position.
Compressor rings are twice as long under speculation (`EngineConfig.rings`) so a verify step's
writes never land on ring rows that the next step still reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dsv4.cache.pools import KVPools
from dsv4.cache.req_table import RequestTable
from dsv4.engine.grammar import apply_token_bitmask
from dsv4.engine.sampler import (
    SamplingBatch,
    apply_penalties,
    filtered_probs,
    hash_uniform,
    raw_logprobs,
)
from dsv4.engine.scheduler import ScheduledStep
from dsv4.kernels.ops import ArgmaxOp
from dsv4.kernels.ref.argmax import argmax as ref_argmax
from dsv4.kernels.registry import KernelOps
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.model.forward_context import ForwardContext
from dsv4.utils.device import to_device

ACCEPT_SALT = 0x3C6EF372FE94F82B
"""Seed salt of the accept-test uniforms (independent of the race uniforms of the same step)."""


@dataclass(frozen=True)
class Segments:
    """The logit rows of a step's sampling requests, on the device.

    `seg` [R]: segment of each row. `first` [S]: first row of each segment. `last` [S]: its last
    row. `draft` [R]: the token fed after the row in its segment (its proposal), -1 on a
    segment's last row."""

    seg: Tensor
    first: Tensor
    last: Tensor
    draft: Tensor

    @staticmethod
    def build(lens: list[int], row_tokens: Tensor) -> Segments:
        """`lens`: rows per segment (host); `row_tokens` [R]: the input token of every logit row."""
        device = row_tokens.device
        k = to_device(torch.tensor(lens, dtype=torch.int64), device)
        seg = torch.repeat_interleave(torch.arange(len(lens), device=device), k,
                                      output_size=row_tokens.shape[0])
        last = torch.cumsum(k, 0) - 1
        first = last - k + 1
        nxt = torch.cat((row_tokens[1:], row_tokens.new_full((1,), -1)))
        is_last = torch.zeros_like(row_tokens, dtype=torch.bool).index_fill_(0, last, True)
        return Segments(seg, first, last, torch.where(is_last, -1, nxt))


@dataclass(frozen=True)
class Verified:
    """`tokens` [R]: the emitted token of each row (the accepted drafts, then the final token),
    -1 after the final row. `accepted` [S]: drafts accepted per segment (tokens = accepted + 1).
    `logprobs` [R], `top_logprobs` / `top_ids` [R, n]: raw log-probs of the emitted tokens (the
    sampler's convention), rows past the final one meaningless; all None when no row asked for
    log-probs (`SamplingBatch.do_logprobs`)."""

    tokens: Tensor
    accepted: Tensor
    logprobs: Tensor | None
    top_logprobs: Tensor | None
    top_ids: Tensor | None


def _draft_counts(segs: Segments, vocab: int) -> Tensor:
    """[R, V] int32: per row, the counts of the drafts fed before it within its segment."""
    R = segs.seg.shape[0]
    fed = torch.cat((segs.draft.new_full((1,), -1), segs.draft[:-1]))      # token fed at the row
    fed = torch.where(segs.first[segs.seg] == torch.arange(R, device=fed.device), -1, fed)
    onehot = torch.zeros(R, vocab + 1, dtype=torch.int32, device=fed.device)
    onehot.scatter_(1, torch.where(fed < 0, vocab, fed)[:, None], 1)
    total = onehot[:, :vocab].cumsum(0, dtype=torch.int32)
    before = torch.cat((total.new_zeros(1, vocab), total))[segs.first[segs.seg]]
    return total - before


def verify(logits: Tensor, segs: Segments, batch: SamplingBatch, counts: Tensor | None,
           seen: Tensor | None, allowed: Tensor | None = None,
           argmax: ArgmaxOp = ref_argmax) -> Verified:
    """Accept each segment's drafts and draw its final token (module docstring). `batch` has one
    row per logit row (its step = the output index that row predicts); `counts` / `seen` [R, V]
    are the segment's penalty state at the step's start (needed only with penalties); `allowed`
    [R, ceil(V / 32)] int32: each row's structured-output token bitmask (None: no row is
    constrained; `grammar.draft_token_bitmask`); `argmax`: the row argmax of the greedy rows and
    of the race (`KernelOps.argmax`, the same ids on every backend). Log-probs stay those of the
    raw logits, computed only when some row asked for them (`batch.do_logprobs`)."""
    R, V = logits.shape
    if batch.do_penalties:
        assert counts is not None and seen is not None
        extra = _draft_counts(segs, V)
        counts, seen = counts + extra, seen | (extra > 0)
    penalised = apply_penalties(logits, batch, counts, seen)
    if allowed is not None:
        penalised = apply_token_bitmask(penalised, allowed)
    greedy_tok = argmax(penalised)                                            # [R]
    has_draft = segs.draft >= 0
    draft = segs.draft.clamp(min=0)
    is_greedy = batch.temperature == 0
    ok = has_draft & (greedy_tok == draft)
    final = greedy_tok
    if not batch.all_greedy:
        probs = filtered_probs(penalised, batch)                                  # [R, V]
        p_draft = probs.gather(1, draft[:, None])[:, 0] / probs.sum(dim=-1)
        salted = batch.seeds ^ ACCEPT_SALT
        u = hash_uniform(salted, batch.steps, 1, logits.device)[:, 0]
        ok = torch.where(is_greedy, ok, has_draft & (u < p_draft))
        residual = torch.where(has_draft[:, None],
                               probs.scatter(1, draft[:, None], 0.0), probs)
        race = hash_uniform(batch.seeds, batch.steps, V, logits.device).log_().neg_()
        final = torch.where(is_greedy, greedy_tok, argmax(residual / race))
    rows = torch.arange(R, device=logits.device)
    # the final row of a segment: its first row that is not ok (its last row never is)
    stop = torch.where(ok, R, rows)
    final_row = torch.full_like(segs.first, R).scatter_reduce(0, segs.seg, stop, "amin")
    accepted = final_row - segs.first
    fr = final_row[segs.seg]
    tokens = torch.where(rows < fr, draft, torch.where(rows == fr, final, -1))
    if not batch.do_logprobs:
        return Verified(tokens, accepted, None, None, None)
    if batch.logprob_temperature is not None:
        logits = logits / batch.logprob_temperature.unsqueeze(1)
    logprobs, top_lp, top_ids = raw_logprobs(logits, tokens.clamp(min=0), batch.max_logprobs)
    return Verified(tokens, accepted, logprobs, top_lp, top_ids)


@dataclass(frozen=True)
class Drafts:
    """A speculative step's verification and drafting results, on the device: `accepted` [S]
    drafts accepted per sampling request; `next` [D, N] the next step's drafts of the requests
    listed in `requests` (indices into the step's sampling requests)."""

    accepted: Tensor
    next: Tensor
    requests: list[int]


def successors(step: ScheduledStep) -> list[int]:
    """Per token of the step, the token after it (the MTP block's second input): the next fed
    token, the request's next prompt token after a prefill chunk that does not finish its prompt,
    else 0 (a placeholder: the runner writes the emitted token there once verified)."""
    out: list[int] = []
    off = 0
    for req, start, n in zip(step.requests, step.shape.starts, step.shape.lens, strict=True):
        fed = step.input_ids[off:off + n]
        end = start + n
        out.extend(fed[1:])
        out.append(req.all_ids[end] if end < len(req.all_ids) else 0)
        off += n
    return out


def swa_context(table: RequestTable, pools: KVPools, slots: Tensor, positions: Tensor,
                window: int, ops: KernelOps) -> ForwardContext:
    """A one-token-per-request context that serves SWA layers only (the MTP block): positions
    [B], request slots [B]; no compressor plans. Its rows are `device_context`'s for one new
    token per request at `positions`."""
    B = positions.shape[0]
    rows = ops.step_metadata(slots, positions, torch.ones_like(positions), table.page_table,
                             table.full_to_swa, table.P, B, window, [])
    return ForwardContext(positions=rows.positions, swa_write=rows.swa_write, window=rows.window,
                          plans={}, caches=pools.layers,
                          logits_index=torch.arange(B, device=positions.device), ops=ops,
                          logits_all=True)


def draft(model: DeepSeekV4ForCausalLM, ctx: ForwardContext, streams: Tensor, next_ids: Tensor,
          first_rows: Tensor, slots: Tensor, table: RequestTable, pools: KVPools,
          num_steps: int) -> Tensor:
    """The next step's drafts [D, num_steps] of D drafting requests (module docstring); with
    num_steps = 0 only the MTP pass over the step's tokens (its cache) runs.

    `ctx`, `streams` [T, n, d]: the step's context and the target's streams; `next_ids` [T]: each
    token's successor (the emitted token at `first_rows`); `first_rows` [D]: per drafting request
    the token row where its new tokens begin; `slots` [D]: their request slots."""
    (index, every), (ctx.logits_index, ctx.logits_all) = (ctx.logits_index, ctx.logits_all), \
        (first_rows, False)
    try:
        logits, out = model.mtp_forward_batch(streams, next_ids, ctx)
    finally:
        ctx.logits_index, ctx.logits_all = index, every
    if num_steps == 0:
        return next_ids.new_zeros(first_rows.shape[0], 0)
    tokens = [ctx.ops.argmax(logits)]
    state = out[first_rows]                                                   # [D, n, d]
    pos = ctx.positions[first_rows]
    for j in range(1, num_steps):
        step_ctx = swa_context(table, pools, slots, pos + j, model.config.window, ctx.ops)
        logits, state = model.mtp_forward_batch(state, tokens[-1], step_ctx)
        tokens.append(step_ctx.ops.argmax(logits))
    return torch.stack(tokens, dim=1)
