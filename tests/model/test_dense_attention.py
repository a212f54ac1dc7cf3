"""The training (autograd) form of full-sequence attention equals the gathered form used for inference."""

from __future__ import annotations

import torch

from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import random_model


def test_grad_path_equals_inference_path() -> None:
    model = random_model(micro().replace(index_topk=3), torch.float32, torch.device("cpu"), seed=3)
    ids = torch.randint(0, model.config.vocab_size, (2, 53), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gathered = model(ids)
    dense = model(ids)                      # grad enabled: dense masked attention
    assert dense.requires_grad
    torch.testing.assert_close(dense.detach(), gathered, rtol=1e-5, atol=1e-5)
    dense.sum().backward()
    wq_b = [p for n, p in model.named_parameters() if n.startswith("layers.") and ".attn.wq_b." in n]
    assert wq_b and all(p.grad is not None for p in wq_b)
