"""The embedded default model: what `dsv4 serve` serves without `--model`.

Owns `default_model_path()`. Until a trained model is committed to `assets/tiny/`, the default is a
deterministic `dsv4 init --preset tiny --seed 0` checkpoint with RANDOM weights, generated on first
use into `assets/tiny/` (git-ignored) — or into `$XDG_CACHE_HOME/dsv4/tiny` when the installed
package is read-only. A generated checkpoint carries the marker file `GENERATED_MARKER`, which is
how `/v1/models` and the CLI know to label it "random weights".

Invariant: a checkpoint directory is either absent or complete. It is written into a temporary
sibling directory and renamed into place, so concurrent first uses (several test processes, say)
never observe a half-written checkpoint; the loser of the rename race discards its copy.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from dsv4.utils.logging import init_logger

logger = init_logger(__name__)

ASSETS_DIR = Path(__file__).resolve().parent
GENERATED_MARKER = "dsv4_generated.json"
"""Written into generated checkpoints: `{"preset": ..., "seed": ..., "random_weights": true}`."""

_PRESET, _SEED = "tiny", 0


def is_random_weights(path: str | Path) -> bool:
    """True when `path` is a checkpoint generated with random weights (it carries the marker file)."""
    marker = Path(path) / GENERATED_MARKER
    if not marker.is_file():
        return False
    return bool(json.loads(marker.read_text()).get("random_weights", False))


def default_model_path() -> Path:
    """The embedded default model directory, generating the random-weight tiny checkpoint if absent."""
    for base in (ASSETS_DIR, _user_cache_dir()):
        target = base / _PRESET
        if _is_complete(target):
            return target
        if _is_writable(base):
            return _generate(target)
    raise RuntimeError(f"cannot write the default model: neither {ASSETS_DIR} nor {_user_cache_dir()} is writable")


def _user_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dsv4"


def _is_complete(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "tokenizer.json").is_file()


def _is_writable(base: Path) -> bool:
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(base, os.W_OK)


def _generate(target: Path) -> Path:
    from dsv4.checkpoint.presets import get_preset
    from dsv4.checkpoint.writer import write_checkpoint

    logger.info("generating the default model (preset %r, seed %d, RANDOM weights) into %s", _PRESET, _SEED, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write_checkpoint(get_preset(_PRESET), tmp, seed=_SEED)
        marker = {"preset": _PRESET, "seed": _SEED, "random_weights": True}
        (tmp / GENERATED_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it private
        tmp.rename(target)
    except OSError:
        if not _is_complete(target):  # not a lost race: a real failure
            raise
        logger.info("another process generated %s first; using it", target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
