"""ServerState: everything the HTTP handlers share (config, engine client, tokenizer, chat template,
metrics, the jobs in flight), plus the SSE response type that closes its job however the stream
ends.

One instance per API process, built by launch.py and handed to `api.create_app`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from dsv4.config.server import ServerConfig
from dsv4.engine.sampling_params import SamplingParams
from dsv4.server.chat_template import ChatTemplate
from dsv4.server.engine_client import EngineClient
from dsv4.server.errors import APIError
from dsv4.server.generation import GenerationJob
from dsv4.server.ipc import ModelInfo
from dsv4.server.metrics import ServerMetrics
from dsv4.server.protocol import unknown_fields
from dsv4.server.tokenizer import ServerTokenizer
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)


@dataclass
class ServerState:
    config: ServerConfig
    client: EngineClient
    tokenizer: ServerTokenizer
    template: ChatTemplate
    metrics: ServerMetrics
    random_weights: bool
    created: int = field(default_factory=lambda: int(time.time()))
    jobs: dict[str, GenerationJob] = field(default_factory=dict)
    warned_fields: set[str] = field(default_factory=set)

    def warn_unknown_fields(self, body: BaseModel) -> list[str]:
        """Log a warning for each unknown field of `body` not warned about before (vLLM's
        behaviour: an ignored field is named once, not silently dropped); returns those named."""
        new = [name for name in unknown_fields(body) if name not in self.warned_fields]
        for name in new:
            logger.warning("request field %r is not supported and is ignored", name)
        self.warned_fields.update(new)
        return new

    @property
    def model_info(self) -> ModelInfo:
        assert self.client.model is not None, "a job was admitted before the engine was ready"
        return self.client.model

    def check_context(self, prompts: list[list[int]], max_tokens: int) -> None:
        """400 (param max_tokens) when a prompt plus `max_tokens` exceeds the context length, as
        vLLM answers: the request would otherwise end early with fewer tokens than asked."""
        limit = self.model_info.context_length
        for ids in prompts:
            # a prompt that alone reaches the limit is the engine's error (param "prompt")
            if len(ids) < limit < len(ids) + max_tokens:
                raise APIError(400, f"This model's maximum context length is {limit} tokens. "
                               f"However, you requested {len(ids) + max_tokens} tokens "
                               f"({len(ids)} in the prompt, {max_tokens} in the completion). "
                               "Please reduce the length of the prompt or completion.",
                               "max_tokens")

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.served_model_name:
            raise APIError(404, f"model={name!r} does not exist; "
                           f"allowed: {[self.config.served_model_name]}", "model",
                           "model_not_found")

    def start_job(self, kind: str, prompts: list[list[int]], params: list[SamplingParams],
                  routing: list[str] | None = None, job_id: str | None = None) -> GenerationJob:
        """Submit a job, its id `job_id` (a client's: SGLang's `rid`; 400 while one with that id
        is in flight) or "<kind>-<uuid>"."""
        if job_id is not None and job_id in self.jobs:
            raise APIError(400, f"rid={job_id!r} is already in flight; allowed: a new id", "rid")
        self.check_context(prompts, params[0].max_tokens)
        job = GenerationJob(self.client, job_id or f"{kind}-{uuid.uuid4().hex}", prompts, params,
                            routing, speculative=self.config.speculative_num_steps > 0)
        self.jobs[job.id] = job
        return job

    def end_job(self, job: GenerationJob) -> None:
        job.close()
        self.jobs.pop(job.id, None)


def sse(chunk: BaseModel | dict[str, object]) -> str:
    """One server-sent event carrying a JSON object."""
    data = chunk.model_dump_json() if isinstance(chunk, BaseModel) else json.dumps(chunk)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class JobStreamingResponse(StreamingResponse):
    """An SSE response that calls `on_close` when the stream ends for any reason (done, client gone,
    server shutdown), so its engine requests never outlive it."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
