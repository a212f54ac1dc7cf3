"""Tokenization in the API process: prompts -> token ids, and token ids -> the strings and bytes
that OpenAI logprobs report.

Owns `ServerTokenizer` (a `tokenizers.Tokenizer` read from the checkpoint). Completion prompts are
encoded with special tokens (bos), exactly as `LLM.generate` encodes text, so greedy output through
the server equals the offline API; rendered chat prompts already contain bos and are encoded
without. A token's bytes are exact for byte-level BPE vocabularies (GPT-2's byte<->unicode table,
which DeepSeek tokenizers use), so a token holding half of a UTF-8 character reports its real bytes;
its string is those bytes decoded with replacement. Results are memoised per token id.

Test: `pytest tests/server/test_components.py -k bytes`.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's `bytes_to_unicode`: the printable stand-in of every byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class ServerTokenizer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
        self._byte_level = decoder.get("type") == "ByteLevel"
        self._bytes: dict[int, bytes] = {}

    @staticmethod
    def from_checkpoint(path: str | Path) -> ServerTokenizer:
        file = Path(path) / "tokenizer.json"
        if not file.is_file():
            raise ValueError(f"model={str(path)!r} has no tokenizer.json; "
                             "the server needs one to handle text")
        return ServerTokenizer(Tokenizer.from_file(str(file)))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        cached = self._bytes.get(token_id)
        if cached is None:
            cached = self._bytes[token_id] = self._compute_bytes(token_id)
        return cached

    def token_str(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def _compute_bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        table = _unicode_to_byte()
        if self._byte_level and all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
        return self.decode([token_id]).encode()
