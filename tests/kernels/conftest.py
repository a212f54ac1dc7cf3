"""Kernel tests run the Triton kernels under the Triton interpreter when there is no CUDA GPU.

Triton reads TRITON_INTERPRET when a kernel is defined; dsv4 imports its Triton modules lazily, so
setting it here, before any test module of this folder imports a kernel, is enough.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
