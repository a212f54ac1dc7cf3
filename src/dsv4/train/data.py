"""The training-data recipe for small models: corpus, tokenizer and token files, built offline.

Owns `prepare_data` (and its `DataMeta`) and `TokenStream`. Everything is made from material
that exists on a fresh machine, so the recipe reproduces anywhere with the same Python:

* real text: the Python standard library's `.py` sources (site-packages excluded, non-UTF-8
  files skipped), one document per file. Files are taken library-first, then the test suites,
  each group in a fixed hash order, until `max_text_bytes` is reached;
* task text: generated arithmetic (`dsv4.tasks.arithmetic`), as blocks of solved lines
  (`12+34=46\\n...`) and as chat conversations rendered with the checkpoint chat template. Levels
  are mixed by `LEVEL_WEIGHTS` (easy dominate, hard appear); task documents are added until they
  make up `task_fraction` of the training tokens.

Held-out split: stdlib files whose path hashes to 0 mod `HELDOUT_FILE_MODULUS` (~2%, never
trained on, not even by the tokenizer) and task documents drawn from the held-out problem split,
which is disjoint from the training problems by construction.

Output files in `out_dir`:

    tokenizer.json, tokenizer_config.json
                  byte-level BPE, digits split individually, chat template
    train.bin     uint16 token ids; documents (bos ... eos) in a seeded shuffled order
    heldout.bin   uint16 token ids; held-out text documents, then held-out task documents
    meta.json     `DataMeta`: versions, counts, task-token fraction, sha256 of each .bin, seed

Invariant: the same arguments on the same Python / tokenizers versions give byte-identical
files. `TokenStream.batch(step, ...)` depends only on (seed, step), so a resumed run sees the same
batches.

Test: `pytest tests/train/test_data.py`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import platform
import random
import sysconfig
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import tokenizers
import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from dsv4.checkpoint.tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    MIN_VOCAB_SIZE,
    render_chat,
    save_tokenizer,
    train_bpe,
)
from dsv4.tasks.arithmetic import LEVELS, Split, chat_messages, sample_problem
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)

TRAIN_FILE, HELDOUT_FILE, META_FILE = "train.bin", "heldout.bin", "meta.json"
TOKEN_DTYPE = np.uint16
FORMAT_VERSION = 1

DEFAULT_MAX_TEXT_BYTES = 26_000_000
"""~7.9M text tokens; with 30% task tokens train.bin holds ~11.3M tokens (~23 MB)."""
DEFAULT_TASK_FRACTION = 0.30
HELDOUT_FILE_MODULUS = 50
"""A stdlib file is held out when the hash of its relative path is 0 mod this (~2%)."""

LEVEL_WEIGHTS: tuple[float, ...] = (0.25, 0.20, 0.18, 0.15, 0.12, 0.10)
"""Sampling weight of each difficulty level (1..6) in task documents."""
CHAT_DOC_PROB = 0.75
"""Probability that a task document is a chat conversation rather than a block of solved lines."""
BLOCK_LINES = (4, 32)
MAX_CHAT_TURNS = 4
TOKENIZER_TASK_DOCS = 4000
"""The first training task documents, added to the tokenizer's training text."""
_ENCODE_CHUNK = 1024


@dataclass(frozen=True)
class SourceFile:
    """One stdlib source: its posix path relative to the stdlib directory, and its text."""

    rel_path: str
    text: str


@dataclass(frozen=True)
class DataMeta:
    """What `prepare_data` built (written as `meta.json`); token counts include bos and eos."""

    format_version: int
    seed: int
    vocab_size: int
    python_version: str
    tokenizers_version: str
    max_text_bytes: int
    task_fraction_target: float
    num_train_files: int
    num_heldout_files: int
    num_skipped_files: int
    train_text_bytes: int
    heldout_text_bytes: int
    num_train_task_docs: int
    num_heldout_task_docs: int
    train_tokens: int
    train_text_tokens: int
    train_task_tokens: int
    train_chat_tokens: int
    task_token_fraction: float
    heldout_tokens: int
    heldout_text_tokens: int
    heldout_task_tokens: int
    train_sha256: str
    heldout_sha256: str

    def save(self, out_dir: Path) -> None:
        text = json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"
        (Path(out_dir) / META_FILE).write_text(text, encoding="utf-8")

    @classmethod
    def load(cls, data_dir: Path) -> DataMeta:
        return cls(**json.loads((Path(data_dir) / META_FILE).read_text(encoding="utf-8")))


