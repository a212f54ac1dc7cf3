"""ModelConfig: the frozen description of one DeepSeek-V4-family model.

Owns the hyper-parameters and the per-layer schedule (attention type and MoE type of every
decoder layer, plus the MTP layers). It is built once at the edge by `ModelConfig.from_hf`, which
reads BOTH checkpoint config layouts:

- the official DeepSeek `config.json` (`compress_ratios` of length n_layers + n_mtp with values
  0 / 4 / m', `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`, `expert_dtype`, ...), and
- the transformers `DeepseekV4Config` layout (`layer_types`, `mlp_layer_types`,
  `rope_parameters` {main, compress}, `compress_rates`, `partial_rotary_factor`, ...).

Invariant: every field is validated here; the model code never re-checks the schedule. Unknown or
inconsistent values raise `ValueError` naming the field and the allowed values. This file and
`model/state_dict_adapter.py` are the only places that know transformers' names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

AttnType = Literal["swa", "csa", "hca"]
MoEType = Literal["hash", "routed"]
WeightQuant = Literal["none", "fp8", "fp8+fp4"]

ATTN_TYPES: tuple[str, ...] = ("swa", "csa", "hca")
MOE_TYPES: tuple[str, ...] = ("hash", "routed")
WEIGHT_QUANTS: tuple[str, ...] = ("none", "fp8", "fp8+fp4")

# transformers' names for the schedules (the only other place they appear: state_dict_adapter.py)
_HF_ATTN = {"sliding_attention": "swa", "compressed_sparse_attention": "csa",
            "heavily_compressed_attention": "hca"}
_HF_MOE = {"hash_moe": "hash", "moe": "routed"}


@dataclass(frozen=True)
class YarnConfig:
    """YaRN frequency blending for the compressed (CSA/HCA) layers; no attention mscale (§6.1)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a DeepSeek-V4 model. Per-layer tuples have length `num_layers`."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    attn_types: tuple[str, ...]
    moe_types: tuple[str, ...]
    csa_ratio: int = 4
    hca_ratio: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_inter_dim: int = 2048
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn: YarnConfig | None = None
    max_position_embeddings: int = 1048576
    num_mtp_layers: int = 1
    bos_token_id: int = 0
    eos_token_id: int = 1
    weight_quant: str = "none"

    def __post_init__(self) -> None:
        _validate(self)

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    @property
    def hc_mix_dim(self) -> int:
        """Width of the mHC projection: pre (n) + post (n) + comb (n*n)."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5

    def compress_ratio(self, layer: int) -> int:
        """0 for SWA-only layers, `csa_ratio` for CSA, `hca_ratio` for HCA (MTP layers: 0)."""
        kind = self.attn_types[layer] if layer < self.num_layers else "swa"
        return {"swa": 0, "csa": self.csa_ratio, "hca": self.hca_ratio}[kind]

    # ---- conversion at the edge -----------------------------------------------------------
    @classmethod
    def from_hf(cls, source: str | Path | dict[str, Any]) -> ModelConfig:
        """Build from a checkpoint directory, a config.json path, or an already-parsed dict."""
        raw = _read_config(source)
        return _from_hf_transformers(raw) if "layer_types" in raw else _from_hf_official(raw)

    def to_official_dict(self) -> dict[str, Any]:
        """The official DeepSeek `config.json` for this model (written by `dsv4 init`)."""
        return _to_official(self)

    def to_hf_dict(self) -> dict[str, Any]:
        """Keyword arguments for transformers' `DeepseekV4Config` (test oracle and export)."""
        return _to_transformers(self)

    def replace(self, **changes: Any) -> ModelConfig:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return ModelConfig(**values)


# ---- validation ----------------------------------------------------------------------------------
def _check(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"invalid model config field `{name}` = {value!r}; allowed: {allowed}")


