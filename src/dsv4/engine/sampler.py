"""Batched token sampling on the logits' device, with no host synchronisation.

Owns the per-step `SamplingBatch` (the request parameters as device tensors), the logits pipeline
and the random draw:

    raw logits [B, V] fp32
      -> penalties (repetition on prompt+output, frequency/presence on output), then logit_bias
      -> structured output: tokens the row's grammar does not allow -> -inf (`allowed` bitmask)
      -> greedy rows: argmax            (ties -> lowest token id; the backend's `ArgmaxOp`)
      -> sampled rows: / temperature -> top-k -> top-p -> min-p -> exponential race
      -> log-probs of the chosen tokens, only when some row asked for them

Key invariants:

* Every result is computed with tensor ops on `logits.device`; nothing here calls
  `.item()`/`.tolist()`. The engine reads `SampleOutput.token_ids` at its own named sync point.
  Python-side flags in `SamplingBatch` (decided when it is built) skip whole stages when no row
  needs them; a row with neutral settings gets the same result whether a stage runs or not, so
  results never depend on the other rows of the batch.
* Randomness is a pure function of `(seed, step, token id)` (`hash_uniform`): a request samples
  the same tokens alone or in any batch, on any device.
* Log-probs cost a logsumexp over `[B, V]` per step, so they are computed only when some row
  asked (`SamplingParams.logprobs` is not None); otherwise `SampleOutput.logprobs` is None. When
  computed they are computed for every row (rows that did not ask are dropped by the engine).
* Returned logprobs are those of the RAW model distribution `log_softmax(logits)`, before
  penalties, temperature and filtering (vLLM's default "raw logprobs"): they describe what the
  model predicted, are comparable across requests with different sampling settings and match the
  logprobs a trainer computes from the same forward pass. A row with `scaled_logprobs` reports
  `log_softmax(logits / temperature)` instead (the sampled-from distribution before truncation,
  RL's rollout log-prob); `token_logprobs` is the formula, shared with the RL trainer so both
  sides round alike.

Test: `pytest tests/engine/test_sampler.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dsv4.engine.grammar import apply_token_bitmask
from dsv4.engine.sample_noise import hash_uniform
from dsv4.engine.sampling_params import MAX_SEED, SamplingParams
from dsv4.kernels.ops import ArgmaxOp
from dsv4.kernels.ref.argmax import argmax as ref_argmax
from dsv4.utils.device import to_device

MAX_STEP = 2**31 - 1
"""Steps are folded into the RNG key as 31-bit values."""
_TOP_K_OFF = 2**31 - 1
"""Stored for top-k = off when the vocab size is unknown; the sampler clamps k to V."""


@dataclass(frozen=True)
class SamplingBatch:
    """One decode step's sampling parameters as device tensors, built by `build`.

    Tensors are all `[B]` on the logits' device. Python-side fields are fixed at build time and let
    `sample` skip stages without reading tensors.

    `temperature`: fp32; 0 marks a greedy row (temperature 0 or top_k 1). `top_p`: fp32, 1 = off.
    `top_k`: int64; the vocab size (or 2**31 - 1 when unknown) = off; clamped to V when used.
    `min_p`: fp32, 0 = off. `repetition_penalty`, `frequency_penalty`, `presence_penalty`: fp32;
    1, 0, 0 = off. `seeds`: int64, the request's resolved seed (see `build`). `steps`: int64, index
    of the token being generated (number of output tokens so far). `max_logprobs`: the largest
    requested `logprobs` in the batch, or -1 when none wants any (then `do_logprobs` is False).
    `all_greedy`: every row is greedy, so no random numbers are drawn. `do_top_k`, `do_top_p`,
    `do_min_p`: some sampled (non-greedy) row uses that filter. `do_repetition_penalty`,
    `do_frequency_penalty`, `do_presence_penalty`: some row uses it.
    """

    temperature: Tensor
    top_p: Tensor
    top_k: Tensor
    min_p: Tensor
    repetition_penalty: Tensor
    frequency_penalty: Tensor
    presence_penalty: Tensor
    seeds: Tensor
    steps: Tensor
    max_logprobs: int
    all_greedy: bool
    do_top_k: bool = False
    do_top_p: bool = False
    do_min_p: bool = False
    do_repetition_penalty: bool = False
    do_frequency_penalty: bool = False
    do_presence_penalty: bool = False
    # [B] fp32 divisor of the logits for the reported logprobs (temperature or 1); None: all 1
    logprob_temperature: Tensor | None = None
    # logit bias as (row, token id, bias) triples; None: no row has one
    bias: tuple[Tensor, Tensor, Tensor] | None = None

    @property
    def size(self) -> int:
        """Number of rows B."""
        return int(self.temperature.shape[0])

    @property
    def do_penalties(self) -> bool:
        return self.do_repetition_penalty or self.do_frequency_penalty or self.do_presence_penalty

    @property
    def do_logprobs(self) -> bool:
        """Some row asked for log-probs (`SamplingParams.logprobs` is not None): `sample` and
        `verify` compute them for the batch; otherwise they skip the logsumexp."""
        return self.max_logprobs >= 0

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        steps: Sequence[int],
        seeds: Sequence[int],
        device: torch.device | str,
        *,
        vocab_size: int | None = None,
    ) -> SamplingBatch:
        """Stage one step's parameters on `device` (two host-to-device copies, pinned on CUDA).

        `params`: one entry per row. `steps`: per row, the number of output tokens generated so
        far, 0 <= step < 2**31. `seeds`: per row, the request's RESOLVED seed, 0 <= seed < 2**63.
        The engine passes `params.seed` when set, otherwise a seed it drew once when the request
        was admitted and keeps for the request's lifetime (so its samples are a fixed function of
        (seed, step) even though the user gave none). Parallel samples of one prompt (n > 1) need
        distinct seeds, or they produce identical outputs. `device`: where the logits live.
        `vocab_size`: stored for top_k = off; optional because the sampler clamps k to V.

        Raises ValueError on an empty batch, mismatched lengths, or a step/seed out of range.
        """
        _validate_rows(params, steps, seeds)
        greedy = [p.is_greedy for p in params]
        sampled = [p for p, g in zip(params, greedy, strict=True) if not g]
        off_k = _TOP_K_OFF if vocab_size is None else vocab_size
        floats = torch.tensor(  # [7, B]
            [
                [0.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)],
                [p.temperature if p.scaled_logprobs and not g else 1.0
                 for p, g in zip(params, greedy, strict=True)],
                [p.top_p for p in params],
                [p.min_p for p in params],
                [p.repetition_penalty for p in params],
                [p.frequency_penalty for p in params],
                [p.presence_penalty for p in params],
            ],
            dtype=torch.float32,
        )
        ints = torch.tensor(  # [3, B]
            [[off_k if p.top_k == -1 else p.top_k for p in params], list(seeds), list(steps)],
            dtype=torch.int64,
        )
        floats, ints = to_device(floats, device), to_device(ints, device)
        requested = [p.logprobs for p in params if p.logprobs is not None]
        triples = [(r, t, b) for r, p in enumerate(params) for t, b in p.logit_bias]
        return cls(
            temperature=floats[0],
            logprob_temperature=floats[1] if any(p.scaled_logprobs for p in params) else None,
            top_p=floats[2],
            min_p=floats[3],
            repetition_penalty=floats[4],
            frequency_penalty=floats[5],
            presence_penalty=floats[6],
            top_k=ints[0],
            seeds=ints[1],
            steps=ints[2],
            max_logprobs=max(requested, default=-1),
            all_greedy=not sampled,
            do_top_k=any(p.top_k != -1 for p in sampled),
            do_top_p=any(p.top_p < 1 for p in sampled),
            do_min_p=any(p.min_p > 0 for p in sampled),
            do_repetition_penalty=any(p.repetition_penalty != 1 for p in params),
            do_frequency_penalty=any(p.frequency_penalty != 0 for p in params),
            do_presence_penalty=any(p.presence_penalty != 0 for p in params),
            bias=_bias_tensors(triples, device) if triples else None,
        )


@dataclass(frozen=True)
class SampleOutput:
    """Result of `sample`; all tensors on the logits' device.

    `token_ids`: `[B]` int64, the chosen tokens. `logprobs`: `[B]` fp32, raw `log_softmax(logits)`
    at `token_ids`; None when no row asked for logprobs (`SamplingBatch.do_logprobs`).
    `top_logprobs`: `[B, n]` fp32 raw logprobs sorted descending, `n = batch.max_logprobs`; None
    likewise (the engine slices each row to its own k). `top_ids`: `[B, n]` int64 token ids
    matching `top_logprobs`; None likewise. The three log-prob fields are all None or all set.
    """

    token_ids: Tensor
    logprobs: Tensor | None = None
    top_logprobs: Tensor | None = None
    top_ids: Tensor | None = None


def _validate_rows(params: Sequence[SamplingParams], steps: Sequence[int],
                   seeds: Sequence[int]) -> None:
    if not params:
        raise ValueError("params=[] is invalid; allowed: at least one request per SamplingBatch")
    for name, values in (("steps", steps), ("seeds", seeds)):
        if len(values) != len(params):
            raise ValueError(f"len({name})={len(values)} is invalid; "
                             f"allowed: len(params)={len(params)}")
    for step in steps:
        if not 0 <= step <= MAX_STEP:
            raise ValueError(f"steps entry {step} is invalid; allowed: 0 <= step < 2**31")
    for seed in seeds:
        if not 0 <= seed <= MAX_SEED:
            raise ValueError(f"seeds entry {seed} is invalid; allowed: 0 <= seed < 2**63")


def _bias_tensors(triples: list[tuple[int, int, float]], device: torch.device | str
                  ) -> tuple[Tensor, Tensor, Tensor]:
    rows, toks, bias = zip(*triples, strict=True)
    ints = to_device(torch.tensor([rows, toks], dtype=torch.int64), device)
    return ints[0], ints[1], to_device(torch.tensor(bias, dtype=torch.float32), device)


def apply_penalties(
    logits: Tensor, batch: SamplingBatch, token_counts: Tensor | None, prompt_mask: Tensor | None
) -> Tensor:
    """Apply repetition, frequency and presence penalties; returns a new tensor, never mutates.

    `logits`: `[B, V]` fp32 raw logits. `batch`: supplies per-row penalties and the flags deciding
    which penalties run at all. `token_counts`: `[B, V]` int32, occurrences of each token in the
    OUTPUT so far (needed for frequency/presence penalties). `prompt_mask`: `[B, V]` bool, token
    occurs in the prompt or the output (needed for the repetition penalty). Returns `[B, V]` fp32;
    `logits` itself when every penalty is neutral.

    Formulas (HF/vLLM): where `prompt_mask`, positive logits are divided by the repetition penalty
    and negative ones multiplied; then `logits -= frequency * counts` and
    `logits -= presence * (counts > 0)`; then each row's `logit_bias` is added (OpenAI).
    """
    out = _penalised(logits, batch, token_counts, prompt_mask)
    if batch.bias is not None:
        rows, toks, bias = batch.bias
        out = out.index_put((rows, toks), bias, accumulate=True)
    return out


def _penalised(logits: Tensor, batch: SamplingBatch, token_counts: Tensor | None,
               prompt_mask: Tensor | None) -> Tensor:
    out = logits
    if batch.do_repetition_penalty:
        if prompt_mask is None:
            raise ValueError("prompt_mask=None is invalid; "
                             "allowed: a [B, V] bool tensor when repetition_penalty != 1")
        rep = batch.repetition_penalty.unsqueeze(1)  # [B, 1]
        out = torch.where(prompt_mask, torch.where(out > 0, out / rep, out * rep), out)
    if batch.do_frequency_penalty or batch.do_presence_penalty:
        if token_counts is None:
            raise ValueError("token_counts=None is invalid; "
                             "allowed: a [B, V] int32 tensor when penalties are set")
        if batch.do_frequency_penalty:
            out = out - batch.frequency_penalty.unsqueeze(1) * token_counts
        if batch.do_presence_penalty:
            out = out - batch.presence_penalty.unsqueeze(1) * (token_counts > 0)
    return out


def _apply_top_k_top_p(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Mask (to -inf) tokens outside each row's top-k, then outside its top-p nucleus.

    One ascending sort serves both. Top-k keeps every token tied with the k-th value. Top-p
    drops a token when the probability mass of the tokens ranked above it is already >= p,
    i.e. keeps the smallest head whose mass reaches p, and always keeps the top token.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1)  # [B, V] ascending
    if batch.do_top_k:
        k = batch.top_k.clamp(1, vocab)  # [B]
        kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))  # [B, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if batch.do_top_p:
        # [B, V] mass of this token and all below it
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - batch.top_p).unsqueeze(1)
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def filtered_probs(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Temperature, top-k, top-p, min-p: `[B, V]` probabilities, 0 for filtered tokens.

    Min-p zeroes tokens without renormalising: the exponential race is scale-invariant.
    """
    # greedy rows: any finite value
    temperature = torch.where(batch.temperature > 0, batch.temperature, 1.0)
    scaled = logits / temperature.unsqueeze(1)
    if batch.do_top_k or batch.do_top_p:
        scaled = _apply_top_k_top_p(scaled, batch)
    probs = scaled.softmax(dim=-1)  # [B, V]
    if batch.do_min_p:
        threshold = probs.amax(dim=-1, keepdim=True) * batch.min_p.unsqueeze(1)  # [B, 1]
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _exponential_race(probs: Tensor, batch: SamplingBatch, argmax: ArgmaxOp) -> Tensor:
    """Draw `argmax(probs / E)`, `E ~ Exp(1)` i.i.d.: an exact categorical sample of the
    (possibly unnormalised) `probs` with no host sync, unlike `torch.multinomial`."""
    # [B, V]
    exp = hash_uniform(batch.seeds, batch.steps, probs.shape[-1], probs.device).log_().neg_()
    return argmax(probs / exp)


