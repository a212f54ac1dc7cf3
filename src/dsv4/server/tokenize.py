"""POST /tokenize, POST /detokenize, GET /tokenizer_info: the served model's tokenizer over HTTP,
as vLLM defines these routes (lm-evaluation-harness's `tokenizer_backend=remote` uses them).

    /tokenize      {"prompt": str, "add_special_tokens": true} or {"messages": [...],
                   "add_generation_prompt": true} (the chat template, then the text without added
                   special tokens, exactly as /v1/chat/completions builds its prompt)
                   -> {"count", "max_model_len", "tokens", "token_strs" (with
                   "return_token_strs": true, else null)}
    /detokenize    {"tokens": [int]} -> {"prompt": str}
    /tokenizer_info  the checkpoint's tokenizer_config.json (special tokens, chat template,
                   `tokenizer_class`), with `model_max_length` set to the served context length

Token ids outside the vocabulary and a body with both or neither of prompt / messages are 400s
naming the field.

Test: `pytest tests/server/test_tokenize.py`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastapi.responses import JSONResponse, Response

from dsv4.server.errors import bad_request
from dsv4.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from dsv4.server.state import ServerState


def tokenize(state: ServerState, body: TokenizeRequest) -> Response:
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("exactly one of prompt and messages is required; got "
                          f"{'both' if body.prompt is not None else 'neither'}", "prompt")
    if body.messages is not None:
        text = state.template.render(body.messages, body.add_generation_prompt,
                                     body.chat_template_kwargs)
        ids = state.tokenizer.encode(text, add_special_tokens=False)
    else:
        assert body.prompt is not None
        ids = state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    strs = [state.tokenizer.token_str(t) for t in ids] if body.return_token_strs else None
    return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=state.model_info
                                         .context_length, tokens=ids,
                                         token_strs=strs).model_dump())


def detokenize(state: ServerState, body: DetokenizeRequest) -> Response:
    state.check_model(body.model)
    vocab = state.model_info.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"tokens contains unknown token ids {bad[:5]}; allowed: 0..{vocab - 1}",
                          "tokens")
    return JSONResponse(DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens))
                        .model_dump())


def tokenizer_info(state: ServerState) -> Response:
    path = Path(state.config.model) / "tokenizer_config.json"
    info: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    info["model_max_length"] = state.model_info.context_length
    return JSONResponse(info)
