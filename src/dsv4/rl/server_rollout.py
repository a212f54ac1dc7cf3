"""Rollouts from a running `dsv4 serve` over SGLang's /generate (server/native.py): the `Sample`s
that `rollout.sample_token_ids` draws in process (the same seed stream, the temperature-scaled
log-probs, the recorded routing), so a rollout server can stand in for the trainer's own engine.

Each sample is one /generate request (its own `sampling_seed`), all in flight at once (or at most
`max_in_flight` per server), so each server batches them as it likes. Given several servers (the
rollout engines of one policy version), the groups are dealt round-robin: group g goes whole to
server g mod S (`assign_servers`), so a GRPO group's samples share one engine; a sample's tokens
depend only on its seed and the weights, not on the server it ran on. The server must run with
`--enable-return-routing` (routing capture; the prefix cache off, as `rollout.check_engine`
demands in process). Routing comes back as base64 int32 rows, one per token fed; the model
config gives their shapes ([rows, layers, experts per token], [rows, C4 layers, index_topk]).

Test: `pytest tests/rl/test_server_rollout.py` (equal to the in-process rollout at batch 1).
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Sequence
from typing import Any

import httpx
import numpy as np
import torch

from dsv4.config.model import ModelConfig
from dsv4.rl.rollout import Sample, sample_seeds


class ServerUnreachable(RuntimeError):
    """No answer from the server at `url` (refused, reset or timed out): it is gone, or going."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(message)
        self.url = url


def sample_token_ids_http(urls: str | Sequence[str], config: ModelConfig,
                          prompt_ids: list[list[int]], group_size: int, temperature: float,
                          max_tokens: int, seed: int, first_group: int = 0, *,
                          api_key: str | None = None, max_in_flight: int | None = None,
                          timeout_s: float = 600.0,
                          weight_version: str | None = None) -> list[Sample]:
    """`rollout.sample_token_ids` through the server(s) at `urls` (no tokenizer, no task:
    `prompt` None, `text` the server's), the groups spread over the servers (`assign_servers`);
    raises RuntimeError naming the server and its error (`ServerUnreachable` for one that does not
    answer), or (`weight_version` given) a sample made with weights of another label
    (synchronous on-policy RL)."""
    servers = _server_list(urls)
    jobs = sample_seeds(prompt_ids, group_size, seed, first_group)
    indexer = "csa" in config.attn_types
    bodies = [{"input_ids": ids, "return_logprob": True, "return_routed_experts": True,
               "return_indexer_topk": indexer,
               "sampling_params": {"max_new_tokens": max_tokens, "temperature": temperature,
                                   "sampling_seed": s}} for _, ids, s in jobs]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    where = assign_servers([g for g, _, _ in jobs], len(servers))
    outs = asyncio.run(_post_everywhere(servers, where, bodies, headers, max_in_flight,
                                        timeout_s))
    if weight_version is not None:
        stale = sorted({(servers[w], str(o["meta_info"]["weight_version"]))
                        for w, o in zip(where, outs, strict=True)
                        if str(o["meta_info"]["weight_version"]) != weight_version})
        if stale:
            raise RuntimeError(f"samples of weight versions {stale} (server, label); expected "
                               f"{weight_version!r}")
    return [_sample(group, ids, out, config) for (group, ids, _), out in zip(jobs, outs,
                                                                              strict=True)]


def greedy_token_ids_http(urls: str | Sequence[str], prompt_ids: list[list[int]],
                          max_tokens: int, *, api_key: str | None = None,
                          timeout_s: float = 600.0) -> list[list[int]]:
    """Greedy completions (output token ids) of `prompt_ids` through the server(s) at `urls`,
    one prompt per request, dealt round-robin; in order."""
    servers = _server_list(urls)
    bodies = [{"input_ids": ids, "sampling_params": {"max_new_tokens": max_tokens,
                                                     "temperature": 0.0}} for ids in prompt_ids]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    where = assign_servers(list(range(len(bodies))), len(servers))
    outs = asyncio.run(_post_everywhere(servers, where, bodies, headers, None, timeout_s))
    return [list(out["output_ids"]) for out in outs]


def _server_list(urls: str | Sequence[str]) -> list[str]:
    servers = [urls] if isinstance(urls, str) else list(urls)
    if not servers:
        raise ValueError("urls=[] is invalid; allowed: one server URL or more")
    return servers


def assign_servers(groups: list[int], num_servers: int) -> list[int]:
    """The server of each sample: its group's index among the distinct groups (in order of first
    appearance), mod `num_servers`: whole groups dealt round-robin."""
    order: dict[int, int] = {}
    for g in groups:
        order.setdefault(g, len(order))
    return [order[g] % num_servers for g in groups]


async def _post_everywhere(servers: list[str], where: list[int], bodies: list[dict[str, Any]],
                           headers: dict[str, str], max_in_flight: int | None,
                           timeout_s: float) -> list[dict[str, Any]]:
    """Each server's share of `bodies` posted at once; the answers in `bodies`' order."""
    shares = [[j for j, w in enumerate(where) if w == i] for i in range(len(servers))]
    answers = await asyncio.gather(*(
        _post_all(url, [bodies[j] for j in share], headers, max_in_flight or len(share),
                  timeout_s) for url, share in zip(servers, shares, strict=True) if share))
    out: list[dict[str, Any]] = [{} for _ in bodies]
    for share, got in zip([s for s in shares if s], answers, strict=True):
        for j, answer in zip(share, got, strict=True):
            out[j] = answer
    return out


async def _post_all(url: str, bodies: list[dict[str, Any]], headers: dict[str, str],
                    max_in_flight: int, timeout_s: float) -> list[dict[str, Any]]:
    gate = asyncio.Semaphore(max_in_flight)
    limits = httpx.Limits(max_connections=max_in_flight)

    async def post(http: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
        async with gate:
            try:
                r = await http.post("/generate", json=body)
            except httpx.TransportError as e:
                raise ServerUnreachable(url, f"{url}/generate failed: {e!r}") from e
        if r.status_code != 200:
            raise RuntimeError(f"{url}/generate answered {r.status_code}: {r.text[:500]}")
        out: dict[str, Any] = r.json()
        return out

    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits,
                                 timeout=timeout_s) as http:
        return list(await asyncio.gather(*(post(http, b) for b in bodies)))


def _rows(data: str, rows: int, layers: int, k: int) -> torch.Tensor:
    array = np.frombuffer(base64.b64decode(data), dtype="<i4").reshape(rows, layers, k)
    return torch.from_numpy(array.copy())


def _sample(group: int, prompt: list[int], out: dict[str, Any], config: ModelConfig) -> Sample:
    meta = out["meta_info"]
    tokens = prompt + list(out["output_ids"])
    rows = len(tokens) - 1
    experts = _rows(meta["routed_experts"], rows, config.num_layers,
                    config.num_experts_per_tok)
    csa = config.attn_types.count("csa")
    indexer = (_rows(meta["indexer_topk"], rows, csa, config.index_topk)
               if "indexer_topk" in meta else None)
    return Sample(None, group, tokens, len(prompt), [t[0] for t in meta["output_token_logprobs"]],
                  experts, indexer, out["text"], meta["finish_reason"]["type"])
