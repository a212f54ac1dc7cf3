"""Structured output: grammars compiled with xgrammar, one matcher per request, token bitmasks.

`Grammars` belongs to an engine that has a tokenizer (`LLM`, the server's engine process). It
compiles a request's `StructuredOutput` once (an LRU of compiled grammars keyed by kind and spec,
on top of xgrammar's own cache) and hands each request a fresh `GrammarMatcher`. Per step the
runner asks `token_bitmask` for the rows of its sampling batch ([B, ceil(V / 32)] int32, bit v of
row b set = token v allowed; rows without a grammar allow everything) and the sampler masks the
disallowed logits to -inf (`apply_token_bitmask`) after penalties and logit_bias, so the
mask applies to greedy and sampled rows alike and never depends on the other rows. The engine
advances a request's matcher with each token it appends; once the grammar is complete only the
stop tokens (eos) are allowed, and a request whose matcher terminated finishes with "stop".

Under speculative decoding a request's verify pass scores its pending token and its drafts
d_1..d_N at once, and row i needs the grammar's state after d_1..d_i: `draft_token_bitmask` walks
each matcher tentatively along the request's drafts, fills one row per position, and rolls the
matcher back to the request's committed tokens (xgrammar's rollback is unlimited). The walk stops
at the first draft the grammar rejects (or after one that terminates it); the rows after it
repeat the last state's mask. A rejected draft is masked out of the row before it, so `verify`
rejects it and the rows after it emit nothing; the tokens after a terminating draft are dropped
when the request finishes on it. The engine then advances the matcher by the emitted tokens
exactly as without speculation.

Off the engine's critical path: `prepare(spec)` parses and validates the spec at once (a spec that
does not parse raises ValueError naming the field, so a bad request is refused when it arrives)
and builds its token-mask tables (the expensive part, proportional to vocabulary x grammar) on a
worker thread; the engine keeps the request out of the scheduler until that future is done, and
steps the other requests meanwhile. A cached spec is ready at once.

JSON schemas compile without free whitespace (`any_whitespace=False`: compact JSON, so a weak
model cannot fill its budget with spaces) and in xgrammar's strict mode (no properties or items
beyond the schema's). xgrammar is imported on first use: an engine that never sees a structured
request does not load it.

Test: `pytest tests/engine/test_grammar.py`.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from dsv4.engine.sampling_params import StructuredOutput
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)

CACHE_SIZE = 256
"""Compiled grammars kept (least recently used dropped first)."""


class Grammars:
    """Compiles structured-output specs for one tokenizer; see the module docstring."""

    def __init__(self, tokenizer_file: str | Path, vocab_size: int,
                 stop_token_ids: list[int]) -> None:
        self.tokenizer_file, self.vocab_size = Path(tokenizer_file), vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler: Any = None
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsv4-grammar")

    def prepare(self, spec: StructuredOutput) -> Future[Any]:
        """Validate `spec` now (ValueError naming the field) and compile it on the worker thread:
        a future of the compiled grammar, done at once when `spec` is cached."""
        key = (spec.kind, spec.spec)
        with self._lock:
            cached = self._compiled.get(key)
            if cached is not None:
                self._compiled.move_to_end(key)
        if cached is not None:
            done: Future[Any] = Future()
            done.set_result(cached)
            return done
        try:
            grammar = parse_grammar(spec)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"structured.spec does not compile as {spec.kind}: {e}; allowed: a "
                             f"valid {spec.kind.replace('_', ' ')}") from e
        compiler = self._get_compiler()
        return self._pool.submit(self._compile, key, compiler, grammar)

    def _compile(self, key: tuple[str, str], compiler: Any, grammar: Any) -> Any:
        compiled = compiler.compile_grammar(grammar)
        with self._lock:
            self._compiled[key] = compiled
            if len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return compiled

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr
            vocab, kind = encoded_vocab(self.tokenizer_file)
            info = xgr.TokenizerInfo(vocab, getattr(xgr.VocabType, kind),
                                     vocab_size=self.vocab_size,
                                     stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info)
            logger.info("structured output: xgrammar, %s vocabulary of %d",
                        info.vocab_type.name, self.vocab_size)
        return self._compiler


def parse_grammar(spec: StructuredOutput) -> Any:
    """`spec` parsed into an `xgrammar.Grammar` (cheap; raises on an invalid spec): JSON schemas
    compact and strict, json_object any object (OpenAI's, not any JSON value)."""
    import xgrammar as xgr
    if spec.kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False,
                                            strict_mode=False)
    if spec.kind == "json_schema":
        return xgr.Grammar.from_json_schema(spec.spec, any_whitespace=False, strict_mode=True)
    if spec.kind in ("regex", "choice"):
        return xgr.Grammar.from_regex(spec.spec if spec.kind == "regex"
                                      else choice_regex(spec.spec))
    return xgr.Grammar.from_ebnf(spec.spec)


