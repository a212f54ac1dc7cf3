"""POST /generate and /abort_request: SGLang's native API, for the clients written against it
(Miles' and slime's rollouts, `sglang.bench_serving --backend sglang`), served by the same engine
requests as the OpenAI endpoints (generation.py).

Request (SGLang's names): `text` or `input_ids` (one prompt or a list of them); `sampling_params`,
one object for every prompt: `max_new_tokens` (default 128; null: up to the context length),
`temperature`, `top_p`, `top_k` (-1: off), `min_p`, `repetition_penalty`, `frequency_penalty`,
`presence_penalty`, `stop`, `stop_token_ids`, `ignore_eos`, `skip_special_tokens`,
`no_stop_trim` (the text keeps the stop string or stop token that ended it), `n`,
`sampling_seed`, `regex` / `ebnf` / `json_schema` (structured.py); `rid` (the request's id, for
`/abort_request`); `return_logprob`, `logprob_start_len` (-1: the output's log-probs only;
L >= 0: the prompt's too, from position L), `top_logprobs_num`, `return_text_in_logprobs`;
`stream`; `return_routed_experts` / `return_indexer_topk` (routing.py: a server started with
--enable-return-routing, no streaming).

Response: per choice `{"text", "output_ids", "meta_info"}`, a list of them when the request has
several prompts or n > 1 (prompt-major: choice k samples prompt k // n). `meta_info`: `id`,
`finish_reason` (`{"type": "stop", "matched": the stop string or stop token id, null when a
grammar completed}`, `{"type": "length", "length": tokens}`, `{"type": "abort", "message"}`;
the text drops a stop token's text, `output_ids` keep the token), `prompt_tokens`,
`completion_tokens`, `cached_tokens`, `e2e_latency` (s), `weight_version` (the label of the
weights that produced the choice's latest tokens: "0" at start, then the update's
`weight_version` or the update count); with `return_logprob`
`output_token_logprobs` (`[logprob, token id, token text or null]` per token: the
temperature-scaled log-probs the token was sampled from, which is what RL trainers take from
SGLang as rollout log-probs; raw where greedy) and `input_token_logprobs` (the prompt's, raw
`log_softmax`, null for its first token), with `top_logprobs_num` k also `output_top_logprobs` /
`input_top_logprobs` (k triples per position); `routed_experts` / `indexer_topk`: base64 of the
little-endian int32 rows, one per token fed (prompt + output - 1), as SGLang sends them.

POST /abort_request `{"rid"}` aborts that request (`{"abort_all": true}`: every request): each
of its choices finishes with `{"type": "abort"}`. GET /get_model_info, /get_server_info
(/server_info) and /health_generate answer as SGLang's do (`model_info`, `server_info`,
`health_generate`).

Stream: server-sent events of the same objects, `text`, `output_ids` and `completion_tokens`
cumulative (SGLang's default), the log-prob lists only the event's new tokens, `index` naming the
choice; then `data: [DONE]`. Validation errors are 400s in the OpenAI error shape (errors.py),
which carries SGLang's `{"error": {"message"}}`.

Test: `pytest tests/server/test_native_generate.py`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from dsv4 import __version__
from dsv4.engine.sampling_params import SamplingParams
from dsv4.server.engine_client import ChoiceDelta
from dsv4.server.errors import APIError, bad_request, error_body, unavailable
from dsv4.server.generation import ChoiceOutput, ClientGone, GenerationJob, build_params
from dsv4.server.protocol import RequestBody, SamplingFields, SamplingKnobs
from dsv4.server.routing import requested_routing
from dsv4.server.state import SSE_DONE, JobStreamingResponse, ServerState, sse
from dsv4.server.tokenizer import ServerTokenizer

DEFAULT_MAX_NEW_TOKENS = 128            # SGLang's default
HEALTH_GENERATE_TIMEOUT_S = 20.0        # SGLang's default for /health_generate
PRIVATE_FIELDS = ("model", "api_key")   # a server path and a secret never leave the host


class NativeSamplingParams(SamplingKnobs):
    """SGLang's `sampling_params`: the knobs named as the OpenAI endpoints name them, plus SGLang's
    own (the fields dsv4 implements; others are named in a warning)."""

    max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS
    sampling_seed: int | None = None
    json_schema: str | None = None
    min_new_tokens: int = 0
    no_stop_trim: bool = False


class GenerateRequest(RequestBody):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: NativeSamplingParams | None = None
    rid: str | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    return_routed_experts: bool = False
    return_indexer_topk: bool = False


class AbortRequest(RequestBody):
    rid: str = ""
    abort_all: bool = False


async def generate(state: ServerState, body: GenerateRequest, request: Request) -> Response:
    start = time.monotonic()
    sp = body.sampling_params or NativeSamplingParams()
    state.warn_unknown_fields(sp)
    prompts, batched = _prompts(state.tokenizer, body)
    fields = _sampling_fields(body, sp)
    routing = requested_routing(fields, state.config.enable_return_routing)
    job = state.start_job("gen", prompts, _params(state, body, sp, fields, prompts), routing,
                          body.rid)
    streaming = False
    try:
        await job.wait_accepted(request.is_disconnected)
        if body.stream:
            streaming = True
            return JobStreamingResponse(_stream(state, job, body, prompts, start,
                                                _stop_tokens(state, sp)),
                                        lambda: state.end_job(job))
        await job.collect(request.is_disconnected)
        stops = _stop_tokens(state, sp)
        outs = [_output(state.tokenizer, job, c, body, prompts, start, stops)
                for c in job.choices]
        return JSONResponse(outs if batched or sp.n > 1 else outs[0])
    except ClientGone:
        return Response(status_code=499)
    finally:
        if not streaming:
            state.end_job(job)


def abort(state: ServerState, body: AbortRequest) -> Response:
    """Abort the /generate request `rid` (every job with `abort_all`); 200 either way, as SGLang."""
    jobs = list(state.jobs.values()) if body.abort_all else [
        job for job in (state.jobs.get(body.rid),) if job is not None]
    for job in jobs:
        job.abort()
    return JSONResponse({"rid": body.rid, "aborted": [job.id for job in jobs]})


async def health_generate(state: ServerState) -> Response:
    """GET /health_generate: 200 once a one-token greedy generation went through the engine
    (SGLang's deep health check), 503 when it failed or took over HEALTH_GENERATE_TIMEOUT_S."""
    if not state.client.is_ready:
        return unavailable("the engine is loading the model", "loading").response()
    params = SamplingParams.create(max_tokens=1, temperature=0.0, ignore_eos=True)
    job = state.start_job("health", [[0]], [params])
    try:
        await asyncio.wait_for(_finish(job), HEALTH_GENERATE_TIMEOUT_S)
    except (TimeoutError, APIError) as e:
        return APIError(503, f"health generation failed: {e!r}", code="unhealthy").response()
    finally:
        state.end_job(job)
    return Response(status_code=200)


async def _finish(job: GenerationJob) -> None:
    await job.wait_accepted()
    await job.collect()


def model_info(state: ServerState) -> Response:
    """GET /get_model_info, as SGLang names it (the served name stands for the paths)."""
    name = state.config.served_model_name
    return JSONResponse({"model_path": name, "tokenizer_path": name, "is_generation": True})


async def server_info(state: ServerState) -> Response:
    """GET /get_server_info (/server_info): the server's knobs (no path, no key), the engine's
    sizes and, in `internal_states`, what SGLang reports there (speculative decoding's mean
    acceptance length, null when not speculating) and the engine's counters."""
    if not state.client.is_ready:
        return unavailable("the engine is loading the model", "loading").response()
    snap = await state.client.query_stats()
    info = {k: v for k, v in dataclasses.asdict(state.config).items()
            if k not in PRIVATE_FIELDS}
    info.update(model_path=state.config.served_model_name, version=__version__,
                context_length=state.model_info.context_length,
                max_total_num_tokens=state.model_info.max_total_tokens,
                weight_version=snap.weight_version,
                internal_states=[{"avg_spec_accept_length": snap.mean_acceptance_length,
                                                 **dataclasses.asdict(snap)}])
    return JSONResponse(info)


# ---- request -> engine requests ---------------------------------------------------------------

def _prompts(tok: ServerTokenizer, body: GenerateRequest) -> tuple[list[list[int]], bool]:
    """(token ids of every prompt, whether the body gave a list of prompts)."""
    if (body.text is None) == (body.input_ids is None):
        raise bad_request("give exactly one of text and input_ids", "text")
    if isinstance(body.text, str):
        return [tok.encode(body.text)], False
    if body.text is not None:
        if not body.text:
            raise bad_request("text is an empty list; allowed: a string or a list of strings",
                              "text")
        return [tok.encode(t) for t in body.text], True
    ids = body.input_ids
    assert ids is not None
    if not ids:
        raise bad_request("input_ids is empty; allowed: token ids or a list of them", "input_ids")
    if isinstance(ids[0], int):
        return [[t for t in ids if isinstance(t, int)]], False
    return [p for p in ids if isinstance(p, list)], True


def _sampling_fields(body: GenerateRequest, sp: NativeSamplingParams) -> SamplingFields:
    """The OpenAI endpoints' sampling fields with SGLang's values (`build_params` reads them)."""
    if sp.min_new_tokens:
        raise bad_request(f"min_new_tokens={sp.min_new_tokens} is not supported; allowed: 0",
                          "sampling_params.min_new_tokens")
    knobs = {name: getattr(sp, name) for name in SamplingKnobs.model_fields}
    if sp.top_k is not None and sp.top_k < 0:
        knobs["top_k"] = None                 # SGLang's -1: off
    return SamplingFields(**knobs, seed=sp.sampling_seed, stream=body.stream,
                          guided_json=sp.json_schema,
                          return_routed_experts=body.return_routed_experts,
                          return_indexer_topk=body.return_indexer_topk)


def _params(state: ServerState, body: GenerateRequest, sp: NativeSamplingParams,
            fields: SamplingFields, prompts: list[list[int]]) -> list[SamplingParams]:
    """The engine's SamplingParams of the n samples: log-probs temperature-scaled (SGLang's),
    the prompt's from `logprob_start_len` when it is >= 0."""
    top = body.top_logprobs_num
    start = body.logprob_start_len
    if body.return_logprob and start != -1 and not 0 <= start < min(len(p) for p in prompts):
        raise bad_request(f"logprob_start_len={start} is invalid; allowed: -1 or 0 <= "
                          "logprob_start_len < the prompt's length", "logprob_start_len")
    logprobs = top if body.return_logprob else None
    scored = top if body.return_logprob and start >= 0 else None
    room = state.model_info.context_length - max(len(p) for p in prompts)
    max_new = sp.max_new_tokens if sp.max_new_tokens is not None else max(1, room)
    params = build_params(fields, max_new, logprobs, scored)
    return [dataclasses.replace(p, scaled_logprobs=body.return_logprob) for p in params]


# ---- engine outputs -> SGLang's objects ----------------------------------------------------------

def _stop_tokens(state: ServerState, sp: NativeSamplingParams) -> frozenset[int]:
    """The tokens that end a choice as a matched stop: its stop_token_ids and, unless
    ignore_eos, the model's eos (a grammar's completion also finishes "stop", on another token)."""
    eos = () if sp.ignore_eos else (state.model_info.eos_token_id,)
    return frozenset((*(sp.stop_token_ids or ()), *eos))


def _output(tok: ServerTokenizer, job: GenerationJob, c: ChoiceOutput, body: GenerateRequest,
            prompts: list[list[int]], start: float, stops: frozenset[int],
            delta: ChoiceDelta | None = None) -> dict[str, Any]:
    """One choice's object: cumulative text / ids; log-probs of `delta`'s tokens (streaming) or of
    every token."""
    token = _stop_token(c, stops)
    meta: dict[str, Any] = {
        "id": job.id if job.n * len(prompts) == 1 else f"{job.id}-{c.index}",
        "finish_reason": _finish_reason(c, token), "prompt_tokens": c.num_prompt_tokens,
        "completion_tokens": len(c.token_ids), "cached_tokens": c.cached_tokens,
        "e2e_latency": time.monotonic() - start, "weight_version": c.weight_version}
    if body.return_logprob:
        meta.update(_logprobs(tok, c, body, prompts[c.index // job.n], delta))
    meta.update({name: a.data for name, a in c.routing_fields(job.routing).items()})
    out = {"text": _text(tok, c, body, token), "output_ids": list(c.token_ids),
           "meta_info": meta}
    return {**out, "index": c.index} if body.stream else out


def _stop_token(c: ChoiceOutput, stops: frozenset[int]) -> int | None:
    """The stop token that ended the choice (its last token), or None."""
    if c.finish_reason != "stop" or c.stop_matched is not None or not c.token_ids:
        return None
    return c.token_ids[-1] if c.token_ids[-1] in stops else None


def _text(tok: ServerTokenizer, c: ChoiceOutput, body: GenerateRequest, token: int | None
          ) -> str:
    """The choice's text as SGLang returns it: without the stop token's text (`output_ids` keep
    the token), or with `no_stop_trim` with what stopped it, string or token."""
    sp = body.sampling_params or NativeSamplingParams()
    if sp.no_stop_trim and c.stop_matched is not None:
        return c.text + c.stop_matched
    if token is None or sp.no_stop_trim:
        return c.text
    return tok.decode(c.token_ids[:-1], skip_special_tokens=sp.skip_special_tokens)


def _finish_reason(c: ChoiceOutput, token: int | None) -> dict[str, Any] | None:
    if c.finish_reason is None:
        return None
    if c.finish_reason == "length":
        return {"type": "length", "length": len(c.token_ids)}
    if c.finish_reason == "stop":
        return {"type": "stop", "matched": c.stop_matched if token is None else token}
    if c.finish_reason == "abort":
        return {"type": "abort", "message": "aborted"}
    return {"type": c.finish_reason}


def _logprobs(tok: ServerTokenizer, c: ChoiceOutput, body: GenerateRequest, prompt: list[int],
              delta: ChoiceDelta | None) -> dict[str, Any]:
    def triple(lp: float | None, t: int) -> list[Any]:
        return [lp, t, tok.decode([t]) if body.return_text_in_logprobs else None]

    ids, lps, tops = ((delta.token_ids, delta.logprobs, delta.top_logprobs) if delta is not None
                      else (c.token_ids, c.logprobs, c.top_logprobs))
    out: dict[str, Any] = {"output_token_logprobs": [triple(lp, t) for t, lp in zip(ids, lps,
                                                                                     strict=True)]}
    if body.top_logprobs_num:
        out["output_top_logprobs"] = [[triple(lp, t) for t, lp in row] for row in tops]
    first = delta is None or delta.prompt_logprobs is not None
    if body.logprob_start_len >= 0 and c.prompt_logprobs is not None and first:
        L = body.logprob_start_len
        out["input_token_logprobs"] = [triple(lp, t) for t, lp in
                                       zip(prompt[L:], c.prompt_logprobs[L:], strict=True)]
        if body.top_logprobs_num:
            rows = (c.prompt_top_logprobs or [])[L:]
            out["input_top_logprobs"] = [None if L + i == 0 else [triple(lp, t) for t, lp in row]
                                         for i, row in enumerate(rows)]
    return out


async def _stream(state: ServerState, job: GenerationJob, body: GenerateRequest,
                  prompts: list[list[int]], start: float, stops: frozenset[int]
                  ) -> AsyncIterator[str]:
    try:
        async for choice, delta in job.deltas():
            if delta.token_ids or delta.text or delta.finish_reason is not None:
                yield sse(_output(state.tokenizer, job, choice, body, prompts, start, stops,
                                  delta))
    except APIError as e:
        yield sse(error_body(e.status, e.message, e.param, e.code))
    yield SSE_DONE
