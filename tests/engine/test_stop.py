"""Tests for dsv4.engine.stop: stop strings across token boundaries, hold-back while
streaming, and exact incremental detokenization of multi-byte unicode with a real
byte-level BPE tokenizer."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from dsv4.checkpoint.tokenizer import BOS_TOKEN, build_tokenizer
from dsv4.engine.sampling_params import SamplingParams
from dsv4.engine.stop import IncrementalDetokenizer, OutputText, StopChecker

STREAM_TEXT = "The answer is 42. ###STOP### trailing words"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out, 512)
    return Tokenizer.from_file(str(out / "tokenizer.json"))


def _stream(tokenizer: Tokenizer, text: str, stop: tuple[str, ...]) -> tuple[list[str], str, bool]:
    """Generate `text` token by token through detokenizer + checker, like the engine does.

    Returns the safe prefix after every token, the final output and whether it stopped.
    """
    detok, checker = IncrementalDetokenizer(tokenizer), StopChecker(stop)
    safe_history: list[str] = []
    for token_id in tokenizer.encode(text).ids:
        detok.add(token_id)
        safe, stopped = checker.feed(detok.text)
        safe_history.append(safe)
        if stopped:
            return safe_history, safe, True
    safe, stopped = checker.feed(detok.text + detok.flush(), is_final=True)
    return safe_history, safe, stopped


def _num_tokens_spanned(tokenizer: Tokenizer, text: str, stop: str) -> int:
    """How many tokens of `text` (ASCII) overlap the first occurrence of `stop`."""
    ids = tokenizer.encode(text).ids
    ends = [len(tokenizer.decode(ids[: i + 1])) for i in range(len(ids))]
    starts = [0, *ends[:-1]]
    lo = text.index(stop)
    hi = lo + len(stop)
    return sum(1 for s, e in zip(starts, ends, strict=True) if s < hi and e > lo)


# --------------------------------------------------------------------- StopChecker with a tokenizer


@pytest.mark.parametrize("stop", ["er is", "2. #", "ans"])
def test_stop_spanning_tokens_is_found_and_excluded(tokenizer: Tokenizer, stop: str) -> None:
    assert _num_tokens_spanned(tokenizer, STREAM_TEXT, stop) in (2, 3), "stop must span 2-3 tokens"
    history, final, stopped = _stream(tokenizer, STREAM_TEXT, (stop,))
    assert stopped
    assert final == STREAM_TEXT[: STREAM_TEXT.index(stop)]
    assert all(stop not in safe for safe in history)


def test_streaming_holds_back_partial_match(tokenizer: Tokenizer) -> None:
    stop = "###STOP###"
    history, final, stopped = _stream(tokenizer, STREAM_TEXT, (stop,))
    assert stopped and final == "The answer is 42. "
    for before, after in zip(history, history[1:], strict=False):
        assert after.startswith(before), "the safe prefix must only grow"
    assert any(safe == "The answer is 42. " for safe in history[:-1]), \
        "'#...' tail must be held back"
    assert all(not safe.endswith("#") for safe in history)


def test_no_stop_emits_all_text(tokenizer: Tokenizer) -> None:
    _, final, stopped = _stream(tokenizer, STREAM_TEXT, ())
    assert not stopped and final == STREAM_TEXT
    _, final, stopped = _stream(tokenizer, STREAM_TEXT, ("never there",))
    assert not stopped and final == STREAM_TEXT


# --------------------------------------------------------------------------- StopChecker unit


def test_earliest_of_several_stop_strings_wins() -> None:
    checker = StopChecker(("world", "lo w", "hello world!"))
    assert checker.feed("hello world") == ("hel", True)
    assert checker.matched == "lo w"
    assert checker.feed("hello world and more") == ("hel", True), "stopped is final"


def test_earliest_wins_when_found_in_one_feed_late() -> None:
    checker = StopChecker(("zz", "b"))
    assert checker.feed("a") == ("a", False)
    assert checker.feed("a-zz-b") == ("a-", True)
    assert checker.matched == "zz"


def test_hold_back_released_on_mismatch_and_on_final() -> None:
    checker = StopChecker(("###STOP",))
    assert checker.feed("hello #") == ("hello ", False)
    assert checker.feed("hello ##") == ("hello ", False)
    assert checker.feed("hello ## b") == ("hello ## b", False)
    assert checker.feed("hello ## b###ST") == ("hello ## b", False)
    assert checker.feed("hello ## b###STO", is_final=True) == ("hello ## b###STO", False)


def test_hold_back_is_at_most_longest_stop_minus_one() -> None:
    checker = StopChecker(("abcd", "x"))
    assert checker.feed("zzabc") == ("zz", False)
    checker = StopChecker(("aaaa",))
    assert checker.feed("baaa") == ("b", False)
    assert checker.feed("baaab") == ("baaab", False)


def test_stop_at_start_gives_empty_text() -> None:
    assert StopChecker(("\n\n",)).feed("\n\nrest") == ("", True)


def test_empty_stop_string_rejected() -> None:
    with pytest.raises(ValueError, match="stop="):
        StopChecker(("ok", ""))


# --------------------------------------------------------------------------- IncrementalDetokenizer


UNICODE_TEXTS = ["héllo wörld → 日本語 😀",
                 "  Grüße, 世界! Привет — café ½ 🚀🤖\r\n\tدرود \u200b end "]


@pytest.mark.parametrize("text", UNICODE_TEXTS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_decode_matches_full_decode(tokenizer: Tokenizer, text: str,
                                                skip_special_tokens: bool) -> None:
    ids = tokenizer.encode(text).ids  # bos + text
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == expected == detok.text
    assert all("\ufffd" not in d for d in deltas), "no partial characters may be emitted"
    assert "" in deltas[1:-1], "some tokens end mid-character and must emit nothing"
    assert expected == (text if skip_special_tokens else BOS_TOKEN + text)


def test_flush_emits_unfinished_character(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ab日").ids[1:]  # drop bos
    truncated = ids[:-1]  # '日' is 3 bytes; cut its last byte
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.add(i) for i in truncated) == "ab"
    assert detok.flush() == tokenizer.decode(truncated)[2:]
    assert detok.text == tokenizer.decode(truncated)
    assert detok.flush() == ""


def test_output_text_keeps_tokens_up_to_the_stop(tokenizer: Tokenizer) -> None:
    """Several tokens per feed (a step may yield several): the request keeps those up to and
    including the token that completes the stop string, and its text ends before the stop
    string."""
    ids = tokenizer.encode(STREAM_TEXT, add_special_tokens=False).ids
    out = OutputText(tokenizer, SamplingParams(stop=("###STOP###",)))
    kept, fed = 0, 0
    while not out.stopped:
        chunk = ids[fed:fed + 3]
        kept += out.feed(chunk)
        fed += len(chunk)
    assert out.text == "The answer is 42. "
    assert kept == out.num_tokens == _num_tokens_upto(tokenizer, ids, "###STOP###")
    assert kept <= fed and fed - kept < 3


def test_output_text_finish_releases_held_text(tokenizer: Tokenizer) -> None:
    out = OutputText(tokenizer, SamplingParams(stop=("42!",)))
    assert out.feed(tokenizer.encode("answer: 42", add_special_tokens=False).ids) > 0
    assert not out.stopped and out.text == "answer: "       # "42" could still start "42!"
    out.finish()
    assert out.text == "answer: 42"


def _num_tokens_upto(tokenizer: Tokenizer, ids: list[int], stop: str) -> int:
    """Fewest leading tokens whose decoded text contains `stop`."""
    return next(n for n in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:n]))
