"""Per-request sampling parameters (OpenAI / vLLM semantics).

Owns `SamplingParams`, the frozen, validated description of how one request is decoded: length
limit, the logits pipeline (penalties -> temperature -> top-k -> top-p -> min-p), seeding, stop
conditions and logprob reporting. Defaults follow vLLM.

Invariants:

* An instance is valid by construction: `__post_init__` validates every field and raises
  `ValueError` naming the field, the bad value and the allowed range. It never rewrites a field,
  so `stop`/`stop_token_ids` must already be tuples; use `SamplingParams.create` to pass a `str`
  or a list.
* `temperature == 0` or `top_k == 1` means greedy (`SamplingParams.is_greedy`).

Test: `pytest tests/engine/test_sampling_params.py`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MAX_LOGPROBS = 20
"""Largest `logprobs` (number of top alternatives) a request may ask for."""

MAX_SEED = 2**63 - 1
"""Seeds are stored in int64 tensors by the sampler."""

STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice", "ebnf")
"""What `StructuredOutput.kind` may be."""


@dataclass(frozen=True)
class StructuredOutput:
    """Constrain a request's output to a grammar (compiled by `engine/grammar.py`).

    `kind`: "json_object" (any JSON object; `spec` ""), "json_schema" (`spec`: the schema as JSON
    text), "regex" (`spec`: the pattern), "choice" (`spec`: a JSON list of the allowed strings),
    "ebnf" (`spec`: a GBNF grammar with a `root` rule). Whether `spec` compiles is checked by the
    engine when the request arrives."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        _require(self.kind in STRUCTURED_KINDS, "structured.kind", self.kind,
                 f"one of {list(STRUCTURED_KINDS)}")
        _require(isinstance(self.spec, str) and (self.kind == "json_object") == (not self.spec),
                 "structured.spec", self.spec,
                 "'' for json_object, else the schema, pattern, choices or grammar text")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _require(ok: bool, field: str, value: object, allowed: str) -> None:
    """Raise the uniform edge-validation error unless `ok`."""
    if not ok:
        raise ValueError(f"{field}={value!r} is invalid; allowed: {allowed}")