def new_matcher(compiled: Any) -> Any:
    """A fresh matcher (per-request state) of a compiled grammar. The pinned xgrammar keeps an
    unlimited rollback history (its `max_rollback_tokens` is deprecated), which
    `draft_token_bitmask` relies on."""
    import xgrammar as xgr
    return xgr.GrammarMatcher(compiled)


def encoded_vocab(tokenizer_file: Path) -> tuple[list[str], str]:
    """A tokenizer.json's tokens by id as stored (byte-level BPE: GPT-2's byte-to-unicode text)
    with added tokens, "" for unused ids, and xgrammar's name of the encoding: BYTE_LEVEL (a
    ByteLevel decoder), BYTE_FALLBACK (a ByteFallback step, <0xNN> tokens) or RAW."""
    spec = json.loads(Path(tokenizer_file).read_text())
    ids = dict(spec["model"]["vocab"])
    ids.update({t["content"]: t["id"] for t in spec.get("added_tokens", [])})
    vocab = [""] * (max(ids.values()) + 1)
    for token, i in ids.items():
        vocab[i] = token
    decoders = json.dumps(spec.get("decoder"))
    kind = ("BYTE_LEVEL" if '"ByteLevel"' in decoders else
            "BYTE_FALLBACK" if '"ByteFallback"' in decoders else "RAW")
    return vocab, kind


def choice_regex(choices_json: str) -> str:
    """A regex matching exactly one of the strings of a JSON list (the "choice" kind)."""
    try:
        choices = json.loads(choices_json)
    except json.JSONDecodeError as e:
        raise ValueError(f"choices must be a JSON list of strings: {e}") from e
    if (not isinstance(choices, list) or not choices
            or not all(isinstance(c, str) and c for c in choices)):
        raise ValueError("choices must be a non-empty list of non-empty strings")
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


def apply_token_bitmask(logits: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """`logits` [B, V] with -inf wherever bit v of row b of `bits` [B, ceil(V / 32)] int32 is 0
    (xgrammar's layout: token v is bit v % 32 of word v // 32); a new tensor."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :logits.shape[-1]]
    return logits.masked_fill(~allowed, float("-inf"))


def token_bitmask(matchers: list[Any], vocab_size: int) -> torch.Tensor | None:
    """[B, ceil(V / 32)] int32 allowed-token bits of each row's matcher (None: all allowed), on the
    host; None when no row has a matcher."""
    if all(m is None for m in matchers):
        return None
    import xgrammar as xgr
    bits = xgr.allocate_token_bitmask(len(matchers), vocab_size)   # all allowed (-1)
    for row, m in enumerate(matchers):
        if m is not None:
            m.fill_next_token_bitmask(bits, row)
    return bits


def draft_token_bitmask(matchers: list[Any], drafts: list[list[int]],
                        vocab_size: int) -> torch.Tensor | None:
    """[R, ceil(V / 32)] int32 allowed-token bits of a verify pass's logit rows, on the host; None
    when no request has a matcher. Request b owns `len(drafts[b]) + 1` consecutive rows: row i
    is its grammar's state after its committed tokens and its drafts d_1..d_i (module
    docstring). Every matcher is left as it was."""
    if all(m is None for m in matchers):
        return None
    import xgrammar as xgr
    bits = xgr.allocate_token_bitmask(sum(len(d) + 1 for d in drafts), vocab_size)
    row = 0
    for m, ds in zip(matchers, drafts, strict=True):
        if m is not None:
            m.fill_next_token_bitmask(bits, row)
            walked, last = 0, row           # drafts accepted; the last row filled
            for d in ds:
                if not m.accept_token(d):
                    break
                walked += 1
                if m.is_terminated():       # no next-token mask, and every token refused
                    break
                last = row + walked
                m.fill_next_token_bitmask(bits, last)
            bits[last + 1:row + len(ds) + 1] = bits[last]
            if walked:
                m.rollback(walked)
        row += len(ds) + 1
    return bits


def advance_grammar(matcher: Any, tok: int, rid: str) -> str | None:
    """Feed `tok` to request `rid`'s grammar matcher: "stop" once the grammar is complete (only
    eos is allowed then; with ignore_eos that would never end) or if it rejects the token (the
    mask allows only accepted tokens, so that is a bug: logged, the request ends cleanly); else
    None."""
    if not matcher.accept_token(tok):
        logger.error("request %s: its grammar rejected token %d; finishing it", rid, tok)
        return "stop"
    return "stop" if matcher.is_terminated() else None
