"""The "servers" placement (`RLConfig.placement`): the trainer in this process, the rollouts and
evaluations on running `dsv4 serve` instances, as Miles drives SGLang servers.

`ServerTrainer` is `RLTrainer` with its engine hooks over HTTP: `_generate` draws the step's
samples through `server_rollout.sample_token_ids_http` (the in-process rollout's seeds, whole
groups dealt over the servers, each sample checked to come from the latest pushed weights),
`_greedy` the held-out answers through `greedy_token_ids_http`, and `sync` pushes the fp32 policy
into every server over one weight-update group (`RolloutServers`). The servers run in their own
processes; unless `rollout_colocated` says they share the trainer's devices (below), no memory is
released around the trainer's step. A server that stops answering during a rollout or an
evaluation is dropped: the others form the group again and take its requests (the same samples:
they depend on their seeds and the weights alone); one that dies during a push stops the run,
which `--resume` continues.

`RolloutServers` is the trainer's side of SGLang's weight-update protocol
(`server/weight_update.py`): it checks each server once (`/get_server_info`: routing capture on,
and the dtype, weight format, kernel backend and invariant modes the run's own engine would use:
`RLTrainer.engine_config`), forms the group with the trainer as rank 0 and server i as rank
i + 1 (`/init_weights_update_group`; gloo on the CPU, NCCL on CUDA), then per push posts
`/update_weights_from_distributed` to every server for each bucket of `sync_bucket_mb` MiB while
broadcasting its tensors, labelled with the push count. `close` destroys the group. A server that
refuses to join fails `open` at once, naming it (the joins wait on daemon threads). One that
refused a bucket would leave the trainer's collective waiting until `GROUP_TIMEOUT_S`; the check
refuses mismatched servers before any group forms, and the buckets name the policy's own tensors
(a server must serve the run's checkpoint). With
`rollout_colocated` (servers on the trainer's devices) every server releases its KV pools and
CUDA graphs before the trainer's step and allocates them again before the push
(`/release_memory_occupation`, `/resume_memory_occupation`).

A run with servers computes what the local run computes, up to the servers' batching: the same
prompts, seeds and weights; log-probs agree to fp32 summation order unless the servers run the
batch-invariant mode (then exactly, as true on-policy requires).

Test: `pytest tests/rl/test_server_trainer.py` (a real `dsv4 serve` on loopback).
"""

from __future__ import annotations

import functools
import socket
import threading
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar
from urllib.parse import urlparse

import httpx
import torch

from dsv4.engine.weight_group import WeightGroup, backend_for, open_group, send_tensors
from dsv4.kernels.registry import KernelOps, create_kernels
from dsv4.model.forward_mode import ForwardMode
from dsv4.rl.bucket_sync import free_port, plan_buckets
from dsv4.rl.config import RLConfig
from dsv4.rl.objective import formulation_mode
from dsv4.rl.rewards import Prompt
from dsv4.rl.rollout import Sample, label_samples, prompt_token_ids
from dsv4.rl.server_rollout import (
    ServerUnreachable,
    greedy_token_ids_http,
    sample_token_ids_http,
)
from dsv4.rl.trainer import RLTrainer
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)

T = TypeVar("T")

GROUP_TIMEOUT_S = 600.0
"""A weight-update collective waiting longer than this raises (a server died mid-push)."""