def _path_hash(rel_path: str) -> int:
    return int.from_bytes(hashlib.blake2b(rel_path.encode("utf-8"), digest_size=8).digest(),
                          "little")


def is_heldout_file(rel_path: str) -> bool:
    """Whether the stdlib file at `rel_path` (posix, relative to the stdlib dir) is held out."""
    return _path_hash(rel_path) % HELDOUT_FILE_MODULUS == 0


def _is_test(rel_path: str) -> bool:
    return any(part in ("test", "tests", "idle_test") for part in rel_path.split("/")[:-1])


def stdlib_files() -> list[str]:
    """Relative paths of the stdlib `.py` files, sorted, site-packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rels = (p.relative_to(root).as_posix() for p in root.rglob("*.py") if p.is_file())
    return sorted(r for r in rels if "site-packages" not in r.split("/"))


def select_stdlib_files(max_text_bytes: int) -> tuple[list[SourceFile], list[SourceFile], int]:
    """(train files, held-out files, number skipped as non-UTF-8), each list sorted by path.

    Files are visited library-first, then tests, in hash order; train files are taken until
    `max_text_bytes` is reached, held-out files until 1/HELDOUT_FILE_MODULUS of it (at least one).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    order = sorted(stdlib_files(), key=lambda r: (_is_test(r), _path_hash(r), r))
    budgets = {True: max(1, max_text_bytes // HELDOUT_FILE_MODULUS), False: max_text_bytes}
    used = {True: 0, False: 0}
    chosen: dict[bool, list[SourceFile]] = {True: [], False: []}
    num_skipped = 0
    for rel in order:
        if all(used[k] >= budgets[k] for k in budgets):
            break
        heldout = is_heldout_file(rel)
        if used[heldout] >= budgets[heldout]:
            continue
        data = (root / rel).read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            num_skipped += 1
            continue
        chosen[heldout].append(SourceFile(rel, text))
        used[heldout] += len(data)
    train, held = (sorted(chosen[k], key=lambda f: f.rel_path) for k in (False, True))
    return train, held, num_skipped


def _level(rng: random.Random) -> int:
    return rng.choices(LEVELS, weights=LEVEL_WEIGHTS)[0]


def _block_doc(rng: random.Random, split: Split) -> str:
    lines = (sample_problem(rng, _level(rng), split=split).text
             for _ in range(rng.randint(*BLOCK_LINES)))
    return BOS_TOKEN + "".join(line + "\n" for line in lines) + EOS_TOKEN


def _chat_doc(rng: random.Random, split: Split) -> str:
    turns = rng.randint(1, MAX_CHAT_TURNS)
    messages = [m for _ in range(turns)
                for m in chat_messages(sample_problem(rng, _level(rng), split=split))]
    return render_chat(messages)  # bos first; every assistant turn (so the document) ends with eos


def task_documents(rng: random.Random, split: Split) -> Iterator[tuple[bool, str]]:
    """Endless task documents `(is_chat, text)`, each text starting with bos and ending with
    eos."""
    while True:
        is_chat = rng.random() < CHAT_DOC_PROB
        yield is_chat, (_chat_doc if is_chat else _block_doc)(rng, split)


@dataclass
class _Tokens:
    """Encoded documents of one kind, with their token count."""

    docs: list[np.ndarray]
    num_tokens: int = 0
    num_chat_tokens: int = 0


def _encode_text_files(tokenizer: Tokenizer, files: list[SourceFile], progress: bool) -> _Tokens:
    bos, eos = tokenizer.token_to_id(BOS_TOKEN), tokenizer.token_to_id(EOS_TOKEN)
    out = _Tokens(docs=[])
    with tqdm(total=sum(len(f.text) for f in files), unit="char", desc="tokenize text",
              disable=not progress) as bar:
        for start in range(0, len(files), 64):
            chunk = files[start : start + 64]
            for enc in tokenizer.encode_batch([f.text for f in chunk], add_special_tokens=False):
                out.docs.append(np.array([bos, *enc.ids, eos], dtype=TOKEN_DTYPE))
                out.num_tokens += len(out.docs[-1])
            bar.update(sum(len(f.text) for f in chunk))
    return out


def _encode_task_docs(tokenizer: Tokenizer, docs: Iterator[tuple[bool, str]], target: int,
                      progress: bool) -> _Tokens:
    """Encode documents from `docs` until at least `target` tokens; the rest is not consumed
    further."""
    out = _Tokens(docs=[])
    with tqdm(total=target, unit="tok", desc="tokenize tasks", disable=not progress) as bar:
        while out.num_tokens < target:
            chunk = list(itertools.islice(docs, _ENCODE_CHUNK))
            encodings = tokenizer.encode_batch([text for _, text in chunk],
                                               add_special_tokens=False)
            for (is_chat, _), enc in zip(chunk, encodings, strict=True):
                if out.num_tokens >= target:
                    break
                out.docs.append(np.array(enc.ids, dtype=TOKEN_DTYPE))
                out.num_tokens += len(enc.ids)
                out.num_chat_tokens += len(enc.ids) if is_chat else 0
                bar.update(len(enc.ids))
    return out


def _task_target(text_tokens: int, task_fraction: float) -> int:
    return int(np.ceil(text_tokens * task_fraction / (1.0 - task_fraction)))


def _write_tokens(path: Path, docs: list[np.ndarray]) -> str:
    """Write the concatenated documents; returns the file's sha256."""
    flat = np.concatenate(docs) if docs else np.zeros(0, dtype=TOKEN_DTYPE)
    data = flat.astype(TOKEN_DTYPE).tobytes()
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def _check_args(vocab_size: int, max_text_bytes: int, task_fraction: float) -> None:
    if not MIN_VOCAB_SIZE <= vocab_size <= np.iinfo(TOKEN_DTYPE).max + 1:
        raise ValueError(f"vocab_size={vocab_size} must be in [{MIN_VOCAB_SIZE}, 65536] "
                         "(uint16 token files)")
    if max_text_bytes <= 0:
        raise ValueError(f"max_text_bytes must be positive, got {max_text_bytes}")
    if not 0.0 <= task_fraction < 1.0:
        raise ValueError(f"task_fraction must be in [0, 1), got {task_fraction}")


def prepare_data(
    out_dir: Path,
    seed: int = 0,
    vocab_size: int = 4096,
    *,
    max_text_bytes: int = DEFAULT_MAX_TEXT_BYTES,
    task_fraction: float = DEFAULT_TASK_FRACTION,
    progress: bool = True,
) -> DataMeta:
    """Build tokenizer, `train.bin`, `heldout.bin` and `meta.json` in `out_dir` (see the module
    doc).

    `out_dir` is created if missing; existing output files are overwritten. `seed` seeds task
    generation and the document order; the stdlib selection does not depend on it. `vocab_size`
    is the tokenizer size, special tokens included (at most 65536: tokens are stored as uint16).
    `max_text_bytes` is the budget of stdlib text for training (UTF-8 bytes); tests pass a small
    one. `task_fraction` is the target share of task tokens among all training tokens.
    `progress` shows tqdm progress bars.
    """
    _check_args(vocab_size, max_text_bytes, task_fraction)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train_files, heldout_files, num_skipped = select_stdlib_files(max_text_bytes)
    logger.info("stdlib text: %d train files, %d held-out files, %d skipped (not UTF-8)",
                len(train_files), len(heldout_files), num_skipped)

    train_task_stream = task_documents(random.Random(f"dsv4-data-{seed}-train-tasks"), "train")
    tokenizer_tasks = list(itertools.islice(train_task_stream, TOKENIZER_TASK_DOCS))
    tokenizer = train_bpe([f.text for f in train_files] + [t for _, t in tokenizer_tasks],
                          vocab_size, split_digits=True)
    save_tokenizer(tokenizer, out_dir)
    logger.info("trained tokenizer: %d tokens", tokenizer.get_vocab_size(with_added_tokens=True))

    train_text = _encode_text_files(tokenizer, train_files, progress)
    train_tasks = _encode_task_docs(tokenizer, itertools.chain(tokenizer_tasks, train_task_stream),
                                    _task_target(train_text.num_tokens, task_fraction), progress)
    heldout_text = _encode_text_files(tokenizer, heldout_files, progress)
    heldout_task_stream = task_documents(random.Random(f"dsv4-data-{seed}-heldout-tasks"),
                                         "heldout")
    heldout_tasks = _encode_task_docs(tokenizer, heldout_task_stream,
                                      _task_target(heldout_text.num_tokens, task_fraction),
                                      progress)

    train_docs = train_text.docs + train_tasks.docs
    random.Random(f"dsv4-data-{seed}-order").shuffle(train_docs)
    train_sha = _write_tokens(out_dir / TRAIN_FILE, train_docs)
    heldout_sha = _write_tokens(out_dir / HELDOUT_FILE, heldout_text.docs + heldout_tasks.docs)

    train_tokens = train_text.num_tokens + train_tasks.num_tokens
    meta = DataMeta(
        format_version=FORMAT_VERSION, seed=seed,
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        python_version=platform.python_version(), tokenizers_version=tokenizers.__version__,
        max_text_bytes=max_text_bytes, task_fraction_target=task_fraction,
        num_train_files=len(train_files), num_heldout_files=len(heldout_files),
        num_skipped_files=num_skipped,
        train_text_bytes=sum(len(f.text.encode()) for f in train_files),
        heldout_text_bytes=sum(len(f.text.encode()) for f in heldout_files),
        num_train_task_docs=len(train_tasks.docs), num_heldout_task_docs=len(heldout_tasks.docs),
        train_tokens=train_tokens, train_text_tokens=train_text.num_tokens,
        train_task_tokens=train_tasks.num_tokens,
        train_chat_tokens=train_tasks.num_chat_tokens,
        task_token_fraction=round(train_tasks.num_tokens / max(train_tokens, 1), 6),
        heldout_tokens=heldout_text.num_tokens + heldout_tasks.num_tokens,
        heldout_text_tokens=heldout_text.num_tokens, heldout_task_tokens=heldout_tasks.num_tokens,
        train_sha256=train_sha, heldout_sha256=heldout_sha,
    )
    meta.save(out_dir)
    logger.info("wrote %s: %d train tokens (task fraction %.3f), %d held-out tokens",
                out_dir, meta.train_tokens, meta.task_token_fraction, meta.heldout_tokens)
    return meta


def _load_tokens(path: Path) -> np.ndarray:
    if path.stat().st_size == 0:  # np.memmap cannot map an empty file
        return np.zeros(0, dtype=TOKEN_DTYPE)
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r")


class TokenStream:
    """Training batches and held-out windows over a directory written by `prepare_data`.

    `batch(step, ...)` draws random windows of `train.bin` from a generator seeded with
    (seed, step) alone, so batch `step` is the same whether or not the run was resumed.
    """

    def __init__(self, data_dir: Path, seed: int = 0) -> None:
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.data_dir, self.seed = Path(data_dir), seed
        self.train = _load_tokens(self.data_dir / TRAIN_FILE)
        self.heldout = _load_tokens(self.data_dir / HELDOUT_FILE)

    def batch(self, step: int, batch_size: int, seq_len: int) -> torch.Tensor:
        """Random windows `[batch_size, seq_len + 1]` (int64) of train.bin: inputs `[:, :-1]`,
        targets `[:, 1:]`."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if not 0 < seq_len < len(self.train):
            raise ValueError(f"seq_len={seq_len} must be in [1, {len(self.train) - 1}] "
                             f"for {len(self.train)} tokens")
        rng = np.random.Generator(np.random.PCG64([self.seed, step]))
        # window end <= len(train)
        starts = rng.integers(0, len(self.train) - seq_len, size=batch_size)
        index = starts[:, None] + np.arange(seq_len + 1)  # [batch_size, seq_len + 1]
        return torch.from_numpy(self.train[index].astype(np.int64))

    def heldout_batches(self, seq_len: int, max_tokens: int,
                        batch_size: int = 8) -> list[torch.Tensor]:
        """Deterministic held-out windows, batched as `[<= batch_size, seq_len + 1]` (int64); see
        `heldout_windows`."""
        return heldout_windows(self.heldout, seq_len, max_tokens, batch_size)


def heldout_windows(tokens: np.ndarray, seq_len: int, max_tokens: int,
                    batch_size: int = 8) -> list[torch.Tensor]:
    """Held-out windows of a flat token array, batched as `[<= batch_size, seq_len + 1]` (int64).

    The array is cut into aligned windows `[i * seq_len, (i + 1) * seq_len + 1)`, so no target
    token is scored twice; `max_tokens // seq_len` of them are taken, evenly spread over the array
    so that held-out text and held-out tasks are both represented.
    """
    if seq_len <= 0 or batch_size <= 0:
        raise ValueError(f"seq_len and batch_size must be positive, "
                         f"got {seq_len} and {batch_size}")
    available = max(0, len(tokens) - 1) // seq_len
    count = min(available, max_tokens // seq_len)
    starts = np.array([(i * available) // count * seq_len for i in range(count)], dtype=np.int64)
    windows = [tokens[s : s + seq_len + 1].astype(np.int64) for s in starts]
    return [torch.from_numpy(np.stack(windows[i : i + batch_size]))
            for i in range(0, count, batch_size)]
