"""`dsv4 generate --model PATH "prompt"` prints the same completion as LLM.generate."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsv4 import LLM, SamplingParams
from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import write_checkpoint
from dsv4.cli.main import main


def test_cli_generate_prints_completion(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_checkpoint(micro(), tmp_path, seed=8)
    assert main(["generate", "--model", str(tmp_path), "--max-tokens", "10", "--device", "cpu",
                 "--dtype", "float32", "def fib(n):"]) == 0
    printed = capsys.readouterr().out
    llm = LLM(tmp_path, dtype="float32", device="cpu", page_size=16, max_total_tokens=512)
    expected = llm.generate("def fib(n):", SamplingParams(max_tokens=10, temperature=0.0),
                            use_tqdm=False)[0]
    assert expected.text and printed == expected.text + "\n"


def test_cli_generate_defaults_to_the_embedded_model(capsys: pytest.CaptureFixture[str]) -> None:
    from dsv4.assets import default_model_path

    assert main(["generate", "--max-tokens", "12", "--device", "cpu", "--dtype", "float32",
                 "def add(a, b):"]) == 0
    printed = capsys.readouterr().out
    llm = LLM(default_model_path(), dtype="float32", device="cpu", page_size=128,
              max_total_tokens=512)
    expected = llm.generate("def add(a, b):", SamplingParams(max_tokens=12, temperature=0.0),
                            use_tqdm=False)[0]
    assert expected.text and printed == expected.text + "\n"
