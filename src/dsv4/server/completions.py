"""POST /v1/completions: prompts (text or token ids, one or a batch) -> OpenAI text completions.

Owns the request -> GenerationJob translation for completions and the response / stream-chunk
formatting: `echo` (the prompt text is prepended to the choice text, and sent in a choice's first
chunk when streaming), `logprobs: k` -> `{"tokens", "token_logprobs", "top_logprobs",
"text_offset"}` (offsets count characters of the returned text), `stream_options.include_usage` (a
last chunk with `choices: []`), `return_routed_experts` / `return_indexer_topk` (routing.py). The
default `max_tokens` is 16, as OpenAI's. `echo` with `logprobs: k` also scores the prompt (the
engine's `prompt_logprobs`: the prompt's tokens lead the logprobs lists, the first with null
log-prob and top-k; the request then computes its whole prompt); `max_tokens: 0` with `echo`
(not streamed) returns the prompt alone, as loglikelihood evaluators ask.

Test: `pytest tests/server/test_openai_client.py`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from dsv4.server.engine_client import ChoiceDelta
from dsv4.server.errors import APIError, bad_request, error_body
from dsv4.server.generation import ChoiceOutput, ClientGone, GenerationJob, build_params
from dsv4.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from dsv4.server.routing import requested_routing
from dsv4.server.state import SSE_DONE, JobStreamingResponse, ServerState, sse
from dsv4.server.tokenizer import ServerTokenizer

DEFAULT_MAX_TOKENS = 16


async def create_completion(state: ServerState, body: CompletionRequest,
                            request: Request) -> Response:
    state.check_model(body.model)
    _check_supported(body)
    routing = requested_routing(body, state.config.enable_return_routing)
    prompts, texts = _prompts(state.tokenizer, body.prompt)
    max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    score_only = max_tokens == 0 and body.echo          # the engine samples one, dropped here
    scored = body.logprobs if body.echo else None       # prompt log-probs (echo + logprobs)
    job = state.start_job("cmpl", prompts,
                          build_params(body, max(1, max_tokens) if score_only else max_tokens,
                                       body.logprobs, scored), routing)
    streaming = False
    try:
        await job.wait_accepted(request.is_disconnected)
        if body.stream:
            streaming = True
            return JobStreamingResponse(_stream(state, job, body, texts, prompts),
                                        lambda: state.end_job(job))
        await job.collect(request.is_disconnected)
        if score_only:
            for c in job.choices:
                c.token_ids, c.logprobs, c.top_logprobs, c.text = [], [], [], ""
                c.finish_reason = "length"
        return JSONResponse(_response(state, job, body, texts, prompts).model_dump())
    except ClientGone:
        return Response(status_code=499)
    finally:
        if not streaming:
            state.end_job(job)


def _check_supported(body: CompletionRequest) -> None:
    if body.suffix:
        raise bad_request("suffix is not supported; allowed: null", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request(f"best_of={body.best_of} is not supported; allowed: null or equal to n",
                          "best_of")
    if body.max_tokens == 0 and not body.echo:
        raise bad_request("max_tokens=0 is invalid without echo; allowed: max_tokens >= 1, or 0 "
                          "with echo (score the prompt)", "max_tokens")
    if body.max_tokens == 0 and body.stream:
        raise bad_request("max_tokens=0 with stream is not supported; allowed: stream=false",
                          "stream")


def _prompts(tokenizer: ServerTokenizer, prompt: str | list[str] | list[int] | list[list[int]]
             ) -> tuple[list[list[int]], list[str]]:
    """(token ids, text) of every prompt in the body."""
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)], [prompt]
    if not prompt:
        raise bad_request("prompt is an empty list; "
                          "allowed: a string, a list of strings or of token ids", "prompt")
    if isinstance(prompt[0], int):
        ids = [t for t in prompt if isinstance(t, int)]
        return [ids], [tokenizer.decode(ids)]
    if isinstance(prompt[0], str):
        strs = [p for p in prompt if isinstance(p, str)]
        return [tokenizer.encode(p) for p in strs], strs
    lists = [p for p in prompt if isinstance(p, list)]
    return lists, [tokenizer.decode(p) for p in lists]


def _response(state: ServerState, job: GenerationJob, body: CompletionRequest,
              texts: list[str], prompts: list[list[int]]) -> CompletionResponse:
    choices = []
    for c in job.choices:
        prefix = texts[c.index // job.n] if body.echo else ""
        logprobs = _logprobs(state.tokenizer, c.token_ids, c.logprobs, c.top_logprobs, len(prefix),
                             body.logprobs)
        if logprobs is not None and c.prompt_logprobs is not None:
            logprobs = _with_prompt(state.tokenizer, prompts[c.index // job.n], c, logprobs)
        choices.append(CompletionChoice(index=c.index, text=prefix + c.text, logprobs=logprobs,
                                        finish_reason=c.finish_reason,
                                        **c.routing_fields(job.routing)))
    return CompletionResponse(id=job.id, created=int(time.time()),
                              model=state.config.served_model_name, choices=choices,
                              usage=job.usage())


def _logprobs(tok: ServerTokenizer, ids: list[int], lps: list[float],
              tops: list[list[tuple[int, float]]], offset: int,
              k: int | None) -> CompletionLogprobs | None:
    if k is None:
        return None
    out = CompletionLogprobs()
    for i, (t, lp) in enumerate(zip(ids, lps, strict=True)):
        token = tok.token_str(t)
        out.tokens.append(token)
        out.token_logprobs.append(lp)
        out.top_logprobs.append({tok.token_str(a): b for a, b in tops[i]} if i < len(tops) else {})
        out.text_offset.append(offset)
        offset += len(token)
    return out


def _with_prompt(tok: ServerTokenizer, ids: list[int], c: ChoiceOutput,
                 completion: CompletionLogprobs) -> CompletionLogprobs:
    """The prompt's tokens and log-probs (None for the first), then the completion's (its offsets
    already count the echoed prompt text)."""
    out = CompletionLogprobs()
    tops = c.prompt_top_logprobs or []
    offset = 0
    for i, (t, lp) in enumerate(zip(ids, c.prompt_logprobs or [], strict=True)):
        token = tok.token_str(t)
        out.tokens.append(token)
        out.token_logprobs.append(lp)
        out.top_logprobs.append(None if i == 0 else {tok.token_str(a): b for a, b in tops[i]})
        out.text_offset.append(offset)
        offset += len(token)
    out.tokens += completion.tokens
    out.token_logprobs += completion.token_logprobs
    out.top_logprobs += completion.top_logprobs
    out.text_offset += completion.text_offset
    return out


async def _stream(state: ServerState, job: GenerationJob, body: CompletionRequest,
                  texts: list[str], prompts: list[list[int]]) -> AsyncIterator[str]:
    created, model = int(time.time()), state.config.served_model_name
    offsets: dict[int, int] = {}    # choice index -> text_offset of its next token
    try:
        async for choice, delta in job.deltas():
            chunk = _chunk(state.tokenizer, choice, delta, body, texts[choice.index // job.n],
                           offsets, prompts[choice.index // job.n])
            if chunk is not None:
                yield sse(CompletionResponse(id=job.id, created=created, model=model,
                                             choices=[chunk]))
    except APIError as e:
        yield sse(error_body(e.status, e.message, e.param, e.code))
    else:
        if body.stream_options is not None and body.stream_options.include_usage:
            yield sse(CompletionResponse(id=job.id, created=created, model=model, choices=[],
                                         usage=job.usage()))
    yield SSE_DONE


def _chunk(tok: ServerTokenizer, choice: ChoiceOutput, delta: ChoiceDelta,
           body: CompletionRequest, prompt: str, offsets: dict[int, int],
           prompt_ids: list[int]) -> CompletionChoice | None:
    first = choice.index not in offsets
    prefix = prompt if body.echo and first else ""
    start = offsets.get(choice.index, len(prefix))
    logprobs = _logprobs(tok, delta.token_ids, delta.logprobs, delta.top_logprobs, start,
                         body.logprobs)
    offsets[choice.index] = (start + sum(len(t) for t in logprobs.tokens) if logprobs is not None
                             else start)
    if first and logprobs is not None and delta.prompt_logprobs is not None:
        logprobs = _with_prompt(tok, prompt_ids, choice, logprobs)
    has_tokens = logprobs is not None and bool(delta.token_ids)
    if not (prefix or delta.text or delta.finish_reason or has_tokens):
        return None
    return CompletionChoice(index=choice.index, text=prefix + delta.text, logprobs=logprobs,
                            finish_reason=delta.finish_reason)