def _validate(c: ModelConfig) -> None:
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "q_lora_rank",
                 "o_groups", "o_lora_rank", "window", "index_n_heads", "index_head_dim",
                 "index_topk", "n_routed_experts", "num_experts_per_tok", "moe_inter_dim",
                 "hc_mult", "hc_sinkhorn_iters", "max_position_embeddings"):
        value = getattr(c, name)
        _check(isinstance(value, int) and not isinstance(value, bool) and value > 0, name, value,
               "a positive integer")
    _check(len(c.attn_types) == c.num_layers, "attn_types", c.attn_types,
           f"a sequence of length num_layers={c.num_layers}")
    _check(len(c.moe_types) == c.num_layers, "moe_types", c.moe_types,
           f"a sequence of length num_layers={c.num_layers}")
    for t in c.attn_types:
        _check(t in ATTN_TYPES, "attn_types", t, f"one of {ATTN_TYPES}")
    for t in c.moe_types:
        _check(t in MOE_TYPES, "moe_types", t, f"one of {MOE_TYPES}")
    _check(0 < c.rope_head_dim <= c.head_dim and c.rope_head_dim % 2 == 0, "rope_head_dim",
           c.rope_head_dim, f"an even integer in (0, head_dim={c.head_dim}]")
    _check(c.index_head_dim >= c.rope_head_dim, "index_head_dim", c.index_head_dim,
           f">= rope_head_dim={c.rope_head_dim}")
    _check((c.num_heads * c.head_dim) % c.o_groups == 0 and c.num_heads % c.o_groups == 0,
           "o_groups", c.o_groups, f"a divisor of num_heads={c.num_heads}")
    _check(c.csa_ratio > 0, "csa_ratio", c.csa_ratio, "a positive integer")
    _check(c.hca_ratio > 0 and c.hca_ratio != c.csa_ratio, "hca_ratio", c.hca_ratio,
           f"a positive integer other than csa_ratio={c.csa_ratio}")
    _check(c.num_experts_per_tok <= c.n_routed_experts, "num_experts_per_tok",
           c.num_experts_per_tok, f"<= n_routed_experts={c.n_routed_experts}")
    _check(c.n_shared_experts == 1, "n_shared_experts", c.n_shared_experts,
           "1 (DeepSeek-V4 has one shared expert)")
    _check(c.num_mtp_layers >= 0, "num_mtp_layers", c.num_mtp_layers, "a non-negative integer")
    _check(c.weight_quant in WEIGHT_QUANTS, "weight_quant", c.weight_quant,
           f"one of {WEIGHT_QUANTS}")


# ---- reading -------------------------------------------------------------------------------------
def _read_config(source: str | Path | dict[str, Any]) -> dict[str, Any]:
    if isinstance(source, dict):
        return dict(source)
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model config not found: {path} (expected a checkpoint "
                                "directory containing config.json, or the path of a config.json)")
    with path.open() as f:
        raw = json.load(f)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: config.json must hold a JSON object, "
                         f"got {type(raw).__name__}")
    return raw


def _require(raw: dict[str, Any], key: str) -> Any:
    if key not in raw:
        raise ValueError(f"model config is missing required field `{key}`")
    return raw[key]


