"""The FastAPI app of the API process: routes, API-key check, body-size limit and body parsing.

    GET  /health               200 once the engine has loaded the model; 503 while loading,
                               draining, or dead
    GET  /v1/models            the served model (`random_weights: true` for the generated
                               default model)
    POST /v1/completions       completions.py
    POST /v1/chat/completions  chat.py
    POST /v1/abort             {"request_id": "<id of a running completion>"}: its choices end
                               with "abort"
    POST /tokenize, /detokenize, GET /tokenizer_info
                               the tokenizer over HTTP, as vLLM defines them (tokenize.py)
    GET  /v1/engine_stats      engine state (pools, slots, queue, counters; speculative
                               decoding: `spec_num_steps`, `spec_accept_hist` (verify passes by
                               accepted drafts, N + 1 counts), `spec_draft_tokens`,
                               `spec_accepted_tokens`); `?check_integrity=true` also runs the
                               engine's check_integrity() and reports "ok" or the failure
    POST /flush_cache          drop the prefix-cache entries no request uses (SGLang's name;
                               GET too); returns the stats
    POST /update_weights_from_disk
                               {"model_path": "<checkpoint dir>", "weight_version": label}
                               (SGLang's names, for RL weight sync): the engine loads that
                               checkpoint into the served model between two steps (its tokens
                               labelled `weight_version` in /generate's meta_info) ->
                               {"success": true, "message", "num_tensors", "weight_version": the
                               update count}; 400 (OpenAI error shape, param "model_path") and
                               the served weights unchanged for a missing directory, another
                               architecture or a corrupt / incomplete checkpoint
    GET  /metrics              Prometheus text format (metrics.py)
    POST /generate             SGLang's native generation API (native.py): text or input_ids,
                               sampling_params, return_logprob, stream, the RL options
    POST /abort_request        {"rid": ..., "abort_all": bool}: abort /generate requests (SGLang)
    POST /init_weights_update_group, /update_weights_from_distributed,
         /destroy_weights_update_group, /pause_generation, /continue_generation,
         /release_memory_occupation, /resume_memory_occupation
                               SGLang's weight push from a trainer's process group, generation
                               paused around it, KV memory freed for a colocated trainer
                               (weight_update.py)
    GET  /health_generate      200 once a one-token generation went through (SGLang); 503 if not
    GET  /get_model_info, /get_server_info (/server_info)
                               SGLang's info endpoints (native.py)

`/v1/*`, /generate, /abort_request, /flush_cache and /update_weights_from_disk need
`Authorization: Bearer <key>` when the server has an API key. Bodies are read with a size limit
(413 past it) and parsed strictly into the protocol models (400 naming the field).

Weight updates: the checkpoint must be in the official layout (`dsv4 train export`,
`dsv4.checkpoint.writer`) with the served architecture (storage, e.g. FP8/FP4, may differ; experts
served in checkpoint encoding are re-quantised). Requests in flight are not failed: they recompute
their KV cache with the new weights and continue (their earlier tokens came from the old ones); the
prefix cache is flushed. `weight_version` counts the updates (also in /v1/engine_stats).

Test: `pytest tests/server/test_openai_client.py tests/server/test_errors.py`.
"""

from __future__ import annotations

import dataclasses
import hmac
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError

from dsv4.server.chat import create_chat_completion
from dsv4.server.completions import create_completion
from dsv4.server.errors import APIError, from_validation_error, install_handlers, unavailable
from dsv4.server.native import (
    AbortRequest,
    GenerateRequest,
    abort,
    generate,
    health_generate,
    model_info,
    server_info,
)
from dsv4.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDiskResponse,
)
from dsv4.server.state import ServerState
from dsv4.server.tokenize import (
    DetokenizeRequest,
    TokenizeRequest,
    detokenize,
    tokenize,
    tokenizer_info,
)
from dsv4.server.weight_update import (
    ContinueRequest,
    DestroyGroupRequest,
    InitGroupRequest,
    MemoryRequest,
    PauseRequest,
    UpdateDistributedRequest,
    destroy_group,
    init_group,
    pause,
    release_memory,
    resume,
    resume_memory,
    update_distributed,
)

M = TypeVar("M", bound=BaseModel)
Handler = Callable[..., Awaitable[Response]]
Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[Any]]


class AbortBody(BaseModel):
    request_id: str


