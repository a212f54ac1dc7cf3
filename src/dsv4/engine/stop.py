"""Text-level stop handling for one request: incremental detokenization and stop strings.

The engine deals in token ids; its callers turn them into text here: the API process (one
`OutputText` per choice, server/generation.py) and the offline `LLM` (engine/llm.py) use the same
object, so both stop at the same token with the same text. A stop string that ends the request is
reported back to the engine, which finishes it (`LLMEngine.finish(rid, "stop")`).

Owns two small per-request state machines, and `OutputText`, which runs both over a request's
tokens:

* `IncrementalDetokenizer` turns output token ids into text one token at a time. Its text is
  append-only and never contains a partial UTF-8 character: a byte-level BPE token that ends
  mid-character produces no text until the character completes (the prefix/read offset window of
  vLLM's `detokenize_incrementally` and HF's `TextStreamer`).
* `StopChecker` scans that growing text for stop strings, which may span any number of tokens
  because the match is on text. The stop string itself is excluded from the output (OpenAI/vLLM),
  and while streaming it holds back the trailing characters that could still become the start of
  a stop string.

Invariants: the text fed to a checker only ever grows by appending (which the detokenizer
guarantees); the safe-to-emit prefix a checker returns never shrinks.

Test: `pytest tests/engine/test_stop.py`.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

from dsv4.engine.sampling_params import SamplingParams

_REPLACEMENT_CHAR = "\ufffd"


class StopChecker:
    """Finds the earliest stop string in one request's generated text.

    Feed it the full text so far after every token; it answers how much of the text may be
    streamed now and whether the request has stopped. Scanning is incremental: each call only
    searches the new tail (plus `max(len(stop)) - 1` characters of overlap).
    """

    def __init__(self, stop: tuple[str, ...]) -> None:
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop={stop!r} is invalid; allowed: a tuple of non-empty str")
        self._stop = stop
        self._max_len = max((len(s) for s in stop), default=0)
        self._checked_len = 0  # text[:_checked_len] contains no complete stop string
        self._safe_len = 0
        self._result: str | None = None  # truncated text once stopped
        self._matched: str | None = None

    @property
    def stopped(self) -> bool:
        return self._result is not None

    @property
    def matched(self) -> str | None:
        """The stop string that ended the request (the earliest one), or None."""
        return self._matched

    def feed(self, full_text: str, *, is_final: bool = False) -> tuple[str, bool]:
        """Check the text generated so far.

        `full_text`: all generated text; must extend the text of the previous call. `is_final`:
        generation ended for another reason (eos, length): release held text.

        Returns `(safe_text, stopped)`: `safe_text` is the prefix of `full_text` that may be
        emitted now. Once stopped it is the text before the earliest stop string, and every later
        call returns the same result.
        """
        if self._result is not None:
            return self._result, True
        assert len(full_text) >= self._checked_len, "full_text must extend the previously fed text"
        found = self._find_earliest(full_text)
        if found is not None:
            return self._stop_at(full_text, found), True
        self._checked_len = len(full_text)
        safe_len = (len(full_text) if is_final
                    else len(full_text) - self._partial_match_len(full_text))
        assert safe_len >= self._safe_len, "the safe prefix never shrinks for append-only text"
        self._safe_len = safe_len
        return full_text[:safe_len], False

    def _find_earliest(self, text: str) -> tuple[int, str] | None:
        """`(index, stop string)` of the earliest match starting in the unchecked region."""
        start = max(0, self._checked_len - self._max_len + 1)
        hits = [(i, s) for s in self._stop if (i := text.find(s, start)) >= 0]
        return min(hits, key=lambda hit: hit[0]) if hits else None

    def _stop_at(self, text: str, found: tuple[int, str]) -> str:
        index, matched = found
        assert index >= self._safe_len, "a stop string cannot start inside text already released"
        self._result, self._matched = text[:index], matched
        return self._result

    def _partial_match_len(self, text: str) -> int:
        return partial_prefix_len(text, self._stop)


def partial_prefix_len(text: str, strings: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `strings`: the
    tail a streamer must hold back until the next text shows whether the string follows."""
    longest = max((len(s) for s in strings), default=0)
    for size in range(min(longest - 1, len(text)), 0, -1):
        tail = text[-size:]
        if any(s.startswith(tail) for s in strings):
            return size
    return 0


class IncrementalDetokenizer:
    """Decodes one request's output tokens one at a time into append-only text.

    Each `add` decodes only a short window: the tokens from `prefix_offset` (the start of the
    previously emitted chunk, giving the decoder context for spacing rules) to the end. The new
    text is emitted once it no longer ends in U+FFFD, i.e. once the last token does not stop in the
    middle of a UTF-8 character. `flush` at the end emits any text still held back, so the
    concatenation of all returned pieces equals `tokenizer.decode(all_ids, skip_special_tokens=...)`
    for byte-level BPE tokenizers.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window (already-emitted context)
        self._read_offset = 0  # tokens before this have been emitted as text
        self._text = ""

    @property
    def text(self) -> str:
        """All text emitted so far (append-only; no partial characters)."""
        return self._text

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def add(self, token_id: int) -> str:
        """Append one token; returns the newly completed text (possibly empty)."""
        self._ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """Emit whatever is held back (e.g. a trailing U+FFFD from an unfinished character)."""
        return self._emit(final=True)

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end],
                                      skip_special_tokens=self._skip_special_tokens)

    def _emit(self, *, final: bool) -> str:
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if (len(new_text) <= len(prefix_text)
                or (new_text.endswith(_REPLACEMENT_CHAR) and not final)):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._text += delta
        return delta


class OutputText:
    """One request's output text: incremental detokenisation, then its stop strings.

    `feed(token_ids)` takes the request's next tokens (one step's worth, in order) and returns how
    many of them the request keeps: all of them, or, when a stop string completes inside them, those
    up to and including the token that completed it (the rest are dropped; the request is
    `stopped`). `text` is the text that may be shown now (stop string excluded, possible stop-string
    starts held back); `finish()` releases what is held back once the request ended for another
    reason (eos, length)."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self._detok = IncrementalDetokenizer(tokenizer,
                                             skip_special_tokens=params.skip_special_tokens)
        self._stop = StopChecker(params.stop)
        self.text = ""
        self.num_tokens = 0          # tokens kept so far

    @property
    def stopped(self) -> bool:
        return self._stop.stopped

    @property
    def matched(self) -> str | None:
        """The stop string that ended the output, or None."""
        return self._stop.matched

    def feed(self, token_ids: Sequence[int]) -> int:
        assert not self.stopped, "feeding a request a stop string has ended"
        for i, token_id in enumerate(token_ids):
            self._detok.add(token_id)
            self.num_tokens += 1
            self.text, stopped = self._stop.feed(self._detok.text)
            if stopped:
                return i + 1
        return len(token_ids)

    def finish(self) -> None:
        if not self.stopped:
            self._detok.flush()
            self.text, _ = self._stop.feed(self._detok.text, is_final=True)