class RolloutServers:
    """The trainer's side of the rollout servers at `urls` (module docstring)."""

    def __init__(self, urls: tuple[str, ...], device: torch.device,
                 timeout_s: float = GROUP_TIMEOUT_S) -> None:
        self.urls, self.device, self.timeout_s = [u.rstrip("/") for u in urls], device, timeout_s
        self.group_name = f"dsv4-rl-{uuid.uuid4().hex[:8]}"
        self.group: WeightGroup | None = None
        self.pushes = 0

    def check(self, wanted: Mapping[str, Any]) -> None:
        """Raise ValueError naming the first server whose `/get_server_info` differs from
        `wanted` (knob -> value)."""
        for url in self.urls:
            info = self._call("GET", url, "/get_server_info")
            for key, value in wanted.items():
                if info.get(key) != value:
                    raise ValueError(f"rollout server {url} runs {key}={info.get(key)!r}; "
                                     f"allowed: {key}={value!r} (what this run's own engine "
                                     "would run)")

    def open(self) -> None:
        """Form the weight-update group: every server joins while the trainer hosts it. A server
        that refuses to join fails the call at once (RuntimeError naming it), not at the
        group's timeout: every join waits on a daemon thread meanwhile."""
        host, port = _reachable_host(self.urls[0]), free_port()
        world = 1 + len(self.urls)
        hosted = _on_daemon(lambda: open_group(host, port, 0, world, self.group_name,
                                               backend_for(self.device), self.timeout_s))
        joins = [_on_daemon(functools.partial(
            self._call, "POST", url, "/init_weights_update_group", {
                "master_address": host, "master_port": port, "rank_offset": i + 1,
                "world_size": world, "group_name": self.group_name,
                "backend": backend_for(self.device)})) for i, url in enumerate(self.urls)]
        done, _ = wait([hosted, *joins], return_when=FIRST_EXCEPTION)
        for f in done:
            f.result()                      # a refused join raises here
        _results(joins)
        self.group = hosted.result()
        logger.info("weight-update group %s: the trainer and %d rollout server(s)",
                    self.group_name, len(self.urls))

    @torch.no_grad()
    def push(self, state: Mapping[str, torch.Tensor], bucket_bytes: int) -> tuple[str, int]:
        """Every tensor of `state` into every server, bucket by bucket; returns (the label the
        servers now report, the bytes broadcast)."""
        assert self.group is not None, "open() first"
        self.pushes += 1
        label, sent = str(self.pushes), 0
        with ThreadPoolExecutor(len(self.urls)) as pool:
            for bucket in plan_buckets(state, bucket_bytes):
                tensors = {e.name: state[e.name] for e in bucket.entries}
                body = {"names": list(tensors), "group_name": self.group_name,
                        "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
                        "shapes": [list(t.shape) for t in tensors.values()],
                        "weight_version": label}
                posts = [pool.submit(self._call, "POST", url, "/update_weights_from_distributed",
                                     body) for url in self.urls]
                sent += send_tensors(self.group, tensors)
                _results(posts)
        return label, sent

    def release(self, resume: bool = False) -> list[str]:
        """Every server frees its KV pools and CUDA graphs (`resume`: allocates them again):
        SGLang's /release_memory_occupation and /resume_memory_occupation; their messages."""
        path = "/resume_memory_occupation" if resume else "/release_memory_occupation"
        with ThreadPoolExecutor(len(self.urls)) as pool:
            calls = [pool.submit(self._call, "POST", url, path, {}) for url in self.urls]
            messages = [str(f.result()["message"]) for f in calls]
        logger.debug("rollout servers: %s", messages)
        return messages

    def drop(self, url: str) -> None:
        """Go on without the server at `url` (it stopped answering): the group formed again with
        the others, which hold the current weights already. Raises RuntimeError when none is
        left."""
        self.urls.remove(url)
        if not self.urls:
            raise RuntimeError(f"rollout server {url} stopped answering and no other is left")
        logger.warning("rollout server %s stopped answering: going on with %d other(s)", url,
                       len(self.urls))
        self.close()
        self.group_name = f"dsv4-rl-{uuid.uuid4().hex[:8]}"
        self.open()

    def close(self) -> None:
        """Destroy the group on every server (best effort: a server may be gone)."""
        if self.group is None:
            return
        for url in self.urls:
            try:
                self._call("POST", url, "/destroy_weights_update_group",
                           {"group_name": self.group_name})
            except RuntimeError as e:
                logger.warning("%s", e)
        self.group = None

    def _call(self, method: str, url: str, path: str,
              body: dict[str, Any] | None = None) -> dict[str, Any]:
        try:
            r = httpx.request(method, url + path, json=body, timeout=self.timeout_s)
        except httpx.HTTPError as e:
            raise RuntimeError(f"{url}{path} failed: {e!r}") from e
        if r.status_code != 200:
            raise RuntimeError(f"{url}{path} answered {r.status_code}: {r.text[:500]}")
        out: dict[str, Any] = r.json()
        return out


