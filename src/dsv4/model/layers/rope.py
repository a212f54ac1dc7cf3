"""Interleaved partial RoPE on the trailing `rope_head_dim` channels, with YaRN (spec §6.1).

Two tables per model: "main" (θ = rope_theta, no scaling) for SWA-only layers and the MTP layer,
and "compress" (θ = compress_rope_theta, YaRN-blended frequencies, NO mscale) for CSA/HCA layers,
used for every RoPE in those layers (q, window kv, compressed kv, indexer q and keys, output
de-rotation). Pairs are (x[2i], x[2i+1]) inside the rope slice (GPT-J / complex layout).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dsv4.config.model import ModelConfig


def yarn_inv_freq_bounds(c: ModelConfig) -> tuple[int, int] | None:
    """(low, high) ramp bounds of the YaRN blend over the rope pairs (spec §6.1), or None."""
    yarn = c.yarn
    if yarn is None:
        return None
    dim, theta = c.rope_head_dim, c.compress_rope_theta

    def dimc(rot: float) -> float:
        return (dim * math.log(yarn.original_max_position_embeddings / (2 * math.pi * rot))
                / (2 * math.log(theta)))

    return max(math.floor(dimc(yarn.beta_fast)), 0), min(math.ceil(dimc(yarn.beta_slow)), dim - 1)


def rope_inv_freq(config: ModelConfig, compressed: bool) -> torch.Tensor:
    """[rope_head_dim // 2] fp32 inverse frequencies for the main or the compressed-layer table."""
    dim = config.rope_head_dim
    theta = config.compress_rope_theta if compressed else config.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    bounds = yarn_inv_freq_bounds(config) if compressed else None
    if bounds is None:
        return inv_freq
    assert config.yarn is not None
    low, high = float(bounds[0]), float(bounds[1])
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv_freq / config.yarn.factor * ramp + inv_freq * (1 - ramp)


class RotaryEmbedding(nn.Module):
    """Holds one inverse-frequency table; `forward(positions)` returns fp32 (cos, sin)."""

    def __init__(self, config: ModelConfig, compressed: bool) -> None:
        super().__init__()
        self.config = config
        self.compressed = compressed
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", rope_inv_freq(config, compressed), persistent=False)

    def reset_buffers(self) -> None:
        """Recompute the table (after `to_empty` from the meta device)."""
        self.inv_freq = rope_inv_freq(self.config, self.compressed).to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [...] int -> cos, sin: [..., rope_head_dim // 2] fp32
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq
        return freqs.cos(), freqs.sin()
