"""GenerationJob: one HTTP generation request as a set of engine requests, and their accumulated
outputs.

A request with P prompts and `n` samples becomes P*n engine requests; choice k samples prompt
k // n (OpenAI's index order) under rid "<job id>-<k>". Sample j of every prompt gets seed
`choice_seed(seed, j)`: sample 0 keeps the request's seed, so `n=1` and the first of `n=4` agree,
and every sample is reproducible.

Under speculative decoding (`speculative=True`) `usage()` adds `completion_tokens_details`: the
drafts the choices' engine requests had accepted and rejected.

A job that asks for routing (`routing`: kinds, routing.py) collects each choice's routing rows as
they arrive; `ChoiceOutput.routing_fields` returns one row per fed token of the choice.

Life of a job: `GenerationJob(...)` submits (503 when the queue is full) -> `wait_accepted()` (400
naming the field when the engine's validation refuses a choice) -> `deltas()` (streaming) or
`collect()` -> `close()`, which aborts every choice still running; handlers call it in `finally`,
so a client that goes away mid-request always frees its engine requests and their cache pages.

Test: `pytest tests/server/test_openai_client.py tests/server/test_disconnect.py`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from dsv4.engine.sampling_params import MAX_SEED, SamplingParams
from dsv4.server.chat_tools import ChatMode
from dsv4.server.engine_client import (
    Accepted,
    ChoiceDelta,
    EngineClient,
    Item,
    JobQueue,
    raise_if_error,
)
from dsv4.server.errors import APIError, bad_request
from dsv4.server.ipc import RoutingRows
from dsv4.server.protocol import (
    CompletionTokensDetails,
    PromptTokensDetails,
    RoutingArray,
    SamplingFields,
    Usage,
)
from dsv4.server.routing import choice_routing
from dsv4.server.structured import structured_output

MAX_N = 128
DISCONNECT_POLL_S = 0.5

IsDisconnected = Callable[[], Awaitable[bool]]


class ClientGone(Exception):
    """The HTTP client disconnected while its (non-streaming) request was pending."""


@dataclass
class ChoiceOutput:
    index: int
    num_prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    cached_tokens: int = 0
    routing: dict[str, list[RoutingRows]] = field(default_factory=dict)
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    stop_matched: str | None = None
    weight_version: str | None = None     # the label of the weights of its latest tokens

    def apply(self, delta: ChoiceDelta) -> None:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
            self.prompt_top_logprobs = delta.prompt_top_logprobs
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        self.top_logprobs += delta.top_logprobs
        self.text += delta.text
        self.finish_reason, self.cached_tokens = delta.finish_reason, delta.cached_tokens
        self.spec_draft_tokens = delta.spec_draft_tokens
        self.spec_accepted_tokens = delta.spec_accepted_tokens
        self.stop_matched = delta.stop_matched or self.stop_matched
        self.weight_version = delta.weight_version or self.weight_version
        for kind, rows in delta.routing.items():
            self.routing.setdefault(kind, []).append(rows)

    def routing_fields(self, kinds: list[str]) -> dict[str, RoutingArray]:
        """The routing of `kinds` as choice fields: one row per token fed (prompt + the tokens
        kept - 1)."""
        return choice_routing(self.routing, kinds,
                              max(0, self.num_prompt_tokens + len(self.token_ids) - 1))


def choice_seed(seed: int | None, sample: int) -> int | None:
    """Seed of sample `sample` of a request with `seed` (None: the engine draws one per request)."""
    if seed is None or sample == 0:
        return seed
    digest = hashlib.sha256(f"{seed}:{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % (MAX_SEED + 1)


def build_params(body: SamplingFields, max_tokens: int, logprobs: int | None,
                 prompt_logprobs: int | None = None,
                 mode: ChatMode | None = None) -> list[SamplingParams]:
    """The SamplingParams of the body's n samples; 400 naming the field for any invalid value.
    `mode` (chat): its decoding constraint replaces the body's."""
    if not 1 <= body.n <= MAX_N:
        raise bad_request(f"n={body.n} is invalid; allowed: 1 <= n <= {MAX_N}", "n")
    names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
             "presence_penalty")
    kwargs = {name: getattr(body, name) for name in names if getattr(body, name) is not None}
    try:
        bias = {int(k): v for k, v in (body.logit_bias or {}).items()}
    except ValueError as e:
        keys = sorted(body.logit_bias or {})[:5]
        raise bad_request(f"logit_bias keys must be token ids; got {keys}; allowed: decimal "
                          "integers", "logit_bias") from e
    try:
        base = SamplingParams.create(stop=body.stop, stop_token_ids=body.stop_token_ids,
                                     logit_bias=bias,
                                     max_tokens=max_tokens, seed=body.seed,
                                     prompt_logprobs=prompt_logprobs,
                                     ignore_eos=body.ignore_eos, logprobs=logprobs,
                                     skip_special_tokens=body.skip_special_tokens,
                                     structured=(structured_output(body) if mode is None
                                                 else mode.structured), **kwargs)
    except ValueError as e:
        raise bad_request(str(e)) from e
    return [dataclasses.replace(base, seed=choice_seed(body.seed, j)) for j in range(body.n)]


