"""Named model configurations for `dsv4 init` and the benchmarks (DESIGN.md §3).

- micro: every feature at toy scale (SWA, CSA with top-k < #entries, HCA, hash + routed MoE,
  YaRN, MTP); a few hundred thousand parameters; the geometry of the CPU equivalence tests.
- tiny: the shipped, trained default model (`dsv4.assets`): every feature active at its
  2048-token training length (W = 128, C4 with top-128 of up to 512 entries, C128, 2 hash +
  4 routed MoE layers, MTP); about 30M parameters, under 25 MB in the official FP8/FP4 layout.
- flash-4l: V4-Flash per-layer geometry, 4 layers [CSA, HCA, CSA, HCA], mlp [hash, routed x3].
- flash-43l-e16: the full 43-layer Flash schedule with 16 routed experts per layer.
- flash: the full V4-Flash geometry (43 layers, 256 routed experts).

`first_layers` cuts a preset to the prefix of its layer schedule: the per-layer cost of a geometry
too large for one device is measured on a prefix of its own layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from dsv4.config.model import ModelConfig, YarnConfig

_FLASH_YARN = YarnConfig(factor=16.0, original_max_position_embeddings=65536, beta_fast=32.0,
                         beta_slow=1.0)


def micro() -> ModelConfig:
    return ModelConfig(
        vocab_size=512, hidden_size=64, num_layers=5, num_heads=4, head_dim=32, rope_head_dim=8,
        q_lora_rank=32, o_groups=2, o_lora_rank=16, window=8,
        attn_types=("swa", "csa", "hca", "csa", "hca"),
        moe_types=("hash", "hash", "routed", "routed", "routed"),
        csa_ratio=4, hca_ratio=16, index_n_heads=16, index_head_dim=16, index_topk=4,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_inter_dim=32,
        yarn=YarnConfig(factor=4.0, original_max_position_embeddings=64),
        max_position_embeddings=4096, num_mtp_layers=1)


def tiny() -> ModelConfig:
    return ModelConfig(
        vocab_size=4096, hidden_size=256, num_layers=6, num_heads=8, head_dim=64, rope_head_dim=16,
        q_lora_rank=128, o_groups=2, o_lora_rank=64, window=128,
        attn_types=("swa", "csa", "hca", "csa", "hca", "csa"),
        moe_types=("hash", "hash", "routed", "routed", "routed", "routed"),
        csa_ratio=4, hca_ratio=128, index_n_heads=8, index_head_dim=32, index_topk=128,
        n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=2, moe_inter_dim=256,
        max_position_embeddings=2048, num_mtp_layers=1)


def _flash(num_layers: int, attn: tuple[str, ...], moe: tuple[str, ...],
           experts: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=129280, hidden_size=4096, num_layers=num_layers, num_heads=64, head_dim=512,
        rope_head_dim=64,
        q_lora_rank=1024, o_groups=8, o_lora_rank=1024, window=128, attn_types=attn, moe_types=moe,
        csa_ratio=4, hca_ratio=128, index_n_heads=64, index_head_dim=128, index_topk=512,
        n_routed_experts=experts, n_shared_experts=1, num_experts_per_tok=6, moe_inter_dim=2048,
        routed_scaling_factor=1.5, yarn=_FLASH_YARN, num_mtp_layers=1)


def flash_4l() -> ModelConfig:
    return _flash(4, ("csa", "hca", "csa", "hca"), ("hash", "routed", "routed", "routed"), 256)


def flash_43l_e16() -> ModelConfig:
    attn = ("swa", "swa") + ("csa", "hca") * 20 + ("csa",)
    return _flash(43, attn, ("hash",) * 3 + ("routed",) * 40, 16)


def flash() -> ModelConfig:
    """The full V4-Flash geometry: 43 layers, 256 routed experts (random weights only: built in
    memory, e.g. `--model in-memory:flash`; ~160 GB in checkpoint precision)."""
    attn = ("swa", "swa") + ("csa", "hca") * 20 + ("csa",)
    return _flash(43, attn, ("hash",) * 3 + ("routed",) * 40, 256)


PRESETS: dict[str, Callable[[], ModelConfig]] = {"micro": micro, "tiny": tiny, "flash-4l": flash_4l,
                                                 "flash-43l-e16": flash_43l_e16, "flash": flash}


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; allowed: {sorted(PRESETS)}")
    return PRESETS[name]()


def first_layers(config: ModelConfig, num_layers: int) -> ModelConfig:
    """`config` with only its first `num_layers` layers (the same attention and MLP types in the
    same order; every other hyper-parameter, the MTP head included, unchanged)."""
    if not 1 <= num_layers <= config.num_layers:
        raise ValueError(f"num_layers={num_layers} is invalid; allowed: 1..{config.num_layers} "
                         "(the preset's layer count)")
    return dataclasses.replace(config, num_layers=num_layers,
                               attn_types=config.attn_types[:num_layers],
                               moe_types=config.moe_types[:num_layers])
