"""A weight-update process group between a trainer and serving engines, apart from any default
group: the transport of SGLang's `/init_weights_update_group` and `/update_weights_from_distributed`
(server/weight_update.py), by which an external trainer (Miles-style, disaggregated) pushes new
weights into a running `dsv4 serve` without a checkpoint on disk.

`open_group` builds a standalone `ProcessGroup` (gloo for engines on the CPU, NCCL on CUDA) over a
TCP store that the trainer, rank 0, hosts at `address:port`, its keys under `group_name`; an engine
process may already run its own default group (tensor parallelism), which this one leaves alone.
Every rank must call `open_group` with the same address, group name and world size; it returns
once all have joined. The trainer's side is this function too: SGLang's trainer-side helper
(`init_custom_process_group`) builds its group through torch's internal group constructor, which
nests further store prefixes, so a trainer written for SGLang needs `open_group` (or the same
store layout) to rendezvous with dsv4; that pairing is not tested here.

A transfer is a sequence of broadcasts from rank 0, one per tensor, in the order of the names the
trainer announced (`send_tensors` / `receive_tensors`): receivers allocate each tensor from its
announced dtype and shape, so only raw tensor bytes travel. A receiver must take every announced
tensor, valid or not, before it refuses the update: otherwise the trainer's broadcasts would wait
for it until the group's timeout.

Test: `pytest tests/server/test_weight_update.py` (gloo, a trainer in the test process and
`dsv4 serve`); NCCL is the same calls on CUDA tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# gloo's or NCCL's process group: c10d's `Backend`, whose type stubs lack `broadcast`
WeightGroup = Any

SOURCE = 0
"""The trainer's rank: the source of every broadcast."""

BACKENDS = ("gloo", "nccl")


def backend_for(device: torch.device) -> str:
    """The collective backend for weights on `device`: NCCL on CUDA, gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def parse_dtype(name: str) -> torch.dtype:
    """A torch dtype from its name ("bfloat16" or "torch.bfloat16", as trainers send it); raises
    ValueError naming the allowed floating and integer dtypes."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is invalid; allowed: a torch dtype name such as "
                         "'bfloat16', 'float32', 'int32'")
    return dtype


def open_group(address: str, port: int, rank: int, world_size: int, group_name: str,
               backend: str, timeout_s: float) -> WeightGroup:
    """Join the group `group_name` at `address:port` as `rank` of `world_size` (rank 0 hosts the
    store); blocks until every rank has joined, raising after `timeout_s`. ValueError for a bad
    rank, size or backend."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is invalid; allowed: {list(BACKENDS)}")
    if backend == "nccl" and not dist.is_nccl_available():
        raise ValueError("backend='nccl' is not available in this torch build; allowed: 'gloo'")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is invalid for world_size={world_size}; allowed: "
                         "0 <= rank < world_size")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, world_size, is_master=rank == SOURCE, timeout=timeout)
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)


def _broadcast(group: WeightGroup, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = SOURCE
    group.broadcast([tensor], opts).wait()


def send_tensors(group: WeightGroup, tensors: Mapping[str, torch.Tensor]) -> int:
    """Broadcast `tensors` in order from rank 0 (each contiguous); returns the bytes sent."""
    sent = 0
    for t in tensors.values():
        t = t.detach().contiguous()
        _broadcast(group, t)
        sent += t.numel() * t.element_size()
    return sent


def receive_tensors(group: WeightGroup, names: Sequence[str], dtypes: Sequence[str],
                    shapes: Sequence[Sequence[int]], device: torch.device
                    ) -> dict[str, torch.Tensor]:
    """The tensors rank 0 broadcasts for `names`, allocated on `device` from the announced dtypes
    and shapes (validated first: ValueError before any broadcast is taken)."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names, dtypes and shapes differ in length ({len(names)}, "
                         f"{len(dtypes)}, {len(shapes)}); allowed: one entry per tensor")
    if len(set(names)) != len(names):
        raise ValueError("names repeat a tensor; allowed: each name once")
    specs = [(parse_dtype(d), tuple(int(n) for n in s)) for d, s in zip(dtypes, shapes,
                                                                          strict=True)]
    out = {}
    for name, (dtype, shape) in zip(names, specs, strict=True):
        t = torch.empty(shape, dtype=dtype, device=device)
        _broadcast(group, t)
        out[name] = t
    return out
