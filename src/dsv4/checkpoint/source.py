"""Model sources: a checkpoint directory, or `in-memory:<preset>` (issue 21 item 5).

`in-memory:<preset>` (`checkpoint/presets.py`: micro, tiny, flash-4l, flash-43l-e16, flash) is a
model of that geometry with random weights built in memory on the target device (the "dummy"
load format; with `weight_format="checkpoint"` the routed experts are FP4 codes built there), so
real-scale geometries are served and benchmarked without writing their checkpoint to disk.
`resolve_model_source` turns it into a directory that holds only the preset's config.json and a
tokenizer (written once under the cache directory, `DSV4_CACHE` or ~/.cache/dsv4, by the same
code as `dsv4 init --no-weights`) and the load format "dummy".
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from dsv4.checkpoint.presets import PRESETS, get_preset
from dsv4.checkpoint.writer import write_checkpoint

IN_MEMORY = "in-memory:"


def cache_dir() -> Path:
    """Where generated model directories live: $DSV4_CACHE, else ~/.cache/dsv4."""
    return Path(os.environ.get("DSV4_CACHE", Path.home() / ".cache" / "dsv4"))


def is_in_memory(model: str | Path) -> bool:
    return str(model).startswith(IN_MEMORY)


def resolve_model_source(model: str | Path, load_format: str) -> tuple[Path, str]:
    """(directory, load format) of a `--model` value. A directory passes through unchanged;
    `in-memory:<preset>` gives the preset's config-and-tokenizer directory and "dummy" (an
    explicit load format other than "dummy" raises, naming the allowed values)."""
    if not is_in_memory(model):
        return Path(model), load_format
    preset = str(model)[len(IN_MEMORY):]
    if preset not in PRESETS:
        raise ValueError(f"model={str(model)!r} is invalid; allowed: {IN_MEMORY}<preset> with "
                         f"preset in {sorted(PRESETS)}, or a checkpoint directory")
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format={load_format!r} with model={str(model)!r} is invalid; "
                         "allowed: 'dummy' (or 'auto', which means it here)")
    return _preset_dir(preset), "dummy"


def _preset_dir(preset: str) -> Path:
    """The preset's config.json + tokenizer directory, written once (atomically: a temporary
    directory renamed into place, so concurrent processes never read a half-written one)."""
    target = cache_dir() / "in-memory" / preset
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{preset}-", dir=target.parent))
    write_checkpoint(get_preset(preset), tmp, weights=False)
    try:
        tmp.rename(target)
    except OSError:             # another process won the race: its directory is complete
        shutil.rmtree(tmp, ignore_errors=True)
    return target
