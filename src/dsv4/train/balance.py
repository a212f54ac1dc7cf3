"""Auxiliary-loss-free expert load balancing for the routed gates (DeepSeek-V3 §2.1.2, used by
V4).

Each routed gate selects its top-k experts on `score + bias`; the bias steers selection only (it
never scales an output). After every optimizer step each routed gate's bias moves by `rate`
towards balance:

    bias_e += rate * sign(mean_load - load_e)      load_e = tokens routed to expert e in this step

Loads are read from forward hooks on the gates, so the model code is unchanged. Hash gates (fixed
token -> expert tables) have no bias and are only measured. `load_stats()` is the step's named
sync point.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dsv4.model.moe import Gate


class ExpertBalancer:
    def __init__(self, model: nn.Module, num_experts: int, rate: float) -> None:
        self.rate, self.num_experts = rate, num_experts
        self.gates: list[tuple[str, Gate]] = [(n, m) for n, m in model.named_modules()
                                              if isinstance(m, Gate)]
        # per gate, the expert counts of its forwards since the last `clear()`: each hook appends
        # to its own list and reads no gate name, so a compiled block's graph does not specialise
        # on the gate it runs (blocks of one structure share one graph)
        self._counts: dict[str, list[torch.Tensor]] = {n: [] for n, _ in self.gates}
        self._handles: list[RemovableHandle] = [g.register_forward_hook(self._hook(self._counts[n]))
                                                for n, g in self.gates]

    def _hook(self, counts_of: list[torch.Tensor]):  # type: ignore[no-untyped-def]
        def record(_module: nn.Module, _inputs: tuple[torch.Tensor, ...],
                   output: tuple[torch.Tensor, ...]) -> None:
            ids = output[0].reshape(-1)
            # fixed-size count (not bincount: its output size is data-dependent, a torch.compile
            # graph break)
            counts_of.append(torch.zeros(self.num_experts, dtype=torch.int64, device=ids.device)
                             .scatter_add_(0, ids, torch.ones_like(ids)))
        return record

    @property
    def loads(self) -> dict[str, torch.Tensor]:
        """Tokens routed to each expert [E] (int64), summed over the forwards since the last
        `clear()`, per gate that ran."""
        out: dict[str, torch.Tensor] = {}
        for name, counts in self._counts.items():
            if counts:
                out[name] = counts[0]
                for c in counts[1:]:
                    out[name] = out[name] + c
        return out

    def clear(self) -> None:
        """Forget the recorded loads."""
        for counts in self._counts.values():
            counts.clear()

    @torch.no_grad()
    def update(self) -> None:
        """Move every routed gate's bias one step towards balance, then forget this step's loads."""
        loads = self.loads
        for name, gate in self.gates:
            if gate.bias is None or name not in loads:
                continue
            load = loads[name].float()
            gate.bias.add_(self.rate * torch.sign(load.mean() - load))
        self.clear()

    def load_stats(self) -> dict[str, float]:
        """max/mean expert load over the gates of the current step (1.0 = perfectly balanced)."""
        out: dict[str, float] = {}
        for name, load in self.loads.items():
            load = load.float()
            out[name] = float(load.max() / load.mean().clamp(min=1e-9))
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
