"""`benchmarks/compile_times.py`: the JIT hooks' records, per-phase summary, slowest builds and the
hooks restored on exit. Driven through Triton's own hook slots with the keywords the JIT passes
(`JITFunction._call_hook`), since the interpreter CI runs builds nothing.

Triton is imported inside the tests: an import of triton before TRITON_INTERPRET is set (the
root conftest sets it) defines `tl.max` and the other library functions as compiled-only and
breaks every interpreter test of the process."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from bench_script import load_benchmark


def build(name: str, key: str, seconds: float, constants: dict[tuple[int, ...], Any]) -> None:
    """One build as the JIT reports it: the pre hook, `seconds` of work, the post hook."""
    import triton

    runtime = triton.knobs.runtime
    fn = SimpleNamespace(name=name)
    compiled = {"signature": {"x_ptr": "*bf16", "T": "i32", "BLOCK_S": "constexpr",
                              "APART": "constexpr"}, "constants": constants}
    kw = {"key": key, "repr": f"{name}[{key}]", "fn": fn, "compile": compiled,
          "is_manual_warmup": False, "already_compiled": False}
    assert runtime.jit_cache_hook(**kw) is False
    time.sleep(seconds)
    assert runtime.jit_post_compile_hook(**kw) is False


def test_records_phases_slowest_and_restores_hooks() -> None:
    import triton

    compile_times = load_benchmark("compile_times")
    runtime = triton.knobs.runtime
    before = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
    with compile_times.CompileLog() as log:
        build("_finish", "a", 0.05, {(2,): 64, (3,): True})
        log.phase = "run"
        build("_partial", "b", 0.0, {(2,): 16})
        build("_finish", "c", 0.0, {(2,): 16, (3,): False})
    assert (runtime.jit_cache_hook, runtime.jit_post_compile_hook) == before
    assert [(r["phase"], r["kernel"]) for r in log.records] == [
        ("warmup", "_finish"), ("run", "_partial"), ("run", "_finish")]
    summary = log.summary()
    assert summary["warmup"]["count"] == 1 and summary["warmup"]["s"] >= 0.05
    assert summary["run"]["count"] == 2 and summary["run"]["kernels"] == {"_partial": 1,
                                                                          "_finish": 1}
    phase, kernel, seconds, constants = log.slowest(1)[0]
    assert (phase, kernel) == ("warmup", "_finish") and seconds >= 0.05
    assert constants == {"BLOCK_S": 64, "APART": True}    # constexprs by parameter name
    assert len(log.slowest(5)) == 3
    seconds, keys = [r["s"] for r in log.records], [r["key"] for r in log.records]
    assert log.builds(skip=("warmup",)) == [
        ["run", "_partial", seconds[1], {"BLOCK_S": 16}, keys[1]],
        ["run", "_finish", seconds[2], {"BLOCK_S": 16, "APART": False}, keys[2]]]
