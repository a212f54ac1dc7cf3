"""Quantisation-aware training by weight swapping: forward/backward through FP8/FP4-rounded
weights.

The shipped checkpoint stores linears as FP8 (128x128 blocks, UE8M0 scales) and routed experts as
FP4 e2m1 (per-32 UE8M0 scales), the official layout (spec §12). Training the last stretch through
the rounded weights makes the loaded model the trained one. Straight-through estimator done by
swapping storage:

    with shadow.rounded():    # p.data <- dequant(quant(master)) for every quantised parameter
        loss.backward()       # gradients w.r.t. the rounded weights ...
    optimizer.step()          # ... applied to the fp32 masters, restored on exit

Invariant: outside `rounded()` every parameter holds its fp32 master value.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from dsv4.kernels.ref import quant

# Internal names (stacked experts [E, out, in]) of the parameters the official layout quantises.
_FP8 = re.compile(r"(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|shared_experts\.w[123]"
                  r"|\.e_proj|\.h_proj)\.weight$")
_FP4 = re.compile(r"ffn\.experts\.w[123]$")


def fake_fp8(w: torch.Tensor) -> torch.Tensor:
    q, scale = quant.quant_fp8_block(w.float())
    return quant.dequant_fp8_block(q, scale, w.dtype)


def fake_fp4(w: torch.Tensor) -> torch.Tensor:
    """Stacked experts [E, out, in], rounded as the checkpoint stores each expert. FP4 groups run
    along `in` within one row, so all experts' rows are rounded in one call on the [E*out, in]
    view."""
    rows = w.reshape(-1, w.shape[-1]).float()
    packed, scale = quant.quant_fp4_group(rows)
    return quant.dequant_fp4_group(packed, scale, w.dtype).view_as(w)


class QuantShadow:
    """The quantised parameters of a model and their rounding functions (empty for
    weight_quant='none')."""

    def __init__(self, model: nn.Module, weight_quant: str) -> None:
        self.targets: list[tuple[nn.Parameter, bool]] = []     # (param, is_fp4)
        if weight_quant == "none":
            return
        for name, p in model.named_parameters():
            if weight_quant == "fp8+fp4" and _FP4.search(name):
                self.targets.append((p, True))
            elif _FP8.search(name) or (weight_quant == "fp8" and _FP4.search(name)):
                self.targets.append((p, False))

    @contextmanager
    def rounded(self, enabled: bool = True) -> Iterator[None]:
        if not enabled or not self.targets:
            yield
            return
        masters = [p.data for p, _ in self.targets]
        with torch.no_grad():
            for p, fp4 in self.targets:
                p.data = fake_fp4(p.data) if fp4 else _fake_fp8_any(p.data)
        try:
            yield
        finally:
            for (p, _), master in zip(self.targets, masters, strict=True):
                p.data = master


def _fake_fp8_any(w: torch.Tensor) -> torch.Tensor:
    if w.dim() == 3:  # stacked experts stored as FP8 (weight_quant='fp8')
        return torch.stack([fake_fp8(w[e]) for e in range(w.shape[0])])
    return fake_fp8(w)
