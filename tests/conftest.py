"""Shared pytest configuration for the dsv4 test suite.

Markers (`gpu`, `multi_gpu`, `slow`) are declared in pyproject.toml; this
file sets TRITON_INTERPRET=1 on machines without CUDA (before any test module is collected),
skips GPU-marked tests there, gives torch one thread fewer
than the machine has cores, shared among the pytest-xdist workers (a test beside another busy
process must not stall on oversubscribed cores) and provides a seeding fixture.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton reads TRITON_INTERPRET when a function is defined, and pytest imports every test
    # module while collecting: set before any of them (a folder's conftest comes too late for
    # the modules collected before that folder) may import triton
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config: pytest.Config) -> None:
    """torch threads: the pytest-xdist workers (`make test`: two) share cores - 1, at least one
    each, so the workers together never oversubscribe the machine."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, ((os.cpu_count() or 2) - 1) // workers))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        n_gpus = torch.cuda.device_count()
        if n_gpus >= 2:
            return
        skip_multi = pytest.mark.skip(reason=f"needs >= 2 CUDA GPUs, found {n_gpus}")
        for item in items:
            if item.get_closest_marker("multi_gpu") is not None:
                item.add_marker(skip_multi)
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if (item.get_closest_marker("gpu") is not None
                or item.get_closest_marker("multi_gpu") is not None):
            item.add_marker(skip_gpu)


@pytest.fixture
def seeded() -> torch.Generator:
    """Seed torch's global RNG with 0 for the test; returns the default generator."""
    return torch.manual_seed(0)