class GenerationJob:
    def __init__(self, client: EngineClient, job_id: str, prompts: list[list[int]],
                 params: list[SamplingParams], routing: list[str] | None = None,
                 speculative: bool = False) -> None:
        n = len(params)
        self.client, self.id, self.n = client, job_id, n
        self.routing = list(routing or [])
        self.speculative = speculative      # the engine speculates: usage reports the drafts
        self.choices = [ChoiceOutput(k, len(prompts[k // n])) for k in range(len(prompts) * n)]
        self._rids = [f"{job_id}-{k}" for k in range(len(self.choices))]
        self._open = set(range(len(self.choices)))
        self._queue: JobQueue = asyncio.Queue()
        # items that arrived while waiting for acceptance
        self._early: deque[tuple[int, Item]] = deque()
        self._checked = time.monotonic()     # the last client-disconnect check
        client.submit([(rid, prompts[k // n], params[k % n]) for k, rid in enumerate(self._rids)],
                      self._queue, self.routing)

    @property
    def is_finished(self) -> bool:
        return not self._open

    async def wait_accepted(self, is_disconnected: IsDisconnected | None = None) -> None:
        """Return once the engine has queued every choice; raises 400 / 503 (and closes the job)
        otherwise."""
        pending = set(range(len(self.choices)))
        while pending:
            index, item = await self._receive(is_disconnected)
            self._fail_on_error(item)
            if isinstance(item, Accepted):
                pending.discard(index)
            else:   # an accepted choice already produced output (the engine admits in batches)
                self._early.append((index, item))

    async def deltas(self) -> AsyncIterator[tuple[ChoiceOutput, ChoiceDelta]]:
        """Yield each choice's deltas (already applied to it) until every choice has finished."""
        while self._open:
            index, item = await self._get(None)
            if (applied := self._apply(index, item)) is not None:
                yield applied

    async def collect(self, is_disconnected: IsDisconnected | None = None) -> None:
        """Wait until every choice has finished (raises ClientGone if the client disconnects
        first)."""
        while self._open:
            index, item = await self._get(is_disconnected)
            self._apply(index, item)

    def abort(self) -> None:
        """Abort every running choice: each ends with finish_reason "abort" (POST /v1/abort)."""
        open_ = sorted(self._open)
        self.client.abort([self._rids[k] for k in open_])
        for k in open_:
            c = self.choices[k]
            self._queue.put_nowait((k, ChoiceDelta([], [], [], "", "abort", c.num_prompt_tokens,
                                                   c.cached_tokens, {}, c.spec_draft_tokens,
                                                   c.spec_accepted_tokens)))

    def close(self) -> None:
        """Abort whatever has not finished; idempotent."""
        self.client.abort([self._rids[k] for k in self._open])
        self._open.clear()

    def usage(self) -> Usage:
        firsts = self.choices[:: self.n]   # the prompt is counted once per prompt, as OpenAI does
        prompt = sum(c.num_prompt_tokens for c in firsts)
        completion = sum(len(c.token_ids) for c in self.choices)
        return Usage(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(c.cached_tokens
                                                                                 for c in firsts)),
                     completion_tokens_details=self._drafts() if self.speculative else None)

    def _drafts(self) -> CompletionTokensDetails:
        """Every choice's drafts accepted and rejected (as the engine counted them: drafts accepted
        past a stop or max_tokens are in, though their tokens were dropped)."""
        drafts = sum(c.spec_draft_tokens for c in self.choices)
        accepted = sum(c.spec_accepted_tokens for c in self.choices)
        return CompletionTokensDetails(accepted_prediction_tokens=accepted,
                                       rejected_prediction_tokens=drafts - accepted)

    # ---- internals ------------------------------------------------------------------------------
    async def _get(self, is_disconnected: IsDisconnected | None) -> tuple[int, Item]:
        return self._early.popleft() if self._early else await self._receive(is_disconnected)

    async def _receive(self, is_disconnected: IsDisconnected | None) -> tuple[int, Item]:
        if is_disconnected is None:
            return await self._queue.get()
        while True:
            # NOTE: also while tokens flow (a non-streaming request learns of its client's
            # disconnect only here), at most every DISCONNECT_POLL_S
            now = time.monotonic()
            if now - self._checked >= DISCONNECT_POLL_S:
                self._checked = now
                if await is_disconnected():
                    raise ClientGone()
            try:
                return await asyncio.wait_for(self._queue.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                continue

    def _apply(self, index: int, item: Item) -> tuple[ChoiceOutput, ChoiceDelta] | None:
        self._fail_on_error(item)
        if not isinstance(item, ChoiceDelta) or index not in self._open:
            return None
        choice = self.choices[index]
        choice.apply(item)
        if item.finish_reason is not None:
            self._open.discard(index)
        return choice, item

    def _fail_on_error(self, item: Item) -> None:
        try:
            raise_if_error(item)
        except APIError:
            self.close()
            raise
