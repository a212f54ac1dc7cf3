"""Activation checkpointing per block (`ForwardMode.checkpoint_blocks`): the full-sequence
forward's logits and every gradient are the same bits with it on and off (the blocks recompute
exactly), and the autograd graph saves far fewer bytes for the backward, in the INFERENCE and
TRAINING formulations (micro, fp32 on CPU: SWA, CSA and HCA blocks); under the batch-invariant
ops of true on-policy RL too (dsv4-tiny, where those ops round differently from the default
ones: without the recompute's own context the gradients differ)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from dsv4.assets import default_model_path
from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import random_model
from dsv4.kernels.ref.batch_invariant import batch_invariant
from dsv4.model.forward_mode import INFERENCE, TRAINING, ForwardMode
from dsv4.model.loader import load_model


def _step(mode: ForwardMode, invariant: bool = False
          ) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """(logits, gradients, bytes the autograd graph saved) of one loss on a fresh micro; the
    forward under the batch-invariant ops with `invariant` (the backward outside, as the RL
    trainer runs them)."""
    model = (load_model(default_model_path(), dtype="float32", progress=False) if invariant
             else random_model(micro(), torch.float32, torch.device("cpu"), seed=5)).train()
    ids = torch.randint(0, micro().vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    numerics = batch_invariant() if invariant else contextlib.nullcontext()
    with numerics, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(ids, mode)
    logits.logsumexp(-1).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads, saved[0]


@pytest.mark.parametrize(("mode", "invariant"), [(INFERENCE, False), (TRAINING, False),
                                                 (INFERENCE, True)],
                         ids=["inference", "training", "inference-batch-invariant"])
def test_same_values_and_gradients_fewer_saved_bytes(mode: ForwardMode, invariant: bool) -> None:
    """With the batch-invariant forward the recompute (in the backward, outside its context)
    runs under those ops too, or the gradients would differ in their last bits."""
    plain_logits, plain_grads, plain_saved = _step(mode, invariant)
    logits, grads, saved = _step(mode.with_checkpointing(True), invariant)
    assert torch.equal(logits, plain_logits)
    assert grads.keys() == plain_grads.keys() and len(grads) > 10
    for name, g in plain_grads.items():
        assert torch.equal(grads[name], g), name
    assert saved * 3 < plain_saved, (saved, plain_saved)