class ServerTrainer(RLTrainer):
    """`RLTrainer` whose rollouts and evaluations run on `config.rollout_urls` (module
    docstring); `close()` when done."""

    def __init__(self, config: RLConfig) -> None:   # no super(): no engine in this process
        self._init_policy(config)
        c = self.config
        backend = c.kernel_backend
        self.ops: KernelOps | None = (create_kernels(backend, True)  # type: ignore[arg-type]
                                      if c.values_from_kernels else None)
        self.servers = RolloutServers(c.rollout_urls, self.device)
        self.servers.check(server_knobs(c))
        self.servers.open()
        self.label = ""
        self.sync()                       # the servers serve the trainer's weights from step 0

    def mode(self) -> ForwardMode:
        """`RLTrainer.mode` with this process's own kernel ops (the servers' backend and plans)."""
        return formulation_mode(self.config).with_values(self.ops)

    def _generate(self, prompts: list[Prompt], seed: int, first_group: int) -> list[Sample]:
        c = self.config
        ids = prompt_token_ids(self.tokenizer, prompts)
        samples = self._retrying(lambda urls: sample_token_ids_http(
            urls, self.policy.config, ids, c.group_size, c.temperature, c.max_tokens, seed,
            first_group, weight_version=self.label))
        return label_samples(samples, self.tokenizer, prompts, first_group)

    def _greedy(self, prompts: list[Prompt]) -> list[str]:
        ids = prompt_token_ids(self.tokenizer, prompts)
        outs = self._retrying(lambda urls: greedy_token_ids_http(urls, ids,
                                                                 self.config.max_tokens))
        return [self.tokenizer.decode(out) for out in outs]

    def _retrying(self, call: Callable[[list[str]], T]) -> T:
        """`call(the servers' URLs)`, again without a server that stopped answering (its
        requests re-dealt: samples depend on their seeds and the weights alone)."""
        while True:
            try:
                return call(list(self.servers.urls))
            except ServerUnreachable as e:
                self.servers.drop(e.url)

    def _release(self) -> int:
        """Colocated servers free their KV pools while the trainer steps (they report the bytes
        in their replies; this process frees none)."""
        if self.config.rollout_colocated:
            self.servers.release()
        return 0

    def _resume(self) -> None:
        if self.config.rollout_colocated:
            self.servers.release(resume=True)

    def sync(self) -> int:
        self.label, sent = self.servers.push(self.policy.state_dict(),
                                             self.config.sync_bucket_bytes)
        return sent

    def close(self) -> None:
        self.servers.close()


def server_knobs(config: RLConfig) -> dict[str, Any]:
    """What a rollout server must run for `config` (`/get_server_info` keys): routing capture
    (prefix cache off), and the dtype, weight format, kernel backend, invariant modes and
    indexer-key format of the run's own engine (`RLTrainer.engine_config`)."""
    return {"enable_return_routing": True, "dtype": config.dtype,
            "weight_format": config.weight_format, "kernel_backend": config.kernel_backend,
            "batch_invariant": bool(config.true_on_policy),
            "invariant_plans": config.values_from_kernels,
            "index_cache_dtype": config.index_cache_dtype}


def _reachable_host(url: str) -> str:
    """This host's address on the route to `url`'s host (what the server dials back to)."""
    host = urlparse(url).hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))             # UDP: picks the route, sends nothing
        return str(s.getsockname()[0])


def _on_daemon(fn: Callable[[], T]) -> Future[T]:
    """`fn()` on a daemon thread, as a future: a join left waiting after another failed neither
    blocks the caller nor the process's exit."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as e:      # noqa: BLE001 - handed to the waiting caller
            future.set_exception(e)
    threading.Thread(target=run, daemon=True, name="weight-group-join").start()
    return future


def _results(futures: list[Future[dict[str, Any]]]) -> None:
    for f in futures:
        f.result()
