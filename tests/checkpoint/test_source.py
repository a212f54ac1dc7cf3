"""`in-memory:<preset>` model sources (`checkpoint/source.py`): the directory they resolve to,
their refusals, and an engine served from one with no checkpoint on disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.source import resolve_model_source


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSV4_CACHE", str(tmp_path / "cache"))


def test_directory_passes_through(tmp_path: Path) -> None:
    assert resolve_model_source(tmp_path, "auto") == (tmp_path, "auto")
    assert resolve_model_source(str(tmp_path), "dummy") == (tmp_path, "dummy")


def test_in_memory_preset_dir(tmp_path: Path) -> None:
    """The preset's config.json (its geometry) and a tokenizer, no weights; written once."""
    path, fmt = resolve_model_source("in-memory:micro", "auto")
    assert fmt == "dummy" and path == tmp_path / "cache" / "in-memory" / "micro"
    assert json.loads((path / "config.json").read_text())["hidden_size"] == micro().hidden_size
    assert (path / "tokenizer.json").is_file()
    assert not list(path.glob("*.safetensors"))
    stamp = (path / "config.json").stat().st_mtime_ns
    assert resolve_model_source("in-memory:micro", "dummy") == (path, "dummy")
    assert (path / "config.json").stat().st_mtime_ns == stamp


def test_refusals() -> None:
    with pytest.raises(ValueError, match=r"model='in-memory:huge' is invalid; allowed: "
                                         r"in-memory:<preset> with preset in \["):
        resolve_model_source("in-memory:huge", "auto")


def test_llm_serves_a_preset_from_memory() -> None:
    """`LLM("in-memory:micro")` builds random weights in memory and generates (seeded: the same
    tokens twice)."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = []
    for _ in range(2):
        llm = LLM("in-memory:micro", dtype="float32", device="cpu", page_size=16,
                  max_total_tokens=512)
        assert llm.tokenizer is not None
        outs.append(llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=params,
                                 use_tqdm=False)[0].token_ids)
    assert len(outs[0]) == 4 and outs[0] == outs[1]
    assert next(llm.model.parameters()).device == torch.device("cpu")


def test_load_format_refusal_and_serve_flag() -> None:
    """`dsv4 serve --model in-memory:micro` resolves to the preset's directory and dummy weights;
    an unknown load format for it raises."""
    from dsv4.cli.main import build_parser
    from dsv4.cli.serve import build_config

    with pytest.raises(ValueError, match=r"load_format='sharded' with model='in-memory:micro' "
                                         r"is invalid; allowed: 'dummy'"):
        resolve_model_source("in-memory:micro", "sharded")
    config = build_config(build_parser().parse_args(
        ["serve", "--device", "cpu", "--model", "in-memory:micro"]))
    assert config.load_format == "dummy" and config.model.endswith("in-memory/micro")
