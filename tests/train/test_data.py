"""Tests for dsv4.train.data on a reduced corpus: determinism, held-out disjointness, task-token
fraction, the digit-splitting tokenizer, the chat template and reproducible batches."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from dsv4.checkpoint.tokenizer import ASSISTANT_TOKEN, BOS_TOKEN, EOS_TOKEN, USER_TOKEN, render_chat
from dsv4.tasks.arithmetic import Problem, is_heldout
from dsv4.train.data import (
    HELDOUT_FILE,
    TRAIN_FILE,
    DataMeta,
    TokenStream,
    is_heldout_file,
    prepare_data,
    select_stdlib_files,
)

MAX_TEXT_BYTES = 300_000
FILES = ("tokenizer.json", "tokenizer_config.json", TRAIN_FILE, HELDOUT_FILE, "meta.json")
PROBLEM_RE = re.compile(r"(?:^|What is )(\d+)([-+*])(\d+)(?:=|\?)", re.MULTILINE)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, DataMeta]:
    out = tmp_path_factory.mktemp("data")
    return out, prepare_data(out, seed=0, max_text_bytes=MAX_TEXT_BYTES, progress=False)


@pytest.fixture(scope="module")
def tok(built: tuple[Path, DataMeta]) -> Tokenizer:
    return Tokenizer.from_file(str(built[0] / "tokenizer.json"))


def _documents(tok: Tokenizer, path: Path) -> list[str]:
    """Decode a token file into its documents (split before every bos; bos and eos kept)."""
    ids = np.fromfile(path, dtype=np.uint16)
    starts = np.flatnonzero(ids == tok.token_to_id(BOS_TOKEN)).tolist() + [len(ids)]
    bounds = zip(starts[:-1], starts[1:], strict=True)
    return [tok.decode(ids[a:b].tolist(), skip_special_tokens=False) for a, b in bounds]


def _problems(docs: list[str]) -> list[Problem]:
    out = []
    for doc in docs:
        for a, op, b in PROBLEM_RE.findall(doc):
            out.append(Problem(f"{a}{op}{b}=", "", op, 0))
    return out


def test_deterministic(built: tuple[Path, DataMeta], tmp_path: Path) -> None:
    out, meta = built
    assert prepare_data(tmp_path, seed=0, max_text_bytes=MAX_TEXT_BYTES, progress=False) == meta
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (out / name).read_bytes(), name


def test_seed_changes_tasks_not_text(built: tuple[Path, DataMeta], tmp_path: Path) -> None:
    out, meta = built
    other = prepare_data(tmp_path, seed=1, max_text_bytes=MAX_TEXT_BYTES, progress=False)
    assert other.train_sha256 != meta.train_sha256
    assert ((other.num_train_files, other.train_text_bytes)
            == (meta.num_train_files, meta.train_text_bytes))


def test_meta_matches_files(built: tuple[Path, DataMeta]) -> None:
    out, meta = built
    assert DataMeta.load(out) == meta
    assert json.loads((out / "meta.json").read_text())["seed"] == 0
    for name, sha, count in ((TRAIN_FILE, meta.train_sha256, meta.train_tokens),
                             (HELDOUT_FILE, meta.heldout_sha256, meta.heldout_tokens)):
        data = (out / name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == sha and len(data) == 2 * count
    assert meta.train_tokens == meta.train_text_tokens + meta.train_task_tokens
    assert meta.heldout_tokens == meta.heldout_text_tokens + meta.heldout_task_tokens > 0
    assert meta.vocab_size == 4096 and meta.num_heldout_files >= 1


def test_task_token_fraction(built: tuple[Path, DataMeta]) -> None:
    meta = built[1]
    assert 0.29 <= meta.task_token_fraction <= 0.31
    # both task forms are present
    assert 0.2 <= meta.train_chat_tokens / meta.train_task_tokens <= 0.6
    assert 0.29 <= meta.heldout_task_tokens / meta.heldout_tokens <= 0.35


def test_documents_framed_by_bos_and_eos(built: tuple[Path, DataMeta], tok: Tokenizer) -> None:
    for name in (TRAIN_FILE, HELDOUT_FILE):
        docs = _documents(tok, built[0] / name)
        assert docs and all(d.startswith(BOS_TOKEN) and d.endswith(EOS_TOKEN) for d in docs)


def test_heldout_files_disjoint(built: tuple[Path, DataMeta], tok: Tokenizer) -> None:
    train_files, heldout_files, _ = select_stdlib_files(MAX_TEXT_BYTES)
    assert (len(train_files) == built[1].num_train_files
            and len(heldout_files) == built[1].num_heldout_files)
    assert all(is_heldout_file(f.rel_path) for f in heldout_files)
    assert not any(is_heldout_file(f.rel_path) for f in train_files)
    train_docs = set(_documents(tok, built[0] / TRAIN_FILE))
    heldout_docs = set(_documents(tok, built[0] / HELDOUT_FILE))
    for f in heldout_files:
        assert (BOS_TOKEN + f.text + EOS_TOKEN in heldout_docs
                and BOS_TOKEN + f.text + EOS_TOKEN not in train_docs)
    assert all(BOS_TOKEN + f.text + EOS_TOKEN in train_docs for f in train_files)


def test_heldout_problems_disjoint(built: tuple[Path, DataMeta], tok: Tokenizer) -> None:
    train_problems = _problems(_documents(tok, built[0] / TRAIN_FILE))
    heldout_problems = _problems(_documents(tok, built[0] / HELDOUT_FILE))
    assert len(train_problems) > 1000 and len(heldout_problems) > 50
    assert not any(is_heldout(p) for p in train_problems)
    assert all(is_heldout(p) for p in heldout_problems)


def test_tokenizer_splits_digits(tok: Tokenizer) -> None:
    enc = tok.encode("347+58=405\nx = 1000000", add_special_tokens=False)
    assert [t for t in enc.tokens if any(c.isdigit() for c in t)] == list("347584051000000")
    assert all(len(t) == 1 for t in tok.get_vocab() if any(c in "0123456789" for c in t))


@pytest.mark.parametrize("text", ["def f(x: int = 12) -> str:\n\treturn f'{x:04d}'  # 3.14\r\n",
                                  "  Grüße, 世界! 🚀 \u200b end ", "12345*678=8369910\n", ""])
def test_tokenizer_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text).ids
    assert ids[0] == tok.token_to_id(BOS_TOKEN)
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_chat_template_renders(built: tuple[Path, DataMeta], tok: Tokenizer) -> None:
    cfg = json.loads((built[0] / "tokenizer_config.json").read_text(encoding="utf-8"))
    messages = [{"role": "user", "content": "What is 3+4?"}, {"role": "assistant", "content": "7"}]
    text = render_chat(messages)
    assert text == f"{BOS_TOKEN}{USER_TOKEN}What is 3+4?{ASSISTANT_TOKEN}7{EOS_TOKEN}"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids[:2] == [0, 2] and ids[-2:] == [tok.token_to_id("7"), 1]
    jinja2 = pytest.importorskip("jinja2")
    template = jinja2.Environment().from_string(cfg["chat_template"])
    for add_generation_prompt in (False, True):
        expected = render_chat(messages + [{"role": "user", "content": "hi"}],
                               add_generation_prompt)
        assert template.render(messages=messages + [{"role": "user", "content": "hi"}],
                               bos_token=cfg["bos_token"], eos_token=cfg["eos_token"],
                               add_generation_prompt=add_generation_prompt) == expected


def test_batch_depends_only_on_seed_and_step(built: tuple[Path, DataMeta]) -> None:
    out = built[0]
    stream, resumed = TokenStream(out, seed=3), TokenStream(out, seed=3)
    for step in (5, 0, 5):
        assert torch.equal(stream.batch(step, 4, 128), resumed.batch(step, 4, 128))
    batch = stream.batch(0, 4, 128)
    assert batch.shape == (4, 129) and batch.dtype == torch.int64
    assert not torch.equal(batch, stream.batch(1, 4, 128))
    assert not torch.equal(batch, TokenStream(out, seed=4).batch(0, 4, 128))
    train = torch.from_numpy(np.fromfile(out / TRAIN_FILE, dtype=np.uint16).astype(np.int64))
    windows = train.unfold(0, 129, 1)  # every contiguous window of 129 tokens
    assert all(bool((windows == row).all(dim=1).any()) for row in batch)


def test_heldout_batches(built: tuple[Path, DataMeta]) -> None:
    out, meta = built
    stream = TokenStream(out)
    batches = stream.heldout_batches(seq_len=256, max_tokens=4096, batch_size=6)
    assert [b.shape[0] for b in batches] == [6, 6, 4] and all(b.shape[1] == 257 for b in batches)
    again = stream.heldout_batches(seq_len=256, max_tokens=4096, batch_size=6)
    assert all(torch.equal(a, b) for a, b in zip(batches, again, strict=True))
    heldout = torch.from_numpy(np.fromfile(out / HELDOUT_FILE, dtype=np.uint16).astype(np.int64))
    starts = []
    for row in torch.cat(batches):
        (start,) = [s for s in range(0, len(heldout) - 256, 256)
                    if torch.equal(heldout[s : s + 257], row)][:1]
        starts.append(start)
    # distinct aligned windows: no target token is scored twice
    assert starts == sorted(set(starts))
    assert starts[-1] > meta.heldout_text_tokens  # the spread reaches the held-out task documents
    assert stream.heldout_batches(seq_len=256, max_tokens=100) == []


def test_invalid_arguments(built: tuple[Path, DataMeta], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        prepare_data(tmp_path, vocab_size=70_000, max_text_bytes=1000)
    with pytest.raises(ValueError, match="task_fraction"):
        prepare_data(tmp_path, task_fraction=1.0, max_text_bytes=1000)
    stream = TokenStream(built[0])
    with pytest.raises(ValueError, match="seq_len"):
        stream.batch(0, 2, 10**9)
    with pytest.raises(ValueError, match="step"):
        stream.batch(-1, 2, 16)
