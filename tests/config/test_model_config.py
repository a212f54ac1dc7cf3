"""ModelConfig.from_hf: both config layouts, the release schedules (model-spec §2, §3), round
trips and errors.

The official V4-Flash / V4-Pro `config.json` files are written out below from the spec (§2 table,
§3 compress_ratios); transformers' `DeepseekV4Config` is the oracle for the transformers layout.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest

from dsv4.checkpoint.presets import flash_4l, flash_43l_e16, micro
from dsv4.config.model import ModelConfig, YarnConfig
from dsv4.model.deepseek_v4 import num_params

FP8_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
             "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def flash_official() -> dict[str, Any]:
    """The official DeepSeek-V4-Flash config.json (spec §2, §3)."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "torch_dtype": "bfloat16", "vocab_size": 129280, "hidden_size": 4096,
        "num_hidden_layers": 43, "num_attention_heads": 64,
        "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024,
        "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128,
        "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0], "num_hash_layers": 3,
        "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6,
        "moe_intermediate_size": 2048,
        "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc", "norm_topk_prob": True,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
        "rope_theta": 10000, "compress_rope_theta": 160000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 1048576, "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 1, "num_nextn_predict_layers": 1,
        "expert_dtype": "fp4", "quantization_config": dict(FP8_QUANT),
    }


def pro_official() -> dict[str, Any]:
    """The official DeepSeek-V4-Pro config.json (spec §2, §3)."""
    return {**flash_official(), "hidden_size": 7168, "num_hidden_layers": 61,
            "num_attention_heads": 128, "q_lora_rank": 1536, "o_groups": 16,
            "n_routed_experts": 384, "moe_intermediate_size": 3072,
            "index_topk": 1024, "routed_scaling_factor": 2.5,
            "compress_ratios": [128, 128] + [4, 128] * 29 + [4, 0]}


def hf_dict(cfg: ModelConfig) -> dict[str, Any]:
    """What transformers makes of `cfg.to_hf_dict()`: `DeepseekV4Config(**kwargs).to_dict()`."""
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.DeepseekV4Config(**cfg.to_hf_dict()).to_dict()


# ---- the release schedules -----------------------------------------------------------------------
def test_flash_official_schedule() -> None:
    cfg = ModelConfig.from_hf(flash_official())
    assert cfg.num_layers == 43 and len(cfg.attn_types) == 43 and len(cfg.moe_types) == 43
    assert cfg.attn_types[:2] == ("swa", "swa")
    assert [i for i, t in enumerate(cfg.attn_types) if t == "csa"] == list(range(2, 43, 2))
    assert [i for i, t in enumerate(cfg.attn_types) if t == "hca"] == list(range(3, 42, 2))
    assert cfg.attn_types.count("swa") == 2 and cfg.attn_types.count("csa") == 21
    assert cfg.attn_types.count("hca") == 20
    assert cfg.moe_types == ("hash",) * 3 + ("routed",) * 40
    assert (cfg.csa_ratio, cfg.hca_ratio) == (4, 128)
    # 43 = MTP: 0
    assert [cfg.compress_ratio(i) for i in range(44)] == flash_official()["compress_ratios"]
    assert cfg.weight_quant == "fp8+fp4"
    assert cfg.yarn == YarnConfig(factor=16.0, original_max_position_embeddings=65536,
                                  beta_fast=32.0, beta_slow=1.0)
    assert (cfg.rope_theta, cfg.compress_rope_theta) == (10000.0, 160000.0)
    assert (cfg.hidden_size, cfg.num_heads, cfg.head_dim) == (4096, 64, 512)
    assert (cfg.rope_head_dim, cfg.nope_head_dim) == (64, 448)
    assert (cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank, cfg.window) == (1024, 8, 1024, 128)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (64, 128, 512)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_inter_dim,
            cfg.n_shared_experts) == (256, 6, 2048, 1)
    assert (cfg.routed_scaling_factor, cfg.swiglu_limit) == (1.5, 10.0)
    assert (cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.hc_mix_dim) == (4, 20, 1e-6, 24)
    assert (cfg.num_mtp_layers, cfg.vocab_size, cfg.max_position_embeddings) == (1, 129280, 1048576)
    # the flash-43l-e16 preset is this schedule with 16 experts
    assert cfg == flash_43l_e16().replace(n_routed_experts=256, weight_quant="fp8+fp4")