def _common_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """Fields whose names the two layouts share."""
    scoring = raw.get("scoring_func", "sqrtsoftplus")
    _check(scoring == "sqrtsoftplus", "scoring_func", scoring, "'sqrtsoftplus' (DeepSeek-V4)")
    kv_heads = raw.get("num_key_value_heads", 1)
    _check(kv_heads == 1, "num_key_value_heads", kv_heads, "1 (shared single-KV-head MQA)")
    tie = raw.get("tie_word_embeddings", False)
    _check(tie is False, "tie_word_embeddings", tie, "false (DeepSeek-V4 unties embed and head)")
    topk_method = raw.get("topk_method", "noaux_tc")
    _check(topk_method == "noaux_tc", "topk_method", topk_method, "'noaux_tc'")
    eos = raw.get("eos_token_id", 1)
    out: dict[str, Any] = dict(
        vocab_size=_require(raw, "vocab_size"), hidden_size=_require(raw, "hidden_size"),
        num_layers=_require(raw, "num_hidden_layers"),
        num_heads=_require(raw, "num_attention_heads"),
        head_dim=raw.get("head_dim", 512), q_lora_rank=_require(raw, "q_lora_rank"),
        o_groups=_require(raw, "o_groups"), o_lora_rank=_require(raw, "o_lora_rank"),
        window=raw.get("sliding_window", 128), index_n_heads=raw.get("index_n_heads", 64),
        index_head_dim=raw.get("index_head_dim", 128), index_topk=raw.get("index_topk", 512),
        n_routed_experts=_require(raw, "n_routed_experts"),
        n_shared_experts=raw.get("n_shared_experts", 1),
        num_experts_per_tok=_require(raw, "num_experts_per_tok"),
        moe_inter_dim=_require(raw, "moe_intermediate_size"),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.5)),
        swiglu_limit=float(raw.get("swiglu_limit", 10.0)), hc_mult=raw.get("hc_mult", 4),
        hc_sinkhorn_iters=raw.get("hc_sinkhorn_iters", 20), hc_eps=float(raw.get("hc_eps", 1e-6)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=raw.get("max_position_embeddings", 1048576),
        num_mtp_layers=raw.get("num_nextn_predict_layers", 1) or 0,
        bos_token_id=raw.get("bos_token_id", 0) if raw.get("bos_token_id") is not None else 0,
        eos_token_id=eos[0] if isinstance(eos, list) else (eos if eos is not None else 1),
        weight_quant=_weight_quant(raw),
    )
    return out


def _weight_quant(raw: dict[str, Any]) -> str:
    q = raw.get("quantization_config")
    if not q:
        return "none"
    _check(isinstance(q, dict), "quantization_config", q, "a JSON object")
    method = q.get("quant_method", "fp8")
    _check(method == "fp8", "quantization_config.quant_method", method, "'fp8'")
    fmt = q.get("fmt", "e4m3")
    _check(fmt == "e4m3", "quantization_config.fmt", fmt, "'e4m3'")
    scale_fmt = q.get("scale_fmt", "ue8m0")
    _check(scale_fmt == "ue8m0", "quantization_config.scale_fmt", scale_fmt, "'ue8m0'")
    block = list(q.get("weight_block_size", [128, 128]))
    _check(block == [128, 128], "quantization_config.weight_block_size", block, "[128, 128]")
    expert_dtype = raw.get("expert_dtype", q.get("expert_dtype", "fp8"))
    _check(expert_dtype in ("fp8", "fp4"), "expert_dtype", expert_dtype, "'fp8' or 'fp4'")
    return "fp8+fp4" if expert_dtype == "fp4" else "fp8"


def _yarn_from(params: dict[str, Any] | None, field_name: str) -> YarnConfig | None:
    if not params:
        return None
    kind = params.get("rope_type", params.get("type", "default"))
    _check(kind in ("yarn", "default", "deepseek_yarn"), f"{field_name}.rope_type", kind,
           "'yarn' or 'default'")
    if kind == "default":
        return None
    attention_factor = params.get("attention_factor", 1.0)
    _check(attention_factor in (None, 1.0), f"{field_name}.attention_factor", attention_factor,
           "1.0 (DeepSeek-V4 applies no YaRN mscale)")
    return YarnConfig(factor=float(_require(params, "factor")),
                      original_max_position_embeddings=int(
                          _require(params, "original_max_position_embeddings")),
                      beta_fast=float(params.get("beta_fast") or 32),
                      beta_slow=float(params.get("beta_slow") or 1))


