"""Interleaved partial RoPE on the trailing `rope_head_dim` channels, with YaRN (spec §6.1).

Two tables per model: "main" (θ = rope_theta, no scaling) for SWA-only layers and the MTP layer,
and "compress" (θ = compress_rope_theta, YaRN-blended frequencies, NO mscale) for CSA/HCA layers,
used for every RoPE in those layers (q, window kv, compressed kv, indexer q and keys, output
de-rotation). Pairs are (x[2i], x[2i+1]) inside the rope slice (GPT-J / complex layout).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from dsv4.config.model import ModelConfig
from dsv4.kernels.ops import ROPE_ROWS_MAX_PAIRS, RopeRowsOp


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
    """[rope_head_dim // 2] fp32 inverse frequencies for the main or the compressed-layer table,
    on the default device. Computed on the CPU: the same bits wherever the model lives, and no
    meta-device arithmetic (its torch._refs path imports torch._dynamo)."""
    dim = config.rope_head_dim
    theta = config.compress_rope_theta if compressed else config.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
    bounds = yarn_inv_freq_bounds(config) if compressed else None
    if bounds is not None:
        assert config.yarn is not None
        low, high = float(bounds[0]), float(bounds[1])
        if low == high:
            high += 0.001  # avoid a zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low)
                / (high - low)).clamp(0, 1)
        inv_freq = inv_freq / config.yarn.factor * ramp + inv_freq * (1 - ramp)
    return inv_freq.to(torch.get_default_device())


def rope_cache_bytes(config: ModelConfig, max_positions: int) -> int:
    """Bytes of the serving path's RoPE caches of both tables (`RotaryEmbedding.build_cache`)
    over positions 0 .. max_positions-1: fp32 cos and sin of rope_head_dim / 2 pairs each."""
    return 2 * 2 * max_positions * (config.rope_head_dim // 2) * 4


class RotaryEmbedding(nn.Module):
    """Holds one inverse-frequency table; `forward(positions)` returns fp32 (cos, sin).

    The serving path reads (cos, sin) rows from a cache of positions 0 .. N-1 instead
    (`build_cache`, then `lookup`, or `lookup_rows` for several lookups in one kernel op): one
    gather per lookup, the same bits as `forward` (the cache IS `forward(arange(N))`, and each
    element of `forward` depends only on its own position).
    The cache is engine state, sized by the engine's context: a plain attribute, not a buffer,
    so it is in no state_dict, checkpoint name list or weight count (`distributed/memory.py`
    counts it with the engine's state)."""

    def __init__(self, config: ModelConfig, compressed: bool) -> None:
        super().__init__()
        self.config = config
        self.compressed = compressed
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", rope_inv_freq(config, compressed), persistent=False)
        # [2, N, rope_head_dim // 2] fp32: cos and sin of positions 0..N-1 (None: not built)
        self.cache: torch.Tensor | None = None

    def reset_buffers(self) -> None:
        """Recompute the table (after `to_empty` from the meta device), and the cache if built."""
        self.inv_freq = rope_inv_freq(self.config, self.compressed).to(self.inv_freq.device)
        if self.cache is not None:
            self.build_cache(self.cache.shape[1])

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [...] int -> cos, sin: [..., rope_head_dim // 2] fp32
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq
        return freqs.cos(), freqs.sin()

    def build_cache(self, max_positions: int) -> int:
        """Fill the cache with `forward` of positions 0 .. max_positions-1, computed on the
        table's device (the model's: the device whose cos / sin `forward` would run); returns its
        bytes. Called once by the engine at start-up."""
        cos, sin = self.forward(torch.arange(max_positions, device=self.inv_freq.device))
        self.cache = torch.stack((cos, sin))
        return self.cache.numel() * self.cache.element_size()

    @property
    def cached_positions(self) -> int:
        """N: positions 0..N-1 are in the cache (0: no cache)."""
        return 0 if self.cache is None else self.cache.shape[1]

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward(positions)`, bit for bit, as ONE gather from the cache (each [..., rd/2]
        contiguous), or `forward` itself while no cache is built. Positions must lie in
        [0, cached_positions): not checked here (a host sync on the hot path); the engine refuses
        requests that could reach past it."""
        if self.cache is None:
            return self.forward(positions)
        rows = self.cache.index_select(1, positions.reshape(-1))
        rows = rows.view(2, *positions.shape, rows.shape[-1])
        return rows[0], rows[1]


def lookup_rows(lookups: Sequence[tuple[RotaryEmbedding, torch.Tensor]],
                rope_rows: RopeRowsOp) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`table.lookup(positions)` of each (table, positions) lookup, the same bits and shapes: with
    every table's cache built, the `rope_rows` kernel op gathers them all, one call per
    `ROPE_ROWS_MAX_PAIRS` lookups (one launch on the triton backend); else each `lookup`."""
    pairs = []
    for table, positions in lookups:
        if table.cache is None:
            return [t.lookup(p) for t, p in lookups]
        pairs.append((table.cache, positions))
    rows: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i in range(0, len(pairs), ROPE_ROWS_MAX_PAIRS):
        rows += rope_rows(pairs[i:i + ROPE_ROWS_MAX_PAIRS])
    return rows


def token_rows(cos: torch.Tensor, sin: torch.Tensor,
               batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A full-sequence forward's cos / sin [S, rd/2] as the serving ops take them: one row per
    token of the flattened [B * S] batch (contiguous)."""
    return (cos.expand(batch, *cos.shape).reshape(-1, cos.shape[-1]),
            sin.expand(batch, *sin.shape).reshape(-1, sin.shape[-1]))