def test_flash_num_params_matches_spec() -> None:
    n = num_params(ModelConfig.from_hf(flash_official()))
    assert round(n / 1e9, 2) == 284.33  # spec §2: the HF count without MTP


def test_pro_official_schedule() -> None:
    cfg = ModelConfig.from_hf(pro_official())
    assert cfg.num_layers == 61 and len(cfg.attn_types) == 61
    hca = [i for i, t in enumerate(cfg.attn_types) if t == "hca"]
    csa = [i for i, t in enumerate(cfg.attn_types) if t == "csa"]
    assert hca == [0, 1] + list(range(3, 61, 2)) and len(hca) == 31
    assert csa == list(range(2, 61, 2)) and len(csa) == 30
    assert "swa" not in cfg.attn_types
    assert cfg.compress_ratio(61) == 0  # MTP layer is SWA-only
    assert cfg.moe_types == ("hash",) * 3 + ("routed",) * 58
    assert (cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank) == (7168, 128, 1536)
    assert (cfg.o_groups, cfg.o_lora_rank) == (16, 1024)
    assert (cfg.n_routed_experts, cfg.moe_inter_dim) == (384, 3072)
    assert (cfg.index_topk, cfg.routed_scaling_factor) == (1024, 2.5)
    assert (cfg.csa_ratio, cfg.hca_ratio, cfg.weight_quant) == (4, 128, "fp8+fp4")


def test_longer_compress_ratios_only_first_layers_count() -> None:
    """Later checkpoints add trailing entries (draft heads, spec §3); the first n are the layers."""
    raw = {**flash_official(), "compress_ratios": flash_official()["compress_ratios"] + [0, 0]}
    assert ModelConfig.from_hf(raw) == ModelConfig.from_hf(flash_official())


# ---- transformers layout -------------------------------------------------------------------------
def test_transformers_layout_tiny() -> None:
    cfg = micro()
    d = hf_dict(cfg)
    assert "layer_types" in d and d.get("compress_ratios") is None  # really the transformers layout
    assert ModelConfig.from_hf(d) == cfg


def test_transformers_layout_flash() -> None:
    cfg = ModelConfig.from_hf(flash_official())
    got = ModelConfig.from_hf(hf_dict(cfg))
    # to_hf_dict describes the dequantised in-memory model, so only weight_quant can differ (below)
    assert got.replace(weight_quant=cfg.weight_quant) == cfg


def test_transformers_export_is_dequantised() -> None:
    """`to_hf_dict` describes the model transformers builds: dequantised, no quantization_config."""
    cfg = ModelConfig.from_hf(flash_official())
    assert cfg.weight_quant == "fp8+fp4"
    assert "quantization_config" not in cfg.to_hf_dict()
    assert ModelConfig.from_hf(hf_dict(cfg)) == cfg.replace(weight_quant="none")


def test_transformers_parse_of_official_flash() -> None:
    """transformers reads the official config.json itself (legacy keys -> `layer_types`,
    `rope_parameters`, `quantization_config.expert_dtype`, spec §2); its `to_dict()` must give back
    the same `ModelConfig`."""
    transformers = pytest.importorskip("transformers")
    d = transformers.DeepseekV4Config(**flash_official()).to_dict()
    assert len(d["layer_types"]) == 43
    assert ModelConfig.from_hf(d) == ModelConfig.from_hf(flash_official())


