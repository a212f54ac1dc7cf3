"""Launch and shutdown of `dsv4 serve`: the API process (this one) and the engine process it spawns.

    serve(config)
      bind the ZMQ sockets (EngineClient) -> spawn the engine process ("spawn" context; it loads
      the model and connects) -> run uvicorn. /health answers 503 until EngineReady arrives, then
      200.

Shutdown. SIGTERM / SIGINT: the listening socket stays open and new requests get 503 with
`Retry-After` (code "shutting_down"; /health too) while in-flight requests may finish for
`shutdown_timeout_s`; those still running then are aborted (finish_reason "abort") and get
ABORT_GRACE_S to flush; then uvicorn stops (it closes the socket), the engine gets ShutdownEngine
and is joined; exit code 0. A second signal stops uvicorn at once (a second SIGINT forces it).
Engine crash (any exit not asked for, SIGKILL included): the engine process's sentinel wakes the
event loop, every in-flight request fails with 503, /health answers 503, the server stops and
`serve` returns 1.

Run: `dsv4 serve` (cli/serve.py). Test: `pytest tests/server/test_lifecycle.py`.
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from multiprocessing.process import BaseProcess
from types import FrameType

import uvicorn
from fastapi import FastAPI

from dsv4.assets import is_random_weights
from dsv4.config.server import ServerConfig
from dsv4.server.api import create_app
from dsv4.server.chat_template import ChatTemplate
from dsv4.server.engine_client import EngineClient
from dsv4.server.engine_process import run_engine_process
from dsv4.server.ipc import IpcPaths
from dsv4.server.metrics import ServerMetrics
from dsv4.server.state import ServerState
from dsv4.server.tokenizer import ServerTokenizer
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)

ENGINE_EXIT_TIMEOUT_S = 10.0
ABORT_GRACE_S = 2.0
"""After aborting the requests that outlived shutdown_timeout_s, how long their responses get to
flush before uvicorn cancels whatever is left."""


class _Server(uvicorn.Server):
    """uvicorn's server, except that the first SIGTERM / SIGINT only starts the drain (the
    lifespan's drain task stops the server when it is over: `_drain`), and a handled signal ends in
    a clean exit (uvicorn re-raises the signal after shutdown, which would turn a graceful stop
    into "killed by SIGTERM")."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_signal = on_signal
        self._signalled = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._on_signal()
        if not self._signalled:
            self._signalled = True
            return
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True


def serve(config: ServerConfig) -> int:
    """Run the server until SIGTERM / SIGINT (returns 0) or an engine failure (returns 1)."""
    tokenizer = ServerTokenizer.from_checkpoint(config.model)
    template = ChatTemplate.from_checkpoint(config.model)
    paths = IpcPaths.create()
    metrics = ServerMetrics()
    client = EngineClient(paths, metrics, config.max_inflight_requests, tokenizer.tokenizer)
    proc = multiprocessing.get_context("spawn").Process(target=run_engine_process,
                                                         args=(config, paths), name="dsv4-engine")
    proc.start()
    logger.info("engine process started (pid %s); loading %s", proc.pid, config.model)
    if config.enable_return_routing:
        logger.info("--enable-return-routing: the engine captures routing per token and runs "
                    "without the prefix cache (cached prefix tokens have no captured routing)")
    if config.speculative_num_steps:
        logger.info("speculative decoding: the MTP block drafts %d tokens per decode step "
                    "(usage.completion_tokens_details, dsv4_spec_* in /metrics)",
                    config.speculative_num_steps)
    state = ServerState(config, client, tokenizer, template, metrics,
                        is_random_weights(config.model))
    servers: list[_Server] = []     # the lifespan's drain task stops the server built below
    try:
        app = create_app(state, _lifespan(state, proc,
                                          lambda: setattr(servers[0], "should_exit", True)))
        server = _Server(_uvicorn_config(config, app), _draining(client))
        servers.append(server)
        client.on_failure = lambda: setattr(server, "should_exit", True)
        client.on_ready = lambda: _log_ready_hint(state)
        server.run()
    finally:
        _stop_engine(proc, graceful=client.model is not None)
        client.close()
        paths.remove()
    if client.failure is not None:
        logger.error("exiting with status 1: %s", client.failure)
        return 1
    return 0


