"""Rollouts through a real `dsv4 serve --enable-return-routing` (rl/server_rollout.py) against the
in-process rollout (rl/rollout.py) on one micro checkpoint: at batch 1 on both sides the same
sample (tokens, temperature-scaled log-probs within 1e-5, recorded experts and indexer picks); with
several groups in flight, the seeds of the same stream, every array shaped and valid; groups
spread over several servers give the samples of one server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import write_checkpoint
from dsv4.config.engine import EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.model.loader import load_model
from dsv4.rl.rollout import sample_token_ids
from dsv4.rl.server_rollout import assign_servers, sample_token_ids_http
from server.conftest import ServerProcess, running_server

PROMPTS = [torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist()
           for n in (9, 14, 11)]
TOL = 1e-5


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rollout_ckpt") / "micro"
    write_checkpoint(micro(), path, seed=4)
    return path


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, ckpt: Path) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory.mktemp("rollout_server"), "--model", str(ckpt),
                        "--enable-return-routing", "--shutdown-timeout", "2") as s:
        yield s


def test_equal_to_the_in_process_rollout(srv: ServerProcess, ckpt: Path) -> None:
    engine = LLMEngine(load_model(ckpt, dtype="float32", device="cpu"),
                       EngineConfig(page_size=128, max_total_tokens=4096, capture_routing=True,
                                    disable_prefix_cache=True))
    want = sample_token_ids(engine, PROMPTS[:1], 1, 0.9, 7, seed=3, first_group=2)[0]
    got = sample_token_ids_http(srv.url, micro(), PROMPTS[:1], 1, 0.9, 7, seed=3,
                                first_group=2)[0]
    assert (got.group, got.prompt_len, got.tokens) == (want.group, want.prompt_len, want.tokens)
    assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True)) <= TOL
    assert torch.equal(got.experts, want.experts) and got.experts.dtype == torch.int32
    assert want.indexer is not None and got.indexer is not None
    assert torch.equal(got.indexer, want.indexer)
    assert got.finish_reason == want.finish_reason


def test_groups_in_flight(srv: ServerProcess) -> None:
    config = micro()
    samples = sample_token_ids_http(srv.url, config, PROMPTS, 3, 1.0, 6, seed=8)
    assert [s.group for s in samples] == [g for g in range(3) for _ in range(3)]
    for s in samples:
        rows = len(s.tokens) - 1
        assert s.tokens[:s.prompt_len] == PROMPTS[s.group] and len(s.logprobs) == s.response_len
        assert all(lp <= 0 for lp in s.logprobs)
        assert s.experts.shape == (rows, config.num_layers, config.num_experts_per_tok)
        assert ((s.experts >= -1) & (s.experts < config.n_routed_experts)).all()
        assert s.indexer is not None and s.indexer.shape == (rows, 2, config.index_topk)
    responses = [tuple(s.tokens[s.prompt_len:]) for s in samples]
    assert len(set(responses)) > 3, "each sample draws with its own seed"
    with pytest.raises(RuntimeError, match="answered 400"):
        sample_token_ids_http(srv.url, config, PROMPTS[:1], 1, 1.0, 0, seed=0)


def test_assign_servers_deals_whole_groups() -> None:
    assert assign_servers([5, 5, 6, 6, 7, 7, 8], 2) == [0, 0, 1, 1, 0, 0, 1]
    assert assign_servers([2, 2, 2], 3) == [0, 0, 0]
    assert assign_servers([0, 1, 2, 3], 1) == [0, 0, 0, 0]


def test_groups_spread_over_servers(srv: ServerProcess) -> None:
    """Two server addresses (here the same server twice) give the samples of one: each sample's
    tokens depend on its seed alone (its log-probs within the batches' fp32 rounding). A dead
    second server fails naming its address, so the groups really go to both."""
    config = micro()
    one = sample_token_ids_http(srv.url, config, PROMPTS, 2, 1.0, 5, seed=11)
    two = sample_token_ids_http([srv.url, srv.url], config, PROMPTS, 2, 1.0, 5, seed=11,
                                max_in_flight=2)
    assert [(s.group, s.tokens) for s in two] == [(s.group, s.tokens) for s in one]
    for a, b in zip(one, two, strict=True):     # other batches: fp32 rounding of the log-probs
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= TOL
        assert torch.equal(a.experts, b.experts)
    dead = "http://127.0.0.1:9"
    with pytest.raises(RuntimeError, match=f"{dead}/generate failed"):
        sample_token_ids_http([srv.url, dead], config, PROMPTS[:2], 1, 1.0, 3, seed=0,
                              timeout_s=5.0)
    with pytest.raises(ValueError, match=r"urls=\[\] is invalid"):
        sample_token_ids_http([], config, PROMPTS, 1, 1.0, 3, seed=0)
