"""The TRAINING forward (dense attention and experts) equals the INFERENCE forward (gathered
attention, sparse experts): `model/forward_mode.py`'s claim, in fp32."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import random_model
from dsv4.model import attention, moe
from dsv4.model.forward_mode import INFERENCE, TRAINING


def test_grad_path_equals_inference_path() -> None:
    model = random_model(micro().replace(index_topk=3), torch.float32, torch.device("cpu"), seed=3)
    ids = torch.randint(0, model.config.vocab_size, (2, 53),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gathered = model(ids, INFERENCE)
    dense = model(ids, TRAINING)
    assert dense.requires_grad
    torch.testing.assert_close(dense.detach(), gathered, rtol=1e-5, atol=1e-5)
    dense.sum().backward()
    wq_b = [p for n, p in model.named_parameters()
            if n.startswith("layers.") and ".attn.wq_b." in n]
    assert wq_b and all(p.grad is not None for p in wq_b)


def test_mode_picks_the_formulation(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mode, not autograd, decides: INFERENCE with grad on still runs gathered attention and
    sparse experts (bit-identical to no-grad), TRAINING under no_grad still runs the dense forms."""
    calls: dict[str, int] = {"attention": 0, "experts": 0}
    dense_attn, dense_experts = attention.dense_masked_attention, moe.routed_experts_dense

    def count(name: str, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(attention, "dense_masked_attention", count("attention", dense_attn))
    monkeypatch.setattr(moe, "routed_experts_dense", count("experts", dense_experts))
    model = random_model(micro().replace(index_topk=3), torch.float32, torch.device("cpu"), seed=3)
    ids = torch.randint(0, model.config.vocab_size, (1, 21),
                        generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(ids, INFERENCE)
    assert (torch.equal(model(ids, INFERENCE).detach(), reference)
            and calls == {"attention": 0, "experts": 0})
    with torch.no_grad():
        model(ids, TRAINING)
    n = model.config.num_layers
    assert calls == {"attention": n, "experts": n}


def test_both_modes_under_bf16_autocast() -> None:
    """The trainer's GPU setting (bf16 autocast around fp32 weights) on the CPU: TRAINING and
    INFERENCE (its held-out evaluation: the per-expert loop, index_add into fp32) both run and stay
    within bf16 rounding of the fp32 forward."""
    model = random_model(micro().replace(index_topk=3), torch.float32, torch.device("cpu"), seed=3)
    ids = torch.randint(0, model.config.vocab_size, (2, 37),
                        generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        reference = model(ids, INFERENCE)
        for mode in (TRAINING, INFERENCE):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(ids, mode).float()
            rel = ((out - reference).norm() / reference.norm()).item()
            # the bound is bf16's noise on this random model: its bf16-weight copy sits 0.09 from
            # fp32 (random weights amplify rounding); a broken path is O(1)
            assert rel < 0.1, (mode, rel)
