"""Kernel tests run the Triton kernels under the Triton interpreter when there is no CUDA GPU.

Triton reads TRITON_INTERPRET when a kernel is defined; dsv4 imports its Triton modules lazily, so
setting it here, before any test module of this folder imports a kernel, is enough. The interpreter
then skips its redundant nested re-patching and its integer-overflow sanitizer
(`dsv4/utils/triton_interpreter.py`, which says why), for every test of the process (the engine
tests with the triton backend included).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from dsv4.utils.triton_interpreter import speed_up_interpreter

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # every process of the suite imports this conftest while collecting, before any test runs
    speed_up_interpreter()


@pytest.fixture
def round_bf16_to_nearest_even(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Under the interpreter, fp32 -> bf16 casts round to nearest even, as on the GPU (the
    interpreter's own cast truncates). A test module opts in with
    `pytestmark = pytest.mark.usefixtures("round_bf16_to_nearest_even")`."""
    if torch.cuda.is_available():
        yield
        return
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    truncating = interpreter._convert_float

    def rne(data: Any, src: Any, dst: Any, rounding_mode: Any) -> Any:
        if src == tl.float32 and dst == tl.bfloat16:
            t = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy())
            return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return truncating(data, src, dst, rounding_mode)

    monkeypatch.setattr(interpreter, "_convert_float", rne)
    yield
