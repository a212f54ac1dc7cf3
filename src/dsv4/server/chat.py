"""POST /v1/chat/completions: OpenAI chat messages -> assistant messages (or a chunk stream).

Owns the chat request -> GenerationJob translation and the chat response / chunk formatting. The
prompt is the checkpoint's chat template rendered with the messages (`chat_template.py`).
`logprobs: true` with `top_logprobs: k` ->
`{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`. `return_routed_experts` /
`return_indexer_topk`: routing.py (rows count the rendered prompt's tokens). Without `max_tokens` /
`max_completion_tokens` a choice may use the rest of the context (and of the KV cache). Streams
open every choice with a `{"role": "assistant", "content": ""}` delta, as OpenAI's do. Tools,
tool_choice and thinking mode: `chat_tools.py` (what is rendered, constrained and parsed) and
`chat_output.py` (reasoning / content / tool calls of a choice, whole or streamed); a choice whose
text ends in a parsed tool-call block finishes with "tool_calls".

Test: `pytest tests/server/test_openai_client.py`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from dsv4.server.chat_output import ChoiceParser, parse_choice
from dsv4.server.chat_tools import ChatMode
from dsv4.server.errors import APIError, bad_request, error_body
from dsv4.server.generation import ClientGone, GenerationJob, build_params
from dsv4.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    ChoiceLogprobs,
    DeltaMessage,
    DeltaToolCall,
    TokenLogprob,
    ToolCall,
    TopLogprob,
)
from dsv4.server.routing import requested_routing
from dsv4.server.state import SSE_DONE, JobStreamingResponse, ServerState, sse
from dsv4.server.tokenizer import ServerTokenizer


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest,
                                 request: Request) -> Response:
    state.check_model(body.model)
    _check_supported(body)
    mode = ChatMode.of(body)
    routing = requested_routing(body, state.config.enable_return_routing)
    text = state.template.render(body.messages, body.add_generation_prompt,
                                 body.chat_template_kwargs, mode.tools)
    prompt = state.tokenizer.encode(text, add_special_tokens=False)
    job = state.start_job("chatcmpl", [prompt],
                          build_params(body, _max_tokens(state, body, len(prompt)),
                                       _num_logprobs(body), mode=mode), routing)
    streaming = False
    try:
        await job.wait_accepted(request.is_disconnected)
        if body.stream:
            streaming = True
            return JobStreamingResponse(_stream(state, job, body, mode),
                                        lambda: state.end_job(job))
        await job.collect(request.is_disconnected)
        return JSONResponse(_response(state, job, body, mode).model_dump())
    except ClientGone:
        return Response(status_code=499)
    finally:
        if not streaming:
            state.end_job(job)


def _check_supported(body: ChatCompletionRequest) -> None:
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")


def _max_tokens(state: ServerState, body: ChatCompletionRequest, prompt_len: int) -> int:
    requested = (body.max_completion_tokens if body.max_completion_tokens is not None
                 else body.max_tokens)
    if requested is not None:
        return requested
    info = state.model_info
    return max(1, min(info.context_length, info.max_total_tokens) - prompt_len)


def _num_logprobs(body: ChatCompletionRequest) -> int | None:
    return (body.top_logprobs or 0) if body.logprobs else None


def _token_logprobs(tok: ServerTokenizer, ids: list[int], lps: list[float],
                    tops: list[list[tuple[int, float]]]) -> ChoiceLogprobs:
    content = []
    for i, (t, lp) in enumerate(zip(ids, lps, strict=True)):
        alts = [TopLogprob(token=tok.token_str(a), logprob=b, bytes=list(tok.token_bytes(a)))
                for a, b in (tops[i] if i < len(tops) else [])]
        content.append(TokenLogprob(token=tok.token_str(t), logprob=lp,
                                    bytes=list(tok.token_bytes(t)), top_logprobs=alts))
    return ChoiceLogprobs(content=content)


def _response(state: ServerState, job: GenerationJob, body: ChatCompletionRequest,
              mode: ChatMode) -> ChatCompletionResponse:
    choices = []
    for c in job.choices:
        logprobs = (_token_logprobs(state.tokenizer, c.token_ids, c.logprobs, c.top_logprobs)
                    if body.logprobs else None)
        reasoning, content, calls = parse_choice(c.text, mode.thinking, mode.names)
        message = AssistantMessage(content=content if content or not calls else None,
                                   reasoning_content=reasoning if mode.thinking else None,
                                   tool_calls=[ToolCall(**t) for t in calls] or None)
        choices.append(ChatChoice(index=c.index, message=message, logprobs=logprobs,
                                  finish_reason="tool_calls" if calls else c.finish_reason,
                                  **c.routing_fields(job.routing)))
    return ChatCompletionResponse(id=job.id, created=int(time.time()),
                                  model=state.config.served_model_name, choices=choices,
                                  usage=job.usage())


async def _stream(state: ServerState, job: GenerationJob, body: ChatCompletionRequest,
                  mode: ChatMode) -> AsyncIterator[str]:
    created, model = int(time.time()), state.config.served_model_name
    parsers = {c.index: ChoiceParser(mode.thinking, mode.names) for c in job.choices}

    def chunk(choices: list[ChatStreamChoice]) -> str:
        return sse(ChatCompletionChunk(id=job.id, created=created, model=model, choices=choices))

    for c in job.choices:
        yield chunk([ChatStreamChoice(index=c.index,
                                      delta=DeltaMessage(role="assistant", content=""))])
    try:
        async for choice, delta in job.deltas():
            logprobs = (_token_logprobs(state.tokenizer, delta.token_ids, delta.logprobs,
                                        delta.top_logprobs)
                        if body.logprobs and delta.token_ids else None)
            parser = parsers[choice.index]
            reasoning, content = parser.feed(delta.text)
            calls: list[dict[str, Any]] = []
            finish = delta.finish_reason
            if finish is not None:
                more_reasoning, more, calls = parser.finish()
                reasoning, content = reasoning + more_reasoning, content + more
                finish = "tool_calls" if calls else finish
            if reasoning or content or calls or finish or logprobs is not None:
                tool_deltas = [DeltaToolCall(index=i, **t) for i, t in enumerate(calls)]
                yield chunk([ChatStreamChoice(
                    index=choice.index,
                    delta=DeltaMessage(content=content or None,
                                       reasoning_content=reasoning or None,
                                       tool_calls=tool_deltas or None),
                    logprobs=logprobs, finish_reason=finish)])
    except APIError as e:
        yield sse(error_body(e.status, e.message, e.param, e.code))
    else:
        if body.stream_options is not None and body.stream_options.include_usage:
            yield sse(ChatCompletionChunk(id=job.id, created=created, model=model, choices=[],
                                          usage=job.usage()))
    yield SSE_DONE
