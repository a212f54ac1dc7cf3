"""Forward values from a serving kernel, gradients from the reference formulation.

`kernel_values(fast, ref, *inputs)` returns `fast(*inputs)` (run without autograd) and, in the
backward pass, recomputes `ref(*inputs)` with autograd and back-propagates through it. Both must
compute the same function (the kernel backends are tested against `ref`), so the gradient is the
reference's gradient at the same inputs; the values are the kernel's, bit for bit.

What this is for: an RL trainer whose forward must score tokens exactly as the engine did. The
engine's bf16 values come from its Triton kernels; a reference formulation agrees with them only
to summation order, and in bf16 that alone moves log-probs by ~0.005 nats
(benchmarks/results/rl_h200_202612.md). With `ForwardMode.values` set, the full-sequence forward
takes the values of the ops the engine runs (sparse attention, mHC, routed experts, RMSNorm) from
the same `KernelOps`; with launch plans that do not depend on the token count
(`create_kernels(..., invariant_plans=True)`) the values are the engine's.

Memory: like activation checkpointing, only the inputs are saved; the reference's intermediates
exist only inside the backward of one op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Outputs = Any  # a tensor or a tuple of tensors


class _KernelValues(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fast: Callable[..., Outputs], ref: Callable[..., Outputs],
                *inputs: torch.Tensor) -> Outputs:
        ctx.ref = ref
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            return fast(*inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        need = ctx.needs_input_grad[2:]
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(n) for t, n in zip(ctx.saved_tensors, need,
                                                                   strict=True)]
            out = ctx.ref(*leaves)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads, strict=True)
                 if g is not None and o.requires_grad]
        wrt = [leaf for leaf, n in zip(leaves, need, strict=True) if n]
        got: list[torch.Tensor | None] = [None] * len(wrt)
        if pairs and wrt:
            got = list(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                           allow_unused=True))
        it = iter(got)
        return (None, None, *(next(it) if n else None for n in need))


def kernel_values(fast: Callable[..., Outputs], ref: Callable[..., Outputs],
                  *inputs: torch.Tensor) -> Outputs:
    """`fast(*inputs)`, differentiable through `ref(*inputs)` (see the module docstring).

    `inputs`: every tensor the result depends on and that may need a gradient (activations and
    parameters); index tensors and scalars are closed over by `fast` and `ref`. Both return the
    same structure (a tensor or a tuple of tensors) of the same shapes.
    """
    return _KernelValues.apply(fast, ref, *inputs)
