"""Tokenizer for freshly initialised checkpoints (`dsv4 init`).

A new checkpoint needs a real, loadable tokenizer even though its weights are
random. `build_tokenizer` trains a small byte-level BPE with the
`tokenizers` library and writes `tokenizer.json` plus `tokenizer_config.json`
in the layout that DeepSeek checkpoints use, so the serving and RL code paths see
the same files as with a released model:

* special tokens `<｜begin▁of▁sentence｜>` (id 0, bos), `<｜end▁of▁sentence｜>`
  (id 1, eos), `<｜User｜>` (id 2) and `<｜Assistant｜>` (id 3);
* byte-level pre-tokenizer and decoder without a prefix space, so any text,
  including arbitrary unicode, round-trips exactly;
* a post-processor that puts bos in front of every encoded sequence;
* a DeepSeek-style chat template in `tokenizer_config.json` (and `render_chat`, the
  same template in Python, for code that must not depend on jinja2).

The pieces (`train_bpe`, `save_tokenizer`) are shared with the training-data recipe
(`dsv4.train.data`), which trains on its own corpus and splits digits individually.

The training text must exist offline on every machine, so it is a fixed list of
the Python standard library's own source files (about 1.8 MB, capped at 2 MB),
optionally followed by caller-supplied `seed_text`. Training is deterministic:
two builds with the same arguments on the same Python installation produce
byte-identical files. (A different Python version ships different stdlib
sources and therefore yields a different, equally valid, tokenizer.)
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from dsv4.utils.logging import init_logger

logger = init_logger(__name__)

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
# Order matters: the trainer assigns ids in this order, so bos = 0 and eos = 1.
SPECIAL_TOKENS: tuple[str, ...] = (BOS_TOKEN, EOS_TOKEN, USER_TOKEN, ASSISTANT_TOKEN)

MIN_VOCAB_SIZE = 300
"""Smallest accepted `vocab_size`: 256 byte tokens + specials + some merges."""

MAX_TOKENIZER_VOCAB = 4096
"""Tokenizer vocab is capped here; a larger model vocab simply leaves rows unused."""

DEFAULT_MODEL_MAX_LENGTH = 131072

CORPUS_MAX_BYTES = 2 * 1024 * 1024
"""Upper bound on the stdlib text used for training (keeps the build fast)."""

# Relative to the stdlib directory. Long-lived modules with plenty of code,
# docstrings and comments; files missing from a given Python version are skipped.
# Kept sorted so the corpus order (and hence the result) is fixed.
CORPUS_FILES: tuple[str, ...] = (
    "abc.py",
    "argparse.py",
    "ast.py",
    "base64.py",
    "bisect.py",
    "calendar.py",
    "cmd.py",
    "codecs.py",
    "configparser.py",
    "contextlib.py",
    "copy.py",
    "csv.py",
    "dataclasses.py",
    "difflib.py",
    "enum.py",
    "fnmatch.py",
    "fractions.py",
    "functools.py",
    "gettext.py",
    "glob.py",
    "gzip.py",
    "heapq.py",
    "hmac.py",
    "inspect.py",
    "ipaddress.py",
    "json/__init__.py",
    "json/decoder.py",
    "json/encoder.py",
    "logging/__init__.py",
    "numbers.py",
    "operator.py",
    "optparse.py",
    "pprint.py",
    "queue.py",
    "random.py",
    "sched.py",
    "secrets.py",
    "shlex.py",
    "shutil.py",
    "statistics.py",
    "string.py",
    "subprocess.py",
    "tempfile.py",
    "textwrap.py",
    "threading.py",
    "tokenize.py",
    "traceback.py",
    "typing.py",
    "uuid.py",
    "warnings.py",
    "weakref.py",
)

# DeepSeek-style template: bos, optional system prompt, then alternating
# <｜User｜>/<｜Assistant｜> turns, each assistant turn closed by eos.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}"
    "{{ '" + USER_TOKEN + "' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '" + ASSISTANT_TOKEN + "' + message['content'] + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '" + ASSISTANT_TOKEN + "' }}"
    "{% endif %}"
)


def _stdlib_corpus(files: Sequence[str] = CORPUS_FILES,
                   max_bytes: int = CORPUS_MAX_BYTES) -> list[str]:
    """Read the training texts from the standard library, at most `max_bytes` in all."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    budget = max_bytes
    for rel in files:
        path = stdlib / rel
        if budget <= 0:
            break
        if not path.is_file():
            logger.debug("corpus file %s not present; skipping", path)
            continue
        data = path.read_bytes()[:budget]
        budget -= len(data)
        texts.append(data.decode("utf-8", errors="ignore"))
    if not texts:
        logger.warning(
            "no standard-library sources found under %s; the tokenizer will have "
            "(almost) no merges beyond the byte alphabet",
            stdlib,
        )
    return texts