def test_transformers_config_json_directory(tmp_path: Path) -> None:
    cfg = micro()
    (tmp_path / "config.json").write_text(json.dumps(hf_dict(cfg)))
    assert ModelConfig.from_hf(tmp_path) == cfg
    assert ModelConfig.from_hf(str(tmp_path)) == cfg
    assert ModelConfig.from_hf(tmp_path / "config.json") == cfg


def test_official_config_json_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(flash_official()))
    assert ModelConfig.from_hf(tmp_path) == ModelConfig.from_hf(flash_official())


# ---- round trips through the official layout -----------------------------------------------------
@pytest.mark.parametrize("cfg", [
    micro(), micro().replace(weight_quant="fp8"), micro().replace(weight_quant="fp8+fp4"),
    flash_4l(), flash_43l_e16(),
], ids=["tiny", "tiny-fp8", "tiny-fp8+fp4", "flash-4l", "flash-43l-e16"])
def test_official_round_trip(cfg: ModelConfig) -> None:
    official = cfg.to_official_dict()
    assert len(official["compress_ratios"]) == cfg.num_layers + cfg.num_mtp_layers
    assert json.loads(json.dumps(official)) == official  # plain JSON
    assert ModelConfig.from_hf(official) == cfg


def test_official_round_trip_quant_keys() -> None:
    assert "quantization_config" not in micro().to_official_dict()
    d = micro().replace(weight_quant="fp8+fp4").to_official_dict()
    assert d["expert_dtype"] == "fp4" and d["quantization_config"]["fmt"] == "e4m3"
    assert micro().replace(weight_quant="fp8").to_official_dict()["expert_dtype"] == "fp8"


# ---- errors: ValueError naming the field and the allowed values ----------------------------------
def test_unknown_layer_type() -> None:
    d = hf_dict(micro())
    d["layer_types"] = ["sliding_attention"] * 4 + ["linear_attention"]
    with pytest.raises(ValueError, match=r"`layer_types`.*linear_attention.*allowed"
                                         r".*compressed_sparse_attention"):
        ModelConfig.from_hf(d)


def test_layer_types_too_short() -> None:
    d = hf_dict(micro())
    d["layer_types"] = d["layer_types"][:4]
    # the error names the config.json field and the required length
    with pytest.raises(ValueError,
                       match=r"`layer_types`.*allowed: a list of num_hidden_layers=5 entries"):
        ModelConfig.from_hf(d)


def test_layer_types_longer_is_truncated_like_transformers() -> None:
    d = hf_dict(micro())
    d["layer_types"] = d["layer_types"] + ["sliding_attention"]
    assert ModelConfig.from_hf(d) == micro()


def test_unknown_mlp_layer_type() -> None:
    d = hf_dict(micro())
    d["mlp_layer_types"] = ["hash_moe", "hash_moe", "moe", "moe", "dense"]
    with pytest.raises(ValueError, match=r"`mlp_layer_types`.*dense.*allowed.*hash_moe"):
        ModelConfig.from_hf(d)


def test_two_hca_ratios() -> None:
    raw = flash_official()
    raw["compress_ratios"] = [0, 0] + [4, 128] * 19 + [4, 64] + [4, 0]
    with pytest.raises(ValueError,
                       match=r"`compress_ratios`.*\[64, 128\].*allowed: a single HCA ratio"):
        ModelConfig.from_hf(raw)


def test_compress_ratios_too_short() -> None:
    raw = flash_official()
    raw["compress_ratios"] = raw["compress_ratios"][:40]
    with pytest.raises(ValueError, match=r"`compress_ratios`.*allowed: "
                                         r"a list of at least num_hidden_layers=43"):
        ModelConfig.from_hf(raw)


def test_mtp_entry_not_zero() -> None:
    raw = flash_official()
    raw["compress_ratios"] = [0, 0] + [4, 128] * 20 + [4, 4]
    with pytest.raises(ValueError, match=r"`compress_ratios \(MTP entries\)` = 4; allowed: 0"):
        ModelConfig.from_hf(raw)


