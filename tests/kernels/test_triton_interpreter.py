"""`skip_nested_interpreter_patching`: an interpreted kernel whose helpers call helpers (and
triton.language's own, which also see tl.core) computes the same with it, and most nested calls
no longer patch triton.language again."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import triton
import triton.language as tl

from dsv4.utils.triton_interpreter import skip_nested_interpreter_patching

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the Triton interpreter only")


@triton.jit
def _inner(x):  # type: ignore[no-untyped-def]
    return tl.sum(x * x, axis=0) + tl.max(x, axis=0)


@triton.jit
def _outer(x):  # type: ignore[no-untyped-def]
    return _inner(x) + _inner(x + 1.0)


@triton.jit
def _kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    i = tl.program_id(0)
    x = tl.load(x_ptr + i * BLOCK + tl.arange(0, BLOCK))
    tl.store(out_ptr + i, _outer(x))


def test_same_values_and_fewer_patches(monkeypatch: pytest.MonkeyPatch) -> None:
    from triton.runtime import interpreter

    x = torch.randn(3, 16)
    want = (x * x).sum(1) + x.max(1).values + ((x + 1) * (x + 1)).sum(1) + (x + 1).max(1).values
    skip_nested_interpreter_patching()          # idempotent: the suite's conftest did it already
    wrapped = interpreter._patch_lang
    assert getattr(wrapped, "nested_skip", False)
    real = next(c.cell_contents for c in wrapped.__closure__ or ()
                if getattr(c.cell_contents, "__name__", "") == "_patch_lang")
    calls: list[str] = []

    def counting(fn: object) -> object:
        calls.append(getattr(fn, "__name__", "?"))
        return real(fn)

    for cell in wrapped.__closure__ or ():
        if cell.cell_contents is real:
            monkeypatch.setattr(cell, "cell_contents", counting)
    out = torch.empty(3)
    _kernel[(3,)](x, out, BLOCK=16)
    torch.testing.assert_close(out, want)
    # per program: 2 _outer -> _inner calls, 4 tl.sum / tl.max calls (the first of which patches
    # tl.core): without the skip each of the 3 programs patches 1 + 6 times (+ the launch)
    assert calls[0] == "_kernel", calls
    assert len(calls) <= 3, calls


@triton.jit
def _square_kernel(x_ptr, out_ptr):  # type: ignore[no-untyped-def]
    x = tl.load(x_ptr)
    tl.store(out_ptr, x * x)


def test_overflow_sanitizer_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """`skip_overflow_sanitizer` (the suite's conftest ran it): an int32 product past 2**31 wraps,
    as compiled code does. The sanitizer's checks report only with `debug` on, which the suite
    never sets: there it raises, and without `debug` it would compute the checks for nothing."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    assert builder.options.sanitize_overflow is False and builder.options.debug is False
    x, out = torch.tensor([1 << 16], dtype=torch.int32), torch.empty(1, dtype=torch.int32)
    _square_kernel[(1,)](x, out)
    assert out.item() == 0                      # 2**32 wrapped
    monkeypatch.setattr(builder, "options", dataclasses.replace(
        builder.options, sanitize_overflow=True, debug=True))
    with pytest.raises(Exception, match="overflow"):
        _square_kernel[(1,)](x, out)
