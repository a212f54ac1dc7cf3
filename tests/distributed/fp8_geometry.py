"""A `micro` geometry whose tensor-parallel cuts of the FP8 linears are whole 128x128 scale blocks
at 2 ranks (as V4-Flash's are at 2-8): wq_b 2 heads x 64 = 128 rows per rank, one 128-row output
group of wo_a (wo_b: 128 columns), the shared expert's intermediate 256 / 2 = 128."""

from __future__ import annotations

import dataclasses

from dsv4.checkpoint.presets import micro
from dsv4.config.model import ModelConfig


def micro_blocks() -> ModelConfig:
    return dataclasses.replace(micro(), head_dim=64, o_lora_rank=128, moe_inter_dim=256)
