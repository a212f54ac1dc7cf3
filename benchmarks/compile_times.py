"""Triton JIT builds and their seconds inside a scope: which kernel specialisation makes a cold
start slow.

`CompileLog` installs Triton's `jit_cache_hook` (called before a specialisation missing from a
kernel's in-memory cache is built) and `jit_post_compile_hook` (after it is built) and records
each build with the current `phase`: a load from the on-disk cache (well under a second) or a
real compile (LLVM + ptxas). A compile runs on the host, in the launching thread, before the
kernel is queued: one slow specialisation is otherwise a silent gap between two steps. The
hooks before the scope are restored on exit. The interpreter (`TRITON_INTERPRET=1`) builds
nothing: no records.

    with CompileLog() as log:
        warm_up(engine)
        log.phase = "first"
        ...
    log.summary()        # per phase: count, seconds, builds per kernel
    log.slowest(5)       # the slowest builds with their constexprs
    log.builds(skip=("warmup",))    # every later build with its constexprs
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import Any


class CompileLog:
    """Context manager: one record per Triton specialisation built in its scope (module
    docstring): phase, kernel, seconds, key, constexprs by parameter name."""

    def __init__(self, phase: str = "warmup") -> None:
        self.phase = phase
        self.records: list[dict[str, Any]] = []
        self._started: dict[str, float] = {}
        self._saved: tuple[Any, Any] | None = None

    def __enter__(self) -> CompileLog:
        from triton import knobs

        self._saved = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
        knobs.runtime.jit_cache_hook = self._before
        knobs.runtime.jit_post_compile_hook = self._after
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        from triton import knobs

        assert self._saved is not None, "exit without enter"
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._saved
        self._saved = None

    def _before(self, *, key: Any, repr: str, fn: Any, **_: Any) -> bool:  # noqa: A002
        self._started[repr] = time.perf_counter()
        return False                          # False: build it as usual

    def _after(self, *, key: Any, repr: str, fn: Any, **kw: Any) -> bool:  # noqa: A002
        took = time.perf_counter() - self._started.pop(repr, time.perf_counter())
        compiled = kw.get("compile") or {}
        names = list(compiled.get("signature", {}))
        constants = {names[k[0]] if k and k[0] < len(names) else str(k): _plain(v)
                     for k, v in compiled.get("constants", {}).items()}
        self.records.append({"phase": self.phase, "kernel": getattr(fn, "name", str(fn)),
                             "s": round(took, 3), "key": str(key)[:1500],
                             "constants": constants})
        return False

    def summary(self) -> dict[str, Any]:
        """Per phase: builds, their seconds, builds per kernel."""
        out: dict[str, Any] = {}
        for r in self.records:
            phase = out.setdefault(r["phase"], {"count": 0, "s": 0.0, "kernels": {}})
            phase["count"] += 1
            phase["s"] = round(phase["s"] + r["s"], 3)
            phase["kernels"][r["kernel"]] = phase["kernels"].get(r["kernel"], 0) + 1
        return out

    def builds(self, skip: tuple[str, ...] = ()) -> list[list[Any]]:
        """Every build outside the `skip` phases, in order, as [phase, kernel, seconds,
        constexprs, key] (the key holds the argument specialisations: dtypes, and which integers
        were 1 or multiples of 16, a build of its own each)."""
        return [[r["phase"], r["kernel"], r["s"], r["constants"], r["key"]] for r in self.records
                if r["phase"] not in skip]

    def slowest(self, top: int = 5) -> list[list[Any]]:
        """The `top` slowest builds as [phase, kernel, seconds, constexprs]."""
        ranked = sorted(self.records, key=lambda r: -r["s"])[:top]
        return [[r["phase"], r["kernel"], r["s"], r["constants"]] for r in ranked]


def _plain(value: Any) -> Any:
    """A JSON-writable constexpr value (numbers, bools, strings and None as they are)."""
    return value if value is None or isinstance(value, (int, float, bool, str)) else str(value)
