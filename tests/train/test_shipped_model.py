"""The embedded dsv4-tiny model: its model card's numbers hold on this CPU, it is small and fast
enough to be the default, and it writes Python."""

from __future__ import annotations

import ast
import json
import time
from pathlib import Path

import pytest

from dsv4.assets import default_model_path, is_random_weights
from dsv4.checkpoint.presets import tiny
from dsv4.config.model import ModelConfig
from dsv4.engine.llm import LLM
from dsv4.engine.sampling_params import SamplingParams
from dsv4.tasks.arithmetic import eval_set
from dsv4.train.evaluate import EASY_LEVELS, task_accuracy

MODEL = default_model_path()
CARD = json.loads((MODEL / "eval.json").read_text())


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(MODEL, dtype="float32", device="cpu", page_size=128, max_total_tokens=8192,
               max_running_requests=128, chunked_prefill_size=4096)


def test_card_states_the_measured_numbers() -> None:
    card = (MODEL / "README.md").read_text()
    for value in (CARD["heldout_loss"], CARD["mtp_top1"], CARD["easy_chat_accuracy"]):
        assert f"{value:.3f}" in card, value


def test_architecture_and_size() -> None:
    config = ModelConfig.from_hf(MODEL)
    assert config.replace(weight_quant="none") == tiny().replace(weight_quant="none")
    assert config.weight_quant == "fp8+fp4" and not is_random_weights(MODEL)
    size = sum(f.stat().st_size for f in MODEL.glob("model-*.safetensors"))
    assert size <= 25_000_000, size
    # every feature active at the training length: top-k < #C4 entries, several C128 entries,
    # SWA < length
    assert (config.index_topk < 2048 // config.csa_ratio and 2048 // config.hca_ratio > 1
            and config.window < 2048)


def test_easy_task_accuracy_matches_card(llm: LLM) -> None:
    easy = [p for p in eval_set(0, 50) if p.level in EASY_LEVELS]
    got = task_accuracy(llm, easy, "chat")["overall"]
    assert abs(got - CARD["easy_chat_accuracy"]) <= 0.05, (got, CARD["easy_chat_accuracy"])


def test_64_tokens_fast_and_python(llm: LLM) -> None:
    prompt = "class Stack:\n    def __init__(self):"
    start = time.perf_counter()
    out = llm.generate(prompt, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0]
    elapsed = time.perf_counter() - start
    # a sanity bound only (about 20x the time on an idle 2-core machine, so a loaded one cannot
    # fail it); the speed itself is measured by benchmarks/offline_throughput.py
    assert len(out.token_ids) == 64 and elapsed < 60.0, elapsed
    text = prompt + out.text
    complete = text[:text.rindex("\n")]                       # drop the cut-off last line
    tree = ast.parse(complete)                                # recognisably Python: it parses
    init = tree.body[0].body[0]                               # type: ignore[attr-defined]
    assert isinstance(init, ast.FunctionDef) and len(init.body) >= 2, complete


def test_chat_template_from_card_renders(llm: LLM) -> None:
    assert llm.tokenizer is not None
    config = json.loads(Path(MODEL / "tokenizer_config.json").read_text())
    assert config["model_max_length"] == 2048 and "chat_template" in config


def test_train_eval_cli_writes_the_card_numbers(tmp_path: Path) -> None:
    """`dsv4 train eval` over 2 held-out windows (`heldout_metrics` on the float32 model, as the
    card was measured): spread over the token file as evenly as the card's 16, they are its
    windows 0 and 8, and their loss and MTP top-1 match the card's, whose headline numbers are the
    means over all 16."""
    from dsv4.cli.main import main

    windows = 2
    picked = slice(None, None, len(CARD["window_loss"]) // windows)
    per_window = CARD["heldout_tokens"] // len(CARD["window_loss"])
    assert CARD["heldout_loss"] == pytest.approx(sum(CARD["window_loss"]) / 16, rel=1e-12)
    assert CARD["mtp_top1"] == pytest.approx(sum(CARD["window_mtp_top1"]) / 16, rel=1e-12)
    out = tmp_path / "eval.json"
    assert main(["train", "eval", "--model", str(MODEL), "--out", str(out), "--heldout-tokens",
                 str(windows * per_window), "--per-level", "2"]) == 0
    got = json.loads(out.read_text())
    # fp32 on another CPU: the same sums up to the GEMM library's kernel choice (~1e-6)
    assert got["window_loss"] == pytest.approx(CARD["window_loss"][picked], rel=1e-4)
    assert got["window_mtp_top1"] == pytest.approx(CARD["window_mtp_top1"][picked], abs=2e-3)
    assert got["heldout_loss"] == pytest.approx(sum(got["window_loss"]) / windows, rel=1e-12)
    assert (got["heldout_tokens"] == windows * per_window
            and set(got["task_chat"]["by_level"]) == {str(i) for i in range(1, 7)})
    assert 0.0 <= got["easy_chat_accuracy"] <= 1.0 and got["samples"]
