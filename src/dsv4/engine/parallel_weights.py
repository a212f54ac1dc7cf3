"""Weight updates for tensor / expert / data-parallel-attention engines (`engine/parallel.py`).

A weight update names full tensors, as the full float model's state dict does
(`weight_sync.update_weights`). Rank 0 receives them (from `LLM`, a checkpoint directory or a
trainer's weight-update group), and each rank keeps only its part: `tp.take_owned` narrows every
tensor the layout splits to the rank's `Cut` (`loading.owned_cuts`, the partition the rank was
loaded with) and passes the rest whole, so every rank's `update_weights` sees exactly the shapes
of its shard (an FP8 linear's or checkpoint-format expert's cut is encoded by the rank, which
gives the codes of the full tensor's encoding where the cut is whole scale blocks).

Order, so that a refused update changes no rank: rank 0 checks the full tensors (split
dimensions, finite values), applies its own part (`LLMEngine.update_weights`: atomic, raises
ValueError before any write), and only then sends the update to the other ranks, after the
commands queued before it: every rank applies the same calls in the same order (each retracts its
running requests and flushes its prefix cache). The header (names, shapes, dtypes) travels with
the commands over the gloo control group; the tensors over the ranks' default group (NCCL between
GPUs, gloo on the CPU), on each rank's device, each as its bytes (any dtype, FP8 included), one
broadcast per tensor, between two steps (no model collective in flight); a worker keeps only its
part of each before the next arrives.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dsv4.distributed.tp import Cut, take_owned
from dsv4.engine.weight_sync import check_finite

Header = list[tuple[str, list[int], str]]
"""Each tensor of an update: (name, shape, dtype name), in broadcast order."""


@dataclass(frozen=True)
class WeightChannel:
    """One rank's side of parallel weight updates: its cuts, the number of ranks, the gloo control
    group (commands), the device its tensors arrive on (over the default group)."""

    cuts: dict[str, Cut]
    size: int
    control: dist.ProcessGroup
    device: torch.device

    def own(self, named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's part of full tensors (`tp.take_owned`)."""
        return take_owned(dict(named), self.cuts, self.size)

    def check(self, named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rank 0, before anything is applied: the split dimensions and every rank's values
        (finite) of the full tensors; returns rank 0's part. Raises ValueError."""
        if not named:
            raise ValueError("named is empty; allowed: at least one tensor to update")
        owned = self.own(named)
        check_finite({n: t for n, t in named.items() if t.is_floating_point()})
        return owned

    @staticmethod
    def header(named: Mapping[str, torch.Tensor]) -> Header:
        """Rank 0: what to broadcast before the tensors (`broadcast`)."""
        return [(n, list(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in named.items()]

    def broadcast(self, named: Mapping[str, torch.Tensor]) -> None:
        """Rank 0: every tensor's bytes, in header order."""
        for t in named.values():
            dist.broadcast(_bytes(t.detach().to(self.device)), src=0)

    def receive(self, header: Header) -> dict[str, torch.Tensor]:
        """A worker: the tensors of `header`, each cut to this rank's part as it arrives."""
        owned = {}
        for name, shape, dtype_name in header:
            dtype = getattr(torch, dtype_name)
            buf = torch.empty(math.prod(shape) * dtype.itemsize, dtype=torch.uint8,
                              device=self.device)
            dist.broadcast(buf, src=0)
            full = buf.view(dtype).view(shape)
            owned[name] = self.own({name: full})[name].clone()
        return owned


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, flat (any dtype, as uint8)."""
    return t.contiguous().reshape(-1).view(torch.uint8)

