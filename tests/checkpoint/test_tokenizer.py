"""Tests for dsv4.checkpoint.tokenizer.build_tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from dsv4.checkpoint.tokenizer import (
    ASSISTANT_TOKEN,
    BOS_TOKEN,
    EOS_TOKEN,
    MAX_TOKENIZER_VOCAB,
    USER_TOKEN,
    build_tokenizer,
)

MODEL_VOCAB = 129280  # DeepSeek-V3-sized model vocab; the tokenizer is capped well below it.

PY_SNIPPET = '''def attention(q, k, v, *, scale: float = 0.125):
    """Softmax attention."""
    s = (q @ k.transpose(-1, -2)) * scale\t# [b, h, s, s]
    return s.softmax(dim=-1) @ v

if __name__ == "__main__":
    print({"x": [1, 2, 3]}, end="\\n\\n")
'''
UNICODE_TEXT = "  Grüße, 世界! Привет мир — café naïve ½ 🚀🤖\r\n\tدرود  \u200b end "


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    out = tmp_path_factory.mktemp("tok")
    n = build_tokenizer(out, MODEL_VOCAB)
    return out, n


@pytest.fixture(scope="module")
def tok(built: tuple[Path, int]) -> Tokenizer:
    return Tokenizer.from_file(str(built[0] / "tokenizer.json"))


def test_files_written(built: tuple[Path, int]) -> None:
    out, n = built
    assert (out / "tokenizer.json").is_file()
    cfg = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert cfg["bos_token"] == BOS_TOKEN
    assert cfg["eos_token"] == EOS_TOKEN
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert cfg["add_bos_token"] is True
    assert isinstance(cfg["model_max_length"], int) and cfg["model_max_length"] > 0
    assert USER_TOKEN in cfg["chat_template"] and ASSISTANT_TOKEN in cfg["chat_template"]
    assert n == MAX_TOKENIZER_VOCAB


def test_deterministic(built: tuple[Path, int], tmp_path: Path) -> None:
    out, n = built
    assert build_tokenizer(tmp_path, MODEL_VOCAB) == n
    assert (tmp_path / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()
    assert ((tmp_path / "tokenizer_config.json").read_bytes()
            == (out / "tokenizer_config.json").read_bytes())


def test_special_token_ids(tok: Tokenizer) -> None:
    assert tok.token_to_id(BOS_TOKEN) == 0
    assert tok.token_to_id(EOS_TOKEN) == 1
    assert tok.token_to_id(USER_TOKEN) == 2
    assert tok.token_to_id(ASSISTANT_TOKEN) == 3
    # Special tokens in text are matched whole, and bos is prepended by default.
    ids = tok.encode(f"{USER_TOKEN}hi{ASSISTANT_TOKEN}").ids
    assert ids[:2] == [0, 2] and ids[-1] == 3
    assert tok.encode("x").ids[0] == 0
    assert tok.encode("x", add_special_tokens=False).ids[0] != 0


@pytest.mark.parametrize("text", [PY_SNIPPET, UNICODE_TEXT, ""], ids=["python", "unicode", "empty"])
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids, skip_special_tokens=False) == text
    with_bos = tok.encode(text).ids
    assert with_bos[0] == 0
    assert tok.decode(with_bos, skip_special_tokens=True) == text


def test_compresses_code(tok: Tokenizer) -> None:
    # Trained merges should make Python source much shorter than its byte length.
    n = len(tok.encode(PY_SNIPPET, add_special_tokens=False).ids)
    assert n < len(PY_SNIPPET.encode()) / 2


@pytest.mark.parametrize("vocab_size", [300, 1000])
def test_vocab_not_larger_than_requested(tmp_path: Path, vocab_size: int) -> None:
    n = build_tokenizer(tmp_path, vocab_size)
    assert n <= vocab_size
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == n
    assert max(tok.get_vocab().values()) < vocab_size
    assert tok.decode(tok.encode(UNICODE_TEXT).ids, skip_special_tokens=True) == UNICODE_TEXT


def test_seed_text_adds_merges(tmp_path: Path, tok: Tokenizer) -> None:
    word = " zyxwvutqqq"  # not in the stdlib corpus
    assert len(tok.encode(word, add_special_tokens=False).ids) > 1
    build_tokenizer(tmp_path, MODEL_VOCAB, seed_text=word * 2000)
    seeded_tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert len(seeded_tok.encode(word, add_special_tokens=False).ids) == 1


@pytest.mark.parametrize("vocab_size", [0, 256, 299])
def test_too_small_vocab_raises(tmp_path: Path, vocab_size: int) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(tmp_path, vocab_size)
    assert not (tmp_path / "tokenizer.json").exists()


def test_loads_with_transformers(built: tuple[Path, int]) -> None:
    transformers = pytest.importorskip("transformers")
    out, n = built

    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    assert len(fast) == n
    ids = fast(PY_SNIPPET)["input_ids"]
    assert ids[0] == 0 and ids.count(0) == 1
    assert fast.decode(ids, skip_special_tokens=True,
                       clean_up_tokenization_spaces=False) == PY_SNIPPET

    # Loading the directory also picks up tokenizer_config.json (bos/eos, chat template).
    auto = transformers.AutoTokenizer.from_pretrained(str(out))
    assert auto.bos_token_id == 0 and auto.eos_token_id == 1
    assert auto.decode(auto(UNICODE_TEXT)["input_ids"], skip_special_tokens=True) == UNICODE_TEXT
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "2+2?"},
    ]
    prompt = auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        f"{BOS_TOKEN}Be brief."
        f"{USER_TOKEN}hi{ASSISTANT_TOKEN}hello{EOS_TOKEN}"
        f"{USER_TOKEN}2+2?{ASSISTANT_TOKEN}"
    )
    prompt_ids = auto(prompt, add_special_tokens=False)["input_ids"]
    assert prompt_ids[0] == 0 and prompt_ids.count(0) == 1
    assert prompt_ids[-1] == 3