def render_chat(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = False) -> str:
    """`CHAT_TEMPLATE` rendered in plain Python (identical output; tested against jinja2)."""
    parts = [BOS_TOKEN]
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "system":
            parts.append(content)
        elif role == "user":
            parts.append(USER_TOKEN + content)
        elif role == "assistant":
            parts.append(ASSISTANT_TOKEN + content + EOS_TOKEN)
    if add_generation_prompt:
        parts.append(ASSISTANT_TOKEN)
    return "".join(parts)


def _new_tokenizer(split_digits: bool = False) -> Tokenizer:
    """An untrained byte-level BPE pipeline; `split_digits` makes every digit its own token."""
    tokenizer = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split_digits:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _add_bos_post_processor(tokenizer: Tokenizer) -> None:
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    if bos_id != 0 or tokenizer.token_to_id(EOS_TOKEN) != 1:
        raise RuntimeError(
            f"special token ids are bos={bos_id}, eos={tokenizer.token_to_id(EOS_TOKEN)}; "
            "expected 0 and 1"
        )
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN}:0 $A:0",
                pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )


def _tokenizer_config(model_max_length: int) -> dict[str, object]:
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }


def build_tokenizer(
    out_dir: Path,
    vocab_size: int,
    *,
    seed_text: str | None = None,
    model_max_length: int = DEFAULT_MODEL_MAX_LENGTH,
) -> int:
    """Train a byte-level BPE tokenizer and write it into `out_dir`; return its vocabulary size.

    `out_dir` is the checkpoint directory, created if missing; `tokenizer.json` and
    `tokenizer_config.json` in it are overwritten. `vocab_size` is the model's vocabulary size
    (embedding rows): the tokenizer gets `min(vocab_size, 4096)` entries at most, never more than
    `vocab_size`. `seed_text` is extra training text, used in addition to the stdlib sources
    (e.g. to bias merges towards a domain). `model_max_length` is written to
    `tokenizer_config.json`. The returned size counts the special tokens.

    Raises `ValueError` if `vocab_size` < 300, too small for the 256 byte tokens, the special
    tokens and a useful number of merges.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} is too small for a byte-level BPE tokenizer "
            f"(256 byte tokens + {len(SPECIAL_TOKENS)} special tokens); "
            f"need vocab_size >= {MIN_VOCAB_SIZE}"
        )
    if model_max_length <= 0:
        raise ValueError(f"model_max_length must be positive, got {model_max_length}")
    target = min(vocab_size, MAX_TOKENIZER_VOCAB)

    texts = _stdlib_corpus()
    if seed_text:
        texts.append(seed_text)
    n_chars = sum(len(t) for t in texts)
    logger.info("training byte-level BPE tokenizer: target vocab %d, %d chars of text",
                target, n_chars)

    tokenizer = train_bpe(texts, target)
    actual = tokenizer.get_vocab_size(with_added_tokens=True)
    save_tokenizer(tokenizer, out_dir, model_max_length)
    logger.info("wrote tokenizer (%d tokens) to %s", actual, out_dir)
    return actual


def train_bpe(texts: Sequence[str], vocab_size: int, *, split_digits: bool = False) -> Tokenizer:
    """Train the byte-level BPE (specials first, bos post-processor) on `texts`; deterministic.

    The result has at most `vocab_size` tokens, special tokens included.
    """
    tokenizer = _new_tokenizer(split_digits)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )

    def _iter_texts() -> Iterator[str]:
        yield from texts

    tokenizer.train_from_iterator(_iter_texts(), trainer=trainer, length=len(texts))
    _add_bos_post_processor(tokenizer)
    actual = tokenizer.get_vocab_size(with_added_tokens=True)
    if actual > vocab_size:  # the trainer counts specials and bytes in its budget; guard anyway
        raise RuntimeError(f"trained tokenizer has {actual} tokens, "
                           f"more than vocab_size={vocab_size}")
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out_dir: Path,
                   model_max_length: int = DEFAULT_MODEL_MAX_LENGTH) -> None:
    """Write `tokenizer.json` and `tokenizer_config.json` (with chat template) into `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=True)
    config_text = json.dumps(_tokenizer_config(model_max_length), indent=2,
                             ensure_ascii=False) + "\n"
    (out_dir / "tokenizer_config.json").write_text(config_text, encoding="utf-8")
