"""Deterministic random values of a model's official tensors: what `checkpoint/writer.py` writes
and `random_model` fills (`load_format="dummy"`), and what `distributed/dummy.py` draws for one
rank's shard.

Every tensor (and every coded module, and each routed expert's codes) has its own generator,
seeded by the run's seed and its official name (`name_generator`), so any part of a model is drawn
without drawing the rest: the values depend on the name and the shape alone, never on what was
drawn before.
"""

from __future__ import annotations

import hashlib
import math
import re

import torch

from dsv4.config.model import ModelConfig


def name_generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    """The generator of tensor (or coded module) `name`'s random values under `seed`."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little"))


def expert_generator(seed: int, module_name: str, device: torch.device,
                      expert: int) -> torch.Generator:
    """Routed expert `expert`'s codes of the checkpoint-format experts at `module_name`."""
    return name_generator(seed, f"{module_name}.{expert}", device)


def init_tensor(name: str, shape: tuple[int, ...], config: ModelConfig, seed: int,
                device: torch.device | None = None) -> torch.Tensor:
    """Deterministic random value of one official tensor (fp32, or int64 for tid2eid), on
    `device` (CPU: the same values on every machine; a GPU generator gives other, equally
    deterministic values)."""
    device = device or torch.device("cpu")
    g = name_generator(seed, name, device)

    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=g, device=device) * std + mean

    if name.endswith("tid2eid"):  # k distinct experts per token id
        return torch.rand(shape[0], config.n_routed_experts, generator=g,
                          device=device).argsort(dim=-1)[:, :shape[1]]
    if name.endswith("embed.weight"):
        return normal(1.0)
    if name.endswith("norm.weight"):
        return normal(0.1, 1.0)
    if re.search(r"hc_(attn|ffn|head)_fn$", name):
        return normal(1.0 / math.sqrt(shape[1]))
    if re.search(r"hc_(attn|ffn|head)_base$", name):
        return normal(0.5)
    if re.search(r"hc_(attn|ffn|head)_scale$", name):
        return torch.rand(shape, generator=g, device=device) + 0.5
    if name.endswith("attn_sink"):
        return normal(1.0)
    if name.endswith(".ape"):
        return normal(0.5)
    if name.endswith("gate.bias"):
        return normal(0.1)
    return normal(1.0 / math.sqrt(shape[-1]))  # every linear: [out, in]
