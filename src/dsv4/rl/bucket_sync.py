"""Bucketed weight transfer from the trainer process to a rollout engine over torch.distributed.

The disaggregated placement (`rl/placement.py`) keeps the trainer and the rollout engine in
separate processes joined by a process group (`join_group`: rank 0 the trainer, ranks 1.. the
engines; gloo on CPU, NCCL on CUDA). After every optimizer step rank 0 broadcasts its weights:

* `plan_buckets` cuts a state dict, in its order, into `Bucket`s of at most `bucket_bytes` (a
  tensor larger than that is a bucket of its own). The plan (names, dtypes, shapes, byte
  offsets) is computed once by the trainer and handed to every engine beforehand (through
  Ray), so only raw bytes travel;
* a bucket is ONE uint8 buffer: each tensor's bytes back to back, each starting on an `ALIGN`
  boundary, whatever its dtype, so one collective moves a bucket (a broadcast per tensor would
  pay the collective's latency per tensor: hundreds per model) and one bucket may mix dtypes;
* the receiver views the buffer as the named tensors (no copy) and hands each bucket to `apply`
  (the engine's `update_weights`: validated, in place) before receiving the next: it holds one
  bucket beyond its model, the sender one bucket beyond its state. Both reuse a single buffer
  of the largest bucket's size for every bucket.

Invariants: every rank walks the same plan, so the i-th broadcast of each rank carries the same
bucket; bytes are copied verbatim, so an engine receives exactly the tensors the trainer holds
(bit for bit, as the in-process `update_weights` gets them).

Test: `pytest tests/rl/test_placement.py` (the plan and the byte layout without a group; the
transfer inside the Ray disaggregated run).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dsv4.distributed.group import join_default_group
from dsv4.engine.weight_group import backend_for
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)

ALIGN = 16
"""Byte alignment of every tensor in a bucket: viewing bytes as a dtype needs its offset to be a
multiple of the element size (at most 8 bytes here)."""

SOURCE = 0
"""The trainer's rank in the sync group: the broadcasts' source."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a bucket: its bytes are `buffer[offset : offset + num_bytes]`."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def num_bytes(self) -> int:
        numel = 1
        for n in self.shape:
            numel *= n
        return numel * self.dtype.itemsize


@dataclass(frozen=True)
class Bucket:
    """Tensors moved by one broadcast; `num_bytes` includes the alignment padding."""

    entries: tuple[Entry, ...]
    num_bytes: int


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def plan_buckets(state: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[Bucket]:
    """`state`'s tensors in order, cut into buckets of at most `bucket_bytes` (padded) bytes; a
    tensor larger than `bucket_bytes` gets a bucket of its own. Raises ValueError for a
    non-positive size or an empty state."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} is invalid; allowed: > 0")
    if not state:
        raise ValueError("state is empty; allowed: at least one tensor to send")
    buckets: list[Bucket] = []
    entries: list[Entry] = []
    size = 0
    for name, t in state.items():
        need = _aligned(t.numel() * t.element_size())
        if entries and size + need > bucket_bytes:
            buckets.append(Bucket(tuple(entries), size))
            entries, size = [], 0
        entries.append(Entry(name, t.dtype, tuple(t.shape), size))
        size += need
    buckets.append(Bucket(tuple(entries), size))
    return buckets


def pack_bucket(bucket: Bucket, state: Mapping[str, torch.Tensor],
                out: torch.Tensor) -> torch.Tensor:
    """The bucket's bytes from `state`, written into `out` (uint8, at least `num_bytes`);
    returns the view `out[:num_bytes]` (padding left as it was)."""
    flat = out[:bucket.num_bytes]
    for e in bucket.entries:
        src = state[e.name].detach()
        assert src.dtype == e.dtype and tuple(src.shape) == e.shape, (
            f"{e.name}: {src.dtype} {list(src.shape)} does not match the plan's "
            f"{e.dtype} {list(e.shape)}")
        flat[e.offset:e.offset + e.num_bytes].copy_(src.contiguous().reshape(-1)
                                                    .view(torch.uint8))
    return flat


def unpack_bucket(bucket: Bucket, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """The bucket's tensors as views of `flat` (uint8 [num_bytes]); valid until `flat` is
    overwritten."""
    return {e.name: flat[e.offset:e.offset + e.num_bytes].view(e.dtype).view(e.shape)
            for e in bucket.entries}


def _buffer(plan: list[Bucket], device: torch.device) -> torch.Tensor:
    return torch.zeros(max(b.num_bytes for b in plan), dtype=torch.uint8, device=device)


def send_weights(plan: list[Bucket], state: Mapping[str, torch.Tensor],
                 group: dist.ProcessGroup | None = None) -> int:
    """Broadcast `state` bucket by bucket from this rank (`SOURCE`); returns the bytes sent.
    Every other rank of `group` runs `receive_weights` with the same plan meanwhile."""
    device = next(iter(state.values())).device
    out = _buffer(plan, device)
    for bucket in plan:
        dist.broadcast(pack_bucket(bucket, state, out), src=SOURCE, group=group)
    return sum(b.num_bytes for b in plan)


def receive_weights(plan: list[Bucket], device: torch.device,
                    apply: Callable[[dict[str, torch.Tensor]], object],
                    group: dist.ProcessGroup | None = None) -> int:
    """Receive `send_weights`'s broadcasts on `device`, calling `apply(named tensors)` once per
    bucket (the tensors are views of a buffer reused by the next bucket: `apply` must copy);
    returns the bytes received."""
    out = _buffer(plan, device)
    for bucket in plan:
        flat = out[:bucket.num_bytes]
        dist.broadcast(flat, src=SOURCE, group=group)
        apply(unpack_bucket(bucket, flat))
    return sum(b.num_bytes for b in plan)


# ---- the group ---------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port free on this host now (the OS picks it; the rendezvous binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def join_group(address: str, rank: int, world_size: int, device: torch.device,
               timeout_s: float) -> None:
    """Join the sync group at `address` ("tcp://host:port") as this process's default group,
    leaving a previous one first (a group whose peer died cannot be reused). Blocks until all
    `world_size` ranks have joined; a collective waiting longer than `timeout_s` raises."""
    leave_group()
    join_default_group(backend_for(device), address, rank, world_size,
                       timedelta(seconds=timeout_s))
    logger.info("joined the weight-sync group %s as rank %d of %d (%s)", address, rank,
                world_size, backend_for(device))


def leave_group() -> None:
    """Destroy this process's default group, if any."""
    if dist.is_initialized():
        dist.destroy_process_group()