@dataclass(frozen=True)
class SamplingParams:
    """How to decode one request. Construct directly (tuples) or via `create`.

    - `max_tokens`: maximum number of generated tokens, >= 1.
    - `temperature`: softmax temperature, >= 0; 0 means greedy (argmax).
    - `top_p`: nucleus sampling: keep the smallest set of tokens whose probability sums to
      >= top_p; 0 < top_p <= 1 (1 = off).
    - `top_k`: keep the k most likely tokens; -1 = off, otherwise >= 1.
    - `min_p`: drop tokens whose probability is < min_p * (max probability); 0..1 (0 = off).
    - `repetition_penalty`: HF/vLLM multiplicative penalty on tokens seen in the prompt or the
      output; > 0 (1 = off).
    - `frequency_penalty`: subtracted once per occurrence in the output; -2..2 (0 = off).
    - `presence_penalty`: subtracted once if the token occurs in the output; -2..2 (0 = off).
    - `seed`: seed for reproducible sampling, 0 <= seed < 2**63; None lets the engine draw one.
    - `stop`: stop strings; the output is cut before the earliest occurrence (excluded).
    - `stop_token_ids`: token ids that end the request; the token stays in the output, its text
      too unless `skip_special_tokens` drops it (vLLM's semantics).
    - `ignore_eos`: keep generating past the eos token.
    - `logprobs`: None = no logprobs; k in 0..20 = the sampled token's logprob plus the top-k
      alternatives.
    - `prompt_logprobs`: None = none; k in 0..20 = for every prompt token after the first, its
      log-prob under the model given the tokens before it, plus the top-k alternatives (raw
      `log_softmax`, vLLM's semantics); the request then computes its whole prompt (no prefix
      cache match).
    - `skip_special_tokens`: drop special tokens when detokenizing.
    - `logit_bias`: (token id, bias) pairs added to the raw logits before penalties' result is
      sampled (OpenAI's semantics: -100..100; -100 in effect bans a token, +100 forces it);
      token ids are checked against the vocabulary by the engine. `create` takes a mapping.
    - `structured`: constrain the output to a grammar (JSON schema, regex, choice, EBNF; see
      `StructuredOutput`): the sampler masks every token the grammar does not allow next.
    - `scaled_logprobs`: report log-probs of the temperature-scaled distribution
      `log_softmax(logits / temperature)` (the one sampled from, before top-k / top-p / min-p
      truncation: RL's rollout log-probs, as Miles defines them) instead of the raw model
      distribution. Greedy rows report raw log-probs either way.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    scaled_logprobs: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        self._validate_length()
        self._validate_filters()
        self._validate_penalties()
        self._validate_stop()
        self._validate_reporting()

    @classmethod
    def create(
        cls,
        *,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: int | Sequence[int] | None = None,
        logit_bias: Mapping[int, float] | Sequence[Sequence[float]] | None = None,
        structured: StructuredOutput | Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> SamplingParams:
        """Build from API-style arguments: `stop` may be a str or a list, `stop_token_ids` an int
        or a list, `logit_bias` a mapping token id -> bias or (id, bias) pairs, `structured` a
        `StructuredOutput` or its fields as a mapping; None means none. Every other keyword is
        passed through unchanged."""
        if isinstance(structured, Mapping):
            structured = StructuredOutput(**structured)
        return cls(stop=_normalise_stop(stop), stop_token_ids=_normalise_stop_ids(stop_token_ids),
                   logit_bias=_normalise_bias(logit_bias), structured=structured, **kwargs)

    @property
    def is_greedy(self) -> bool:
        """True when decoding is deterministic argmax (temperature 0 or top-k 1)."""
        return self.temperature == 0 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        """Whether a repetition, frequency or presence penalty is set: only such a request's
        sampling reads its penalty state (the runner keeps that state for them alone)."""
        return (self.repetition_penalty != 1 or self.frequency_penalty != 0
                or self.presence_penalty != 0)

    def _validate_length(self) -> None:
        _require(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", self.max_tokens,
                 "max_tokens >= 1")

    def _validate_filters(self) -> None:
        t, p, k, m = self.temperature, self.top_p, self.top_k, self.min_p
        _require(_is_real(t) and t >= 0, "temperature", t, "finite temperature >= 0 (0 = greedy)")
        _require(_is_real(p) and 0 < p <= 1, "top_p", p, "0 < top_p <= 1")
        _require(_is_int(k) and (k == -1 or k >= 1), "top_k", k, "top_k == -1 (off) or top_k >= 1")
        _require(_is_real(m) and 0 <= m <= 1, "min_p", m, "0 <= min_p <= 1")

    def _validate_penalties(self) -> None:
        rep = self.repetition_penalty
        _require(_is_real(rep) and rep > 0, "repetition_penalty", rep,
                 "finite repetition_penalty > 0")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _require(_is_real(value) and -2 <= value <= 2, name, value, f"-2 <= {name} <= 2")

    def _validate_stop(self) -> None:
        stop, ids = self.stop, self.stop_token_ids
        stop_ok = isinstance(stop, tuple) and all(isinstance(s, str) and s for s in stop)
        _require(stop_ok, "stop", stop,
                 "a tuple of non-empty str (use SamplingParams.create for a str or list)")
        ids_ok = isinstance(ids, tuple) and all(_is_int(i) and i >= 0 for i in ids)
        _require(ids_ok, "stop_token_ids", ids,
                 "a tuple of int >= 0 (use SamplingParams.create for a list)")

    def _validate_reporting(self) -> None:
        lp, seed = self.logprobs, self.seed
        _require(
            lp is None or (_is_int(lp) and 0 <= lp <= MAX_LOGPROBS),
            "logprobs",
            lp,
            f"None or 0 <= logprobs <= {MAX_LOGPROBS}",
        )
        plp = self.prompt_logprobs
        _require(plp is None or (_is_int(plp) and 0 <= plp <= MAX_LOGPROBS), "prompt_logprobs",
                 plp, f"None or 0 <= prompt_logprobs <= {MAX_LOGPROBS}")
        _require(seed is None or (_is_int(seed) and 0 <= seed <= MAX_SEED), "seed", seed,
                 "None or 0 <= seed < 2**63")
        bias = self.logit_bias
        bias_ok = isinstance(bias, tuple) and all(
            isinstance(p, tuple) and len(p) == 2 and _is_int(p[0]) and p[0] >= 0
            and _is_real(p[1]) and -100 <= p[1] <= 100 for p in bias)
        _require(bias_ok and len({p[0] for p in bias}) == len(bias), "logit_bias", bias,
                 "distinct token ids >= 0 with biases in [-100, 100]")
        _require(self.structured is None or isinstance(self.structured, StructuredOutput),
                 "structured", self.structured, "None or a StructuredOutput")
        for name in ("ignore_eos", "skip_special_tokens", "scaled_logprobs"):
            value = getattr(self, name)
            _require(isinstance(value, bool), name, value, "True or False")


def _normalise_stop(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    return tuple(stop)


def _normalise_bias(bias: Mapping[int, float] | Sequence[Sequence[float]] | None
                    ) -> tuple[tuple[int, float], ...]:
    if bias is None:
        return ()
    pairs = bias.items() if isinstance(bias, Mapping) else bias
    return tuple((p[0], p[1]) for p in pairs)  # type: ignore[misc]


def _normalise_stop_ids(ids: int | Sequence[int] | None) -> tuple[int, ...]:
    if ids is None:
        return ()
    if isinstance(ids, int):
        return (ids,)
    return tuple(ids)
