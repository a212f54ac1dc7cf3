"""`dsv4 generate --model PATH "prompt"` prints the same completion as LLM.generate, with and
without `--speculative-num-steps`; the flag's startup errors exit 2 naming it."""

from __future__ import annotations

import logging
import re
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


def test_cli_generate_speculative_prints_the_plain_greedy_completion(
        capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    from dsv4.assets import default_model_path

    logging.getLogger("dsv4").addHandler(caplog.handler)    # dsv4's logs do not propagate
    try:
        assert main(["generate", "--max-tokens", "16", "--device", "cpu", "--dtype", "float32",
                     "--speculative-num-steps", "3", "def add(a, b):"]) == 0
    finally:
        logging.getLogger("dsv4").removeHandler(caplog.handler)
    printed = capsys.readouterr().out
    llm = LLM(default_model_path(), dtype="float32", device="cpu", page_size=128,
              max_total_tokens=512)
    expected = llm.generate("def add(a, b):", SamplingParams(max_tokens=16, temperature=0.0),
                            use_tqdm=False)[0]
    assert expected.text and printed == expected.text + "\n"
    counts = re.search(r"speculative decoding: (\d+) of (\d+) drafts accepted", caplog.text)
    assert counts is not None and 0 <= int(counts[1]) <= int(counts[2]) and int(counts[2]) > 0, \
        caplog.text


def test_cli_generate_speculative_errors_name_the_flag(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--speculative-num-steps", "9", "x"])
    assert exit_.value.code == 2 and "--speculative-num-steps" in capsys.readouterr().err
    write_checkpoint(micro().replace(num_mtp_layers=0), tmp_path, seed=0)
    logging.getLogger("dsv4").addHandler(caplog.handler)
    try:
        assert main(["generate", "--model", str(tmp_path), "--device", "cpu",
                     "--speculative-num-steps", "2", "x"]) == 2
    finally:
        logging.getLogger("dsv4").removeHandler(caplog.handler)
    assert "--speculative-num-steps=2 needs a checkpoint with an MTP block" in caplog.text
