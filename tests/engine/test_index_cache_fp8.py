"""`index_cache_dtype="fp8"`: FP8 indexer-key pools and FP8 index scores in the engine.

The engine's greedy tokens equal the full-sequence model's recomputed from scratch, its logits
to 1e-4, with the model's indexer rounding its keys and queries as the pools and the scores op
do (`set_index_cache_dtype`, which the engine applies): ref and triton kernels, chunked prefill,
requests joining and leaving, HiSparse. The pools hold FP8 codes and a scale per key, and the
cache planner gives the saved bytes to more full pages.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_engine_equivalence import (
    LogitRecorder,
    assert_matches,
    assert_pools_free,
    prompts_for,
    run_staggered,
)

from dsv4 import LLM
from dsv4.cache.layout import full_bytes_per_token, plan_cache
from dsv4.checkpoint.presets import get_preset, micro
from dsv4.checkpoint.writer import write_checkpoint
from dsv4.config.engine import EngineConfig
from dsv4.model.indexer import Indexer


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fp8_index")
    write_checkpoint(micro(), path, seed=2, tokenizer=False)
    return path


@pytest.fixture(scope="module")
def ckpt_3_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """micro cut to three layers, one per attention type (a hash MoE, then routed ones): every
    kind of layer of its five, for the row whose kernels run under the Triton interpreter."""
    path = tmp_path_factory.mktemp("fp8_index_3")
    cfg = micro().replace(num_layers=3, attn_types=("swa", "csa", "hca"),
                          moe_types=("hash", "routed", "routed"))
    write_checkpoint(cfg, path, seed=2, tokenizer=False)
    return path


@pytest.mark.parametrize(("backend", "hisparse"), [("ref", False), ("triton", False),
                                                   ("ref", True)])
def test_engine_equals_full_recompute_with_fp8_keys(request: pytest.FixtureRequest, backend: str,
                                                    hisparse: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    rec = LogitRecorder(monkeypatch)
    extra = {"enable_hisparse": True} if hisparse else {}
    path = request.getfixturevalue("ckpt_3_layers" if backend == "triton" else "ckpt")
    llm = LLM(path, dtype="float32", device="cpu", page_size=16, chunked_prefill_size=7,
              max_running_requests=4, max_total_tokens=2048, kernel_backend=backend,
              index_cache_dtype="fp8", **extra)  # type: ignore[arg-type]
    indexers = [m for m in llm.model.modules() if isinstance(m, Indexer)]
    assert indexers and all(m.fp8 for m in indexers)
    csa = [c for c in llm.engine.runner.pools.layers if c.index_keys is not None]
    assert csa and all(c.index_keys is not None and c.index_keys.dtype == torch.float8_e4m3fn
                       and c.index_scales is not None for c in csa)
    # the triton kernels run under the interpreter on CPU: fewer and shorter requests (lengths 1,
    # W - 1, W + 1): the third joins while the first decodes, the longer two span two chunks and
    # write FP8 keys in prefill, the W - 1 one in decode too, all leave at different steps (the
    # W-long prompt is a window boundary, which the ref rows run; FP8 keys are C4 entries)
    if backend == "ref":
        prompts = prompts_for(llm.model.config, seed=3)[:6]
        max_tokens = [4 + (5 * i) % 7 for i in range(len(prompts))]
    else:
        prompts = [prompts_for(llm.model.config, seed=3)[i] for i in (0, 1, 3)]
        max_tokens = [2, 4, 2]
    reqs = run_staggered(llm.engine, prompts, max_tokens)
    assert_matches(llm.model, prompts, reqs, rec)
    written = [c.index_scales for c in csa if c.index_scales is not None]
    assert any(bool((s > 0).any()) for s in written), "no FP8 key was written"
    assert_pools_free(llm.engine)


def test_fp8_keys_change_the_full_sequence_scores(ckpt: Path) -> None:
    """The model's FP8 indexer is not the float one (its keys and queries are rounded), and
    switching back restores the float scores exactly."""
    llm = LLM(ckpt, dtype="float32", device="cpu", page_size=16, max_total_tokens=1024)
    model = llm.model
    ids = torch.tensor([prompts_for(model.config, seed=4)[-1]])
    scores: dict[str, torch.Tensor] = {}
    captured: list[torch.Tensor] = []       # the first CSA layer's full-sequence scores
    original = Indexer.scores

    def spy(self: Indexer, *a: object, **k: object) -> torch.Tensor:
        out = original(self, *a, **k)  # type: ignore[arg-type]
        captured.append(out)
        return out
    Indexer.scores = spy  # type: ignore[method-assign]
    try:
        for mode in ("model", "fp8", "model"):
            model.set_index_cache_dtype(mode)
            captured.clear()
            with torch.no_grad():
                model(ids)
            scores.setdefault(mode, captured[0])
            if mode == "model":
                assert torch.equal(captured[0], scores["model"])
    finally:
        Indexer.scores = original  # type: ignore[method-assign]
    finite = torch.isfinite(scores["model"])
    assert torch.equal(finite, torch.isfinite(scores["fp8"]))
    diff = (scores["fp8"] - scores["model"])[finite].abs()
    assert 0 < diff.max() <= 0.2 * scores["model"][finite].abs().max()
    with pytest.raises(ValueError, match="index_cache_dtype='fp4' is invalid"):
        model.set_index_cache_dtype("fp4")


def test_config_and_cache_plan() -> None:
    with pytest.raises(ValueError, match="index_cache_dtype='bf16' is invalid; allowed"):
        EngineConfig(index_cache_dtype="bf16")  # type: ignore[arg-type]
    flash = get_preset("flash")
    bf16 = full_bytes_per_token(flash, torch.bfloat16)
    fp8 = full_bytes_per_token(flash, torch.bfloat16, index_fp8=True)
    csa = sum(t == "csa" for t in flash.attn_types)
    assert bf16 - fp8 == pytest.approx(csa * (2 * 128 - 132) / 4)
    args = dict(kv_cache_memory_gb=4.0, max_running_requests=4, context_length=1 << 20)
    plain = plan_cache(flash, EngineConfig(**args), torch.bfloat16)  # type: ignore[arg-type]
    fp8_config = EngineConfig(**args, index_cache_dtype="fp8")  # type: ignore[arg-type]
    small = plan_cache(flash, fp8_config, torch.bfloat16)
    assert small.num_full_pages > plain.num_full_pages


def test_default_resolution_in_the_engine_and_the_cli(ckpt: Path) -> None:
    """Unset, the engine resolves the keys' format for its device and backend (CPU: the model
    dtype; CUDA with triton: FP8, `test_engine_gpu.py`), and `dsv4 serve` resolves it before the
    server reports its knobs (`/get_server_info`, which RL's rollout check reads)."""
    from dsv4.cli.main import build_parser
    from dsv4.cli.serve import build_config

    runner = LLM(ckpt, dtype="float32", page_size=16, max_total_tokens=256).engine.runner
    assert runner.config.index_cache_dtype == "model"
    assert not any(m.fp8 for m in runner.model.modules() if isinstance(m, Indexer))
    parser = build_parser()
    assert build_config(parser.parse_args(["serve", "--device", "cpu"])).index_cache_dtype == \
        "model"
    assert build_config(parser.parse_args(["serve", "--device", "cpu", "--index-cache-dtype",
                                           "fp8"])).index_cache_dtype == "fp8"