@pytest.mark.parametrize(("key", "value", "pattern"), [
    ("scoring_func", "softmax", r"`scoring_func` = 'softmax'; allowed: 'sqrtsoftplus'"),
    ("num_key_value_heads", 2, r"`num_key_value_heads` = 2; allowed: 1"),
    ("expert_dtype", "int4", r"`expert_dtype` = 'int4'; allowed: 'fp8' or 'fp4'"),
    ("tie_word_embeddings", True, r"`tie_word_embeddings` = True; allowed: false"),
    ("topk_method", "greedy", r"`topk_method` = 'greedy'; allowed: 'noaux_tc'"),
    ("quantization_config", {**FP8_QUANT, "fmt": "e5m2"},
     r"`quantization_config.fmt` = 'e5m2'; allowed: 'e4m3'"),
    ("quantization_config", {**FP8_QUANT, "weight_block_size": [64, 64]},
     r"`quantization_config.weight_block_size`.*allowed: \[128, 128\]"),
    ("rope_scaling", {"type": "linear", "factor": 2.0},
     r"`rope_scaling.rope_type` = 'linear'; allowed: 'yarn'"),
    ("qk_rope_head_dim", 63, r"`rope_head_dim` = 63; allowed: an even integer"),
    ("hidden_size", 0, r"`hidden_size` = 0; allowed: a positive integer"),
], ids=lambda v: v if isinstance(v, str) and " " not in v else None)
def test_invalid_official_field(key: str, value: Any, pattern: str) -> None:
    raw = flash_official()
    raw[key] = value
    with pytest.raises(ValueError, match=pattern):
        ModelConfig.from_hf(raw)


@pytest.mark.parametrize("key", ["hidden_size", "vocab_size", "num_hidden_layers",
                                 "compress_ratios", "n_routed_experts"])
def test_missing_required_field(key: str) -> None:
    raw = flash_official()
    del raw[key]
    with pytest.raises(ValueError, match=rf"missing required field `{key}`"):
        ModelConfig.from_hf(raw)


def test_missing_required_field_transformers_layout() -> None:
    d = hf_dict(micro())
    del d["hidden_size"]
    with pytest.raises(ValueError, match=r"missing required field `hidden_size`"):
        ModelConfig.from_hf(d)


def test_nonexistent_path() -> None:
    with pytest.raises(FileNotFoundError, match=r"/nonexistent/dir"):
        ModelConfig.from_hf("/nonexistent/dir")


def test_config_json_not_an_object(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        ModelConfig.from_hf(tmp_path)


def test_direct_construction_bogus_attn_type() -> None:
    with pytest.raises(ValueError,
                       match=r"`attn_types` = 'bogus'; allowed: one of \('swa', 'csa', 'hca'\)"):
        micro().replace(attn_types=("swa",) * 4 + ("bogus",))


def test_direct_construction_bogus_moe_type() -> None:
    with pytest.raises(ValueError,
                       match=r"`moe_types` = 'dense'; allowed: one of \('hash', 'routed'\)"):
        micro().replace(moe_types=("hash",) * 4 + ("dense",))


@pytest.mark.parametrize("rope_head_dim", [7, 0, 34])
def test_rope_head_dim_invalid(rope_head_dim: int) -> None:
    pattern = rf"`rope_head_dim` = {rope_head_dim}; allowed: an even integer in \(0, head_dim=32\]"
    with pytest.raises(ValueError, match=pattern):
        micro().replace(rope_head_dim=rope_head_dim)


def test_weight_quant_invalid() -> None:
    with pytest.raises(ValueError, match=r"`weight_quant` = 'int8'; "
                                         r"allowed: one of \('none', 'fp8', 'fp8\+fp4'\)"):
        micro().replace(weight_quant="int8")


def test_mlp_layer_types_longer_is_truncated_like_transformers() -> None:
    d = hf_dict(micro())
    d["mlp_layer_types"] = d["mlp_layer_types"] + ["moe"]
    assert ModelConfig.from_hf(d) == micro()