def _choose_tokens(penalised: Tensor, batch: SamplingBatch, argmax: ArgmaxOp) -> Tensor:
    """`[B]` int64: argmax for greedy rows, a seeded draw for the others (`argmax` serves both:
    it returns torch.argmax's ids on every backend)."""
    greedy = argmax(penalised)  # [B]; the first (lowest-id) maximum, on every backend
    if batch.all_greedy:
        return greedy
    drawn = _exponential_race(filtered_probs(penalised, batch), batch, argmax)
    return torch.where(batch.temperature == 0, greedy, drawn)


def token_logprobs(logits: Tensor, token_ids: Tensor,
                   temperature: Tensor | None = None) -> Tensor:
    """log_softmax(logits / temperature) at `token_ids`: logits [B, V] fp32, token_ids [B],
    temperature [B] fp32 or None (= 1) -> [B] fp32. The engine's reported log-prob, op for op."""
    if temperature is not None:
        logits = logits / temperature.unsqueeze(1)
    lse = torch.logsumexp(logits, dim=-1)
    return logits.gather(1, token_ids.unsqueeze(1)).squeeze(1) - lse


def raw_logprobs(logits: Tensor, token_ids: Tensor,
                  num_top: int) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Sampled-token and top-`num_top` logprobs of the distribution `log_softmax(logits)`."""
    lse = torch.logsumexp(logits, dim=-1)  # [B]
    chosen = logits.gather(1, token_ids.unsqueeze(1)).squeeze(1) - lse  # [B]
    if num_top < 0:
        return chosen, None, None
    top_values, top_ids = logits.topk(num_top, dim=-1, sorted=True)  # [B, n]
    return chosen, top_values - lse.unsqueeze(1), top_ids


def argmax_only(params: Sequence[SamplingParams]) -> bool:
    """Whether `sample` would only take the row argmax of the raw logits for these rows: every row
    greedy, with no penalty, no logit bias and no log-probs (a row's grammar is the caller's to
    check). The engine then skips `SamplingBatch.build` (its tensors and host-to-device copies):
    the same token ids, less host work per decode step."""
    return all(p.is_greedy and not p.uses_penalties and not p.logit_bias and p.logprobs is None
               for p in params)


def sample(
    logits: Tensor,
    batch: SamplingBatch,
    token_counts: Tensor | None = None,
    prompt_mask: Tensor | None = None,
    allowed: Tensor | None = None,
    argmax: ArgmaxOp = ref_argmax,
) -> SampleOutput:
    """Pick one token per row; no host sync.

    `logits`: `[B, V]` fp32 raw logits, one row per logit position of the step; not mutated.
    `batch`: this step's parameters (`batch.size == B`). `token_counts`: `[B, V]` int32
    output-token counts; required if frequency or presence penalties are active. `prompt_mask`:
    `[B, V]` bool prompt-or-output membership; required if a repetition penalty is active.
    `allowed`: `[B, ceil(V / 32)]` int32 token bitmask of structured-output rows (None: no row
    is constrained; `apply_token_bitmask`). `argmax`: the row argmax of the greedy rows and of
    the race (the engine passes its backend's `KernelOps.argmax`; every backend returns the same
    ids). Returns a `SampleOutput` with raw-distribution logprobs when `batch.do_logprobs` (see
    the module docstring), else with token ids only.
    """
    assert logits.dim() == 2 and logits.shape[0] == batch.size, (
        f"logits shape {tuple(logits.shape)} does not match batch size {batch.size}"
    )
    assert logits.dtype == torch.float32, f"logits must be float32, got {logits.dtype}"
    penalised = apply_penalties(logits, batch, token_counts, prompt_mask)  # [B, V]
    if allowed is not None:
        penalised = apply_token_bitmask(penalised, allowed)
    token_ids = _choose_tokens(penalised, batch, argmax)  # [B]
    if not batch.do_logprobs:
        return SampleOutput(token_ids=token_ids)
    if batch.logprob_temperature is not None:
        logits = logits / batch.logprob_temperature.unsqueeze(1)
    logprobs, top_logprobs, top_ids = raw_logprobs(logits, token_ids, batch.max_logprobs)
    return SampleOutput(token_ids=token_ids, logprobs=logprobs, top_logprobs=top_logprobs,
                        top_ids=top_ids)
