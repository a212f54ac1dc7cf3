"""A faster Triton interpreter (TRITON_INTERPRET=1) for the CPU runs of the kernels: the test
suite and the benchmarks' `--cpu-smoke`. Never used on the serving path; CUDA never needs it.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any


def skip_overflow_sanitizer() -> None:
    """Turn off the interpreter's integer-overflow sanitizer. It follows every 8-32-bit integer
    add, sub and mul of a kernel with int64 casts and bound compares (a sizeable share of an
    interpreted kernel's CPU time), whose assert Triton drops unless `debug` is on: without `debug`
    (the suite, the benchmarks' `--cpu-smoke`) it checks nothing. Inert if Triton's interpreter
    changes shape."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    builder: Any = getattr(interpreter, "interpreter_builder", None)
    options: Any = getattr(builder, "options", None)
    if (dataclasses.is_dataclass(options) and not isinstance(options, type)
            and hasattr(options, "sanitize_overflow")):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


def skip_nested_interpreter_patching() -> None:
    """Under TRITON_INTERPRET=1 every call of a @triton.jit helper from inside a kernel patches
    triton.language again (`interpreter._patch_lang`: inspect.getmembers over tl, tl.math,
    tl.tensor, ...: a quarter of an interpreted engine step). The kernel's launch
    (`GridExecutor`) has already patched those modules and restores them when it ends, and a
    nested patch's scope is never restored, so a nested call that would patch no module beyond
    those patched since the launch began is skipped: the patched state is the same. A launch's own
    patch, a helper called outside a launch and the first helper of a launch to see a language
    module not yet patched patch as before. Inert if Triton's interpreter changes shape."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if (original is None or executor is None or scope_type is None
            or getattr(original, "nested_skip", False)):
        return
    launches: list[list[Any]] = []          # per running launch: [modules patched, patched yet]

    def langs(fn: Any) -> frozenset[int]:
        return frozenset(id(v) for v in fn.__globals__.values()
                         if inspect.ismodule(v) and v in (tl, tl.core))

    def patch_lang(fn: Any) -> Any:
        mine = langs(fn)
        if launches and launches[-1][1] and mine <= launches[-1][0]:
            return scope_type()             # nothing to patch, nothing to restore
        scope = original(fn)
        if launches:
            # the launch's own patch, or a nested one (never restored: it holds for the rest of
            # the launch), e.g. triton.language.standard's helpers, which also see tl.core
            launches[-1][0] |= mine
            launches[-1][1] = True
        return scope

    launch = executor.__call__

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        launches.append([langs(self.fn), False])
        try:
            return launch(self, *args, **kwargs)
        finally:
            launches.pop()

    patch_lang.nested_skip = True  # type: ignore[attr-defined]
    interpreter._patch_lang = patch_lang
    executor.__call__ = call


def speed_up_interpreter() -> None:
    """Both of the above: what every interpreted run of dsv4's kernels (the test suite, the
    benchmarks' CPU runs) calls before its first launch. Idempotent."""
    skip_nested_interpreter_patching()
    skip_overflow_sanitizer()