def _from_hf_official(raw: dict[str, Any]) -> ModelConfig:
    c = _common_fields(raw)
    n = c["num_layers"]
    ratios = list(_require(raw, "compress_ratios"))
    _check(len(ratios) >= n, "compress_ratios", ratios,
           f"a list of at least num_hidden_layers={n} entries")
    attn, hca = [], set()
    for r in ratios[:n]:
        _check(isinstance(r, int) and r >= 0, "compress_ratios", r,
               "0 (SWA), 4 (CSA) or the HCA ratio")
        attn.append("swa" if r == 0 else "csa" if r == 4 else "hca")
        if r not in (0, 4):
            hca.add(r)
    _check(len(hca) <= 1, "compress_ratios", sorted(hca),
           "a single HCA ratio shared by every HCA layer")
    for r in ratios[n:n + c["num_mtp_layers"]]:
        _check(r == 0, "compress_ratios (MTP entries)", r, "0 (the MTP layer is SWA-only)")
    num_hash = raw.get("num_hash_layers", 3)
    _check(isinstance(num_hash, int) and 0 <= num_hash <= n, "num_hash_layers", num_hash, f"0..{n}")
    rope_dim = raw.get("qk_rope_head_dim", 64)
    return ModelConfig(**c, rope_head_dim=rope_dim, attn_types=tuple(attn),
                       moe_types=tuple(["hash"] * num_hash + ["routed"] * (n - num_hash)),
                       csa_ratio=4, hca_ratio=hca.pop() if hca else 128,
                       rope_theta=float(raw.get("rope_theta", 10000.0)),
                       compress_rope_theta=float(raw.get("compress_rope_theta", 160000.0)),
                       yarn=_yarn_from(raw.get("rope_scaling"), "rope_scaling"))


def _from_hf_transformers(raw: dict[str, Any]) -> ModelConfig:
    c = _common_fields(raw)
    n = c["num_layers"]
    layer_types = list(raw["layer_types"])[:n]
    _check(len(layer_types) == n, "layer_types", raw["layer_types"],
           f"a list of num_hidden_layers={n} entries")
    for t in layer_types:
        _check(t in _HF_ATTN, "layer_types", t, f"one of {tuple(_HF_ATTN)}")
    mlp_types = raw.get("mlp_layer_types")
    if mlp_types is None:
        num_hash = raw.get("num_hash_layers", 3)
        mlp_types = ["hash_moe"] * min(n, num_hash) + ["moe"] * max(0, n - num_hash)
    mlp_types = list(mlp_types)[:n]
    _check(len(mlp_types) == n, "mlp_layer_types", mlp_types,
           f"a list of num_hidden_layers={n} entries")
    for t in mlp_types:
        _check(t in _HF_MOE, "mlp_layer_types", t, f"one of {tuple(_HF_MOE)}")
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128,
             **(raw.get("compress_rates") or {})}
    rope_dim = raw.get("qk_rope_head_dim")
    if rope_dim is None:
        factor = raw.get("partial_rotary_factor") or 64 / 512
        rope_dim = int(c["head_dim"] * factor)
    rope = raw.get("rope_parameters") or {}
    main: dict[str, Any] = rope["main"] if isinstance(rope.get("main"), dict) else {}
    compress: dict[str, Any]
    if isinstance(rope.get("compress"), dict):
        compress = rope["compress"]
    else:  # flat (un-nested) form: the YaRN dict applies to the compressed layers
        compress = {k: v for k, v in rope.items() if k not in ("main", "compress")}
    _check(_yarn_from(main, "rope_parameters.main") is None, "rope_parameters.main", main,
           "default RoPE (YaRN applies only to compressed layers)")
    return ModelConfig(**c, rope_head_dim=rope_dim,
                       attn_types=tuple(_HF_ATTN[t] for t in layer_types),
                       moe_types=tuple(_HF_MOE[t] for t in mlp_types),
                       csa_ratio=int(rates["compressed_sparse_attention"]),
                       hca_ratio=int(rates["heavily_compressed_attention"]),
                       rope_theta=float(main.get("rope_theta", raw.get("rope_theta", 10000.0))),
                       compress_rope_theta=float(compress.get(
                           "rope_theta", raw.get("compress_rope_theta", 160000.0))),
                       yarn=_yarn_from(compress, "rope_parameters.compress"))


