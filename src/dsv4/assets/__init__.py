"""The embedded default model: what `dsv4 serve` and `dsv4 generate` use without `--model`.

Owns `default_model_path()` — the trained dsv4-tiny checkpoint committed in `assets/tiny/`
(official FP8/FP4 layout, tokenizer, model card `README.md`, the held-out tokens its card was
measured on) — and the marker that labels random-weight checkpoints: `dsv4 init` writes
`GENERATED_MARKER` into every checkpoint it creates, which is how `/v1/models` knows to report
`random_weights: true`.
"""

from __future__ import annotations

import json
from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent
DEFAULT_MODEL = "tiny"
GENERATED_MARKER = "dsv4_generated.json"
"""Written by `dsv4 init`: `{"preset": ..., "seed": ..., "random_weights": true}`."""


def is_random_weights(path: str | Path) -> bool:
    """True when `path` is a checkpoint written with random weights (it carries the marker file)."""
    marker = Path(path) / GENERATED_MARKER
    if not marker.is_file():
        return False
    return bool(json.loads(marker.read_text()).get("random_weights", False))


def default_model_path() -> Path:
    """The embedded trained model directory (`assets/tiny`)."""
    target = ASSETS_DIR / DEFAULT_MODEL
    if not ((target / "config.json").is_file() and (target / "tokenizer.json").is_file()):
        raise FileNotFoundError(f"the embedded model is missing from {target}: "
                                "reinstall dsv4 (or pass --model)")
    return target