def _uvicorn_config(config: ServerConfig, app: FastAPI) -> uvicorn.Config:
    return uvicorn.Config(app, host=config.host, port=config.port, access_log=config.access_log,
                          timeout_graceful_shutdown=math.ceil(config.shutdown_timeout_s
                                                              + ABORT_GRACE_S),
                          lifespan="on", log_level="info")


def _draining(client: EngineClient) -> Callable[[], None]:
    def on_signal() -> None:
        if not client.draining:
            logger.info("shutdown requested: no new requests; in-flight requests may finish")
        client.draining = True

    return on_signal


def _lifespan(state: ServerState, proc: BaseProcess, stop_server: Callable[[], None]
              ) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    client = state.client

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        reader = asyncio.create_task(client.run_reader())
        reader.add_done_callback(lambda task: _on_reader_done(client, task))

        def on_engine_exit() -> None:
            loop.remove_reader(proc.sentinel)
            proc.join(timeout=1.0)
            if not client.stopping:   # an exit nobody asked for
                client.engine_exited(proc.exitcode)

        loop.add_reader(proc.sentinel, on_engine_exit)
        drain = asyncio.create_task(_drain(state, stop_server))
        try:
            yield
        finally:
            drain.cancel()
            client.shutdown()
            # a loading engine does not read its inbox; serve() kills it
            if client.model is not None:
                await _wait_engine(proc, ENGINE_EXIT_TIMEOUT_S)
            loop.remove_reader(proc.sentinel)
            reader.cancel()

    return lifespan


async def _drain(state: ServerState, stop_server: Callable[[], None]) -> None:
    """Once draining, give in-flight requests shutdown_timeout_s, abort those still running (each
    choice ends with finish_reason "abort": streams get their last chunk and [DONE] instead of a
    cut connection), give them ABORT_GRACE_S to flush, then stop the server."""
    while not state.client.draining:
        await asyncio.sleep(0.1)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + state.config.shutdown_timeout_s
    while state.jobs and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if state.jobs:
        logger.warning("aborting %d requests still running after the %g s shutdown timeout",
                       len(state.jobs), state.config.shutdown_timeout_s)
        for job in list(state.jobs.values()):
            job.abort()
        deadline = loop.time() + ABORT_GRACE_S
        while state.jobs and loop.time() < deadline:
            await asyncio.sleep(0.05)
    stop_server()


async def _wait_engine(proc: BaseProcess, timeout: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while proc.is_alive() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)


def _stop_engine(proc: BaseProcess, graceful: bool) -> None:
    """Join the engine; one that never became ready (still loading, deaf to ShutdownEngine) is
    killed."""
    if not graceful and proc.is_alive():
        proc.kill()
    proc.join(timeout=ENGINE_EXIT_TIMEOUT_S)
    if proc.is_alive():
        logger.warning("engine process did not exit; terminating it")
        proc.terminate()
        proc.join(timeout=5.0)
    if proc.is_alive():
        proc.kill()
        proc.join()


def _on_reader_done(client: EngineClient, task: asyncio.Task[None]) -> None:
    """The reader only ends by cancellation at shutdown; anything else leaves requests unanswered:
    fail."""
    if not task.cancelled() and task.exception() is not None:
        logger.error("the engine output reader died", exc_info=task.exception())
        client.failure = f"the engine output reader died: {task.exception()!r}"
        client.engine_exited(None)


def _log_ready_hint(state: ServerState) -> None:
    cfg = state.config
    # the key itself is never logged: the hint reads it from the shell
    auth = ' -H "Authorization: Bearer $DSV4_API_KEY"' if cfg.api_key else ""
    body = json.dumps({"model": cfg.served_model_name,
                       "messages": [{"role": "user", "content": "What is 12+7?"}], "max_tokens": 8})
    weights = " (RANDOM weights: the text is gibberish)" if state.random_weights else ""
    url = f"http://{cfg.host}:{cfg.port}"
    logger.info("ready: serving %s%s on %s; try:\n  curl %s/v1/chat/completions"
                " -H 'Content-Type: application/json'%s -d '%s'", cfg.served_model_name, weights,
                url, url, auth, body)