# ---- writing -------------------------------------------------------------------------------------
def _shared_out(c: ModelConfig) -> dict[str, Any]:
    return dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
                num_attention_heads=c.num_heads, num_key_value_heads=1, head_dim=c.head_dim,
                q_lora_rank=c.q_lora_rank, o_groups=c.o_groups, o_lora_rank=c.o_lora_rank,
                sliding_window=c.window, index_n_heads=c.index_n_heads,
                index_head_dim=c.index_head_dim, index_topk=c.index_topk,
                n_routed_experts=c.n_routed_experts, n_shared_experts=c.n_shared_experts,
                num_experts_per_tok=c.num_experts_per_tok, moe_intermediate_size=c.moe_inter_dim,
                routed_scaling_factor=c.routed_scaling_factor, scoring_func="sqrtsoftplus",
                norm_topk_prob=True, swiglu_limit=c.swiglu_limit, hc_mult=c.hc_mult,
                hc_sinkhorn_iters=c.hc_sinkhorn_iters, hc_eps=c.hc_eps, rms_norm_eps=c.rms_norm_eps,
                rope_theta=c.rope_theta, compress_rope_theta=c.compress_rope_theta,
                max_position_embeddings=c.max_position_embeddings,
                num_nextn_predict_layers=c.num_mtp_layers, bos_token_id=c.bos_token_id,
                eos_token_id=c.eos_token_id, tie_word_embeddings=False, hidden_act="silu")


def _yarn_dict(y: YarnConfig) -> dict[str, Any]:
    return {"factor": y.factor,
            "original_max_position_embeddings": y.original_max_position_embeddings,
            "beta_fast": y.beta_fast, "beta_slow": y.beta_slow}


def _to_official(c: ModelConfig) -> dict[str, Any]:
    hashes = sum(1 for t in c.moe_types if t == "hash")
    if c.moe_types != tuple(["hash"] * hashes + ["routed"] * (c.num_layers - hashes)):
        raise ValueError(f"moe_types={c.moe_types} cannot be written as `num_hash_layers` "
                         "(the official layout needs the hash layers first)")
    if c.csa_ratio != 4 and "csa" in c.attn_types:
        raise ValueError(f"csa_ratio={c.csa_ratio} cannot be written in the official layout "
                         "(needs 4)")
    out: dict[str, Any] = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
                           **_shared_out(c), "torch_dtype": "bfloat16", "topk_method": "noaux_tc",
                           "qk_rope_head_dim": c.rope_head_dim, "num_hash_layers": hashes,
                           "compress_ratios": [c.compress_ratio(i) for i in range(c.num_layers)]
                           + [0] * c.num_mtp_layers}
    if c.yarn is not None:
        out["rope_scaling"] = {"type": "yarn", **_yarn_dict(c.yarn)}
    if c.weight_quant != "none":
        out["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                      "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}
        out["expert_dtype"] = "fp4" if c.weight_quant == "fp8+fp4" else "fp8"
    return out


def _to_transformers(c: ModelConfig) -> dict[str, Any]:
    inv_attn = {v: k for k, v in _HF_ATTN.items()}
    inv_moe = {v: k for k, v in _HF_MOE.items()}
    out = _shared_out(c)
    out.update(layer_types=[inv_attn[t] for t in c.attn_types],
               mlp_layer_types=[inv_moe[t] for t in c.moe_types],
               compress_rates={"compressed_sparse_attention": c.csa_ratio,
                               "heavily_compressed_attention": c.hca_ratio},
               partial_rotary_factor=c.rope_head_dim / c.head_dim)
    if c.yarn is not None:
        out["rope_parameters"] = {"rope_type": "yarn", **_yarn_dict(c.yarn)}
    return out