def create_app(state: ServerState, lifespan: Lifespan | None = None) -> FastAPI:
    app = FastAPI(title="dsv4", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    install_handlers(app, on_error=state.metrics.on_rejected)
    auth = [Depends(_auth_dependency(state))]
    app.add_api_route("/health", _health(state), methods=["GET"])
    app.add_api_route("/metrics", _metrics(state), methods=["GET"])
    app.add_api_route("/v1/models", _models(state), methods=["GET"], dependencies=auth)
    app.add_api_route("/v1/models/{model_id:path}", _model(state), methods=["GET"],
                      dependencies=auth)
    app.add_api_route("/v1/completions", _generation_route(state, CompletionRequest,
                                                           create_completion),
                      methods=["POST"], dependencies=auth)
    app.add_api_route("/v1/chat/completions", _generation_route(state, ChatCompletionRequest,
                                                                create_chat_completion),
                      methods=["POST"], dependencies=auth)
    app.add_api_route("/v1/abort", _abort(state), methods=["POST"], dependencies=auth)
    app.add_api_route("/tokenize", _tokenize(state), methods=["POST"], dependencies=auth)
    app.add_api_route("/detokenize", _detokenize(state), methods=["POST"], dependencies=auth)
    app.add_api_route("/tokenizer_info", _tokenizer_info(state), methods=["GET"],
                      dependencies=auth)
    app.add_api_route("/v1/engine_stats", _engine_stats(state), methods=["GET"], dependencies=auth)
    app.add_api_route("/flush_cache", _flush_cache(state), methods=["GET", "POST"],
                      dependencies=auth)
    app.add_api_route("/update_weights_from_disk", _update_weights_from_disk(state),
                      methods=["POST"], dependencies=auth)
    # SGLang's native API (native.py)
    app.add_api_route("/generate", _generation_route(state, GenerateRequest, generate),
                      methods=["POST", "PUT"], dependencies=auth)
    app.add_api_route("/abort_request", _abort_request(state), methods=["POST"],
                      dependencies=auth)
    for path, model, handler in _WEIGHT_ROUTES:       # SGLang's (weight_update.py)
        app.add_api_route(path, _body_route(state, model, handler), methods=["POST"],
                          dependencies=auth)
    app.add_api_route("/health_generate", _health_generate(state), methods=["GET"])
    app.add_api_route("/get_model_info", _model_info(state), methods=["GET"], dependencies=auth)
    for path in ("/get_server_info", "/server_info"):
        app.add_api_route(path, _server_info(state), methods=["GET"], dependencies=auth)
    return app


def _auth_dependency(state: ServerState) -> Callable[[Request], Awaitable[None]]:
    key = state.config.api_key

    async def check(request: Request) -> None:
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if (scheme.lower() != "bearer"
                or not hmac.compare_digest(token.strip().encode(), key.encode())):
            raise APIError(401, "invalid or missing API key; "
                           "send the header 'Authorization: Bearer <key>'", code="invalid_api_key")

    return check


async def read_body(request: Request, limit: int) -> bytes:
    """The request body; 413 as soon as it is known to exceed `limit` bytes (from Content-Length
    or while reading)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body is {declared} bytes; "
                       f"allowed: at most max_request_bytes={limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body exceeds max_request_bytes={limit}")
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_body(request: Request, model: type[M], limit: int) -> M:
    body = await read_body(request, limit)
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise from_validation_error(e) from e


# ---- handlers (closures over the state) ---------------------------------------------------------


def _health(state: ServerState) -> Handler:
    async def health() -> Response:
        client = state.client
        if client.failure is not None:
            return APIError(503, f"unhealthy: {client.failure}", code="engine_failed").response()
        if client.draining:
            return unavailable("the server is shutting down", "shutting_down").response()
        if not client.is_ready:
            return unavailable("the engine is loading the model", "loading").response()
        return JSONResponse({"status": "ok", "engine_pid": client.engine_pid})

    return health


def _card(state: ServerState) -> ModelCard:
    """The served model's card; `root` is its served name (no server path leaves the host)."""
    info = state.client.model
    return ModelCard(id=state.config.served_model_name, created=state.created,
                     root=state.config.served_model_name,
                     max_model_len=info.context_length if info is not None else 0,
                     random_weights=state.random_weights)


def _models(state: ServerState) -> Handler:
    async def models() -> Response:
        return JSONResponse(ModelList(data=[_card(state)]).model_dump())

    return models


def _model(state: ServerState) -> Handler:
    async def model(model_id: str) -> Response:
        state.check_model(model_id)
        return JSONResponse(_card(state).model_dump())

    return model


def _generation_route(state: ServerState, model: type[BaseModel], create: Handler) -> Handler:
    """A generation route: the body parsed into `model` (unknown fields named in a warning), then
    `create(state, body, request)` (the request: to notice a client that goes away)."""
    async def route(request: Request) -> Response:
        body = await parse_body(request, model, state.config.max_request_bytes)
        state.warn_unknown_fields(body)
        return await create(state, body, request)

    return route


def _tokenize(state: ServerState) -> Handler:
    async def handler(request: Request) -> Response:
        body = await parse_body(request, TokenizeRequest, state.config.max_request_bytes)
        return tokenize(state, body)

    return handler


def _detokenize(state: ServerState) -> Handler:
    async def handler(request: Request) -> Response:
        body = await parse_body(request, DetokenizeRequest, state.config.max_request_bytes)
        return detokenize(state, body)

    return handler


def _tokenizer_info(state: ServerState) -> Handler:
    async def handler() -> Response:
        return tokenizer_info(state)

    return handler


def _abort_request(state: ServerState) -> Handler:
    async def handler(request: Request) -> Response:
        return abort(state, await parse_body(request, AbortRequest,
                                             state.config.max_request_bytes))

    return handler


_WEIGHT_ROUTES: list[tuple[str, type[BaseModel], Handler]] = [
    ("/init_weights_update_group", InitGroupRequest, init_group),
    ("/update_weights_from_distributed", UpdateDistributedRequest, update_distributed),
    ("/destroy_weights_update_group", DestroyGroupRequest, destroy_group),
    ("/pause_generation", PauseRequest, pause),
    ("/continue_generation", ContinueRequest, resume),
    ("/release_memory_occupation", MemoryRequest, release_memory),
    ("/resume_memory_occupation", MemoryRequest, resume_memory),
]


def _body_route(state: ServerState, model: type[BaseModel],
                handler: Handler) -> Handler:
    """A POST route: the body parsed into `model`, then `handler(state, body)`."""
    async def route(request: Request) -> Response:
        body = await parse_body(request, model, state.config.max_request_bytes)
        state.warn_unknown_fields(body)
        return await handler(state, body)

    return route


def _health_generate(state: ServerState) -> Handler:
    async def handler() -> Response:
        return await health_generate(state)

    return handler


def _model_info(state: ServerState) -> Handler:
    async def handler() -> Response:
        return model_info(state)

    return handler


def _server_info(state: ServerState) -> Handler:
    async def handler() -> Response:
        return await server_info(state)

    return handler


def _abort(state: ServerState) -> Handler:
    async def abort(request: Request) -> Response:
        body = await parse_body(request, AbortBody, state.config.max_request_bytes)
        job = state.jobs.get(body.request_id)
        if job is not None:
            job.abort()
        return JSONResponse({"request_id": body.request_id, "aborted": job is not None})

    return abort


def _engine_stats(state: ServerState) -> Handler:
    async def engine_stats(check_integrity: bool = False) -> Response:
        snapshot = await state.client.query_stats(check_integrity)
        return JSONResponse({**dataclasses.asdict(snapshot),
                             "num_inflight": state.client.num_inflight,
                             "num_jobs": len(state.jobs)})

    return engine_stats


def _flush_cache(state: ServerState) -> Handler:
    async def flush_cache() -> Response:
        snapshot = await state.client.query_stats(flush_cache=True)
        return JSONResponse(dataclasses.asdict(snapshot))

    return flush_cache


def _update_weights_from_disk(state: ServerState) -> Handler:
    async def update_weights_from_disk(request: Request) -> Response:
        body = await parse_body(request, UpdateWeightsFromDiskRequest,
                                state.config.max_request_bytes)
        reply = await state.client.update_weights(body.model_path, body.weight_version)
        return JSONResponse(UpdateWeightsFromDiskResponse(
            success=True, message=reply.message, num_tensors=reply.num_tensors,
            weight_version=reply.weight_version).model_dump())

    return update_weights_from_disk


def _metrics(state: ServerState) -> Handler:
    async def metrics() -> Response:
        snapshot = None
        if state.client.is_ready:
            try:
                snapshot = await state.client.query_stats(timeout=2.0)
            except APIError:
                snapshot = None
        text = state.metrics.render(snapshot, state.client.is_ready, state.client.num_inflight)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return metrics
