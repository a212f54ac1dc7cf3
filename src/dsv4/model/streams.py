"""Concurrent branches of a serving step on a second CUDA stream (`EngineConfig.multi_stream`).

At small batch most of a decode step's kernels occupy a few SMs each and run one after another;
the branches of a layer that do not depend on each other (a CSA layer's compressors and indexer
beside its query / window-KV path; the shared expert beside the MoE gate and routed experts) can
run at the same time. `side(stream)` forks: the side stream first waits for everything already
queued on the current stream, then the block's kernels go to the side stream; `join(stream)`
makes the current stream wait for everything queued on the side. Both are captured into CUDA
graphs as graph edges (torch's multi-stream capture), so replays keep the concurrency.

Memory discipline (no `record_stream` needed): tensors the side branch reads from the main stream
stay referenced until after the join, and tensors it produces are read on the main stream only
after the join; every fork waits for the main stream, so a block the side stream frees and later
reuses is never still being read by queued main-stream work.

With `stream=None` (the CPU, multi-stream off, a full-sequence forward) both are no-ops and the
code runs in program order on the current stream: the same kernels on the same inputs, so the
outputs are bit-identical either way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def side(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Run the block on `stream` after the work already queued on the current stream."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        yield


def join(stream: torch.cuda.Stream | None) -> None:
    """Make the current stream wait for the work queued on `stream` (no-op for None)."""
    if stream is not None:
        torch.cuda.current_stream(stream.device).wait_stream(stream)
