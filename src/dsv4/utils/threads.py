"""CPU thread defaults: torch computes on cores - 1 intra-op threads, OpenMP waits passively.

Why: on the 2-core dev machine, dsv4-tiny generating 64 tokens beside one other busy process took
77-92 s with torch's default (one intra-op thread per core) against 2.7 s with one thread: the
threads of a parallel region spin waiting for each other while the neighbour holds a core. One
core is left for everything else (the server's API process, a tokenizer, another job); with
`OMP_WAIT_POLICY=PASSIVE` (set by `import dsv4` unless already set, effective when torch is
imported after it) idle OpenMP threads sleep instead of spinning.

An explicit choice wins: `OMP_NUM_THREADS` in the environment, or a `torch.set_num_threads` call
that left another count than torch's default.
"""

from __future__ import annotations

import os

import torch

from dsv4.utils.logging import init_logger

logger = init_logger(__name__)


def cpu_threads(cores: int | None = None) -> int:
    """cores - 1, at least 1 (`cores`: os.cpu_count() when None)."""
    return max(1, (cores if cores is not None else os.cpu_count() or 2) - 1)


def use_cpu_threads() -> int:
    """Set torch's intra-op threads to `cpu_threads()` unless the process chose a count (module
    docstring); returns the count in effect."""
    cores = os.cpu_count() or 2
    if "OMP_NUM_THREADS" in os.environ or torch.get_num_threads() < cores:
        return torch.get_num_threads()
    threads = cpu_threads(cores)
    torch.set_num_threads(threads)
    logger.info("torch intra-op threads: %d of %d cores (one left for other work)", threads,
                cores)
    return threads
