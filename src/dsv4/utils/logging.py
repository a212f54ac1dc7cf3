"""Logging setup for dsv4.

Every module gets its own logger via `init_logger(__name__)`. All of them live
under the `dsv4` logger, which receives exactly one stream handler (stderr) the
first time `init_logger` is called. The level comes from the `DSV4_LOG_LEVEL`
environment variable (default `INFO`), read at that first call.

No state is kept here beyond what `logging` itself keeps: whether the
`dsv4` logger is configured is decided by looking at its handlers.
"""

from __future__ import annotations

import logging
import os

_ROOT_NAME = "dsv4"
_FORMAT = "[%(asctime)s %(levelname)s %(name)s] %(message)s"
_LEVEL_ENV = "DSV4_LOG_LEVEL"
_DEFAULT_LEVEL = "INFO"


def _configure_root(root: logging.Logger) -> None:
    """Attach the single stream handler to `root` unless it already has one."""
    if root.handlers:
        return
    requested = os.environ.get(_LEVEL_ENV, _DEFAULT_LEVEL).strip().upper() or _DEFAULT_LEVEL
    level = logging.getLevelNamesMapping().get(requested)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(_FORMAT))
    root.addHandler(handler)
    root.setLevel(level if level is not None else logging.INFO)
    # dsv4 prints through its own handler; propagating as well would print every
    # record twice in applications that configure the Python root logger.
    root.propagate = False
    if level is None:
        root.warning("ignoring unknown %s=%r; using %s", _LEVEL_ENV, requested, _DEFAULT_LEVEL)


def init_logger(name: str) -> logging.Logger:
    """Return the logger for module `name`, configuring the `dsv4` logger once.

    Names outside the `dsv4` hierarchy (e.g. `__main__`) are placed under it
    as `dsv4.<name>` so that they share its handler and level.
    """
    root = logging.getLogger(_ROOT_NAME)
    _configure_root(root)
    if name != _ROOT_NAME and not name.startswith(_ROOT_NAME + "."):
        name = f"{_ROOT_NAME}.{name}"
    return logging.getLogger(name)
