"""The transformers (`DeepseekV4ForCausalLM`) naming: the ONLY model file that knows HF names.

Two HF layouts exist and both are read:
- the in-memory module names (`model.layers.L.self_attn.q_a_proj.weight`, stacked
  `mlp.experts.gate_up_proj` [E, 2I, d] = cat(w1, w3)), which older saves and `state_dict()` use;
- what transformers 5.23 `save_pretrained` writes: its conversion mapping reversed, i.e. the
  official DeepSeek names under a `model.` prefix, except `model.embed_tokens`,
  `model.hc_head.hc_{fn,base,scale}` and `attn.norm` for the attention's kv_norm.
Both are converted to official DeepSeek names (`weights.py` takes it from there). `to_hf_state_dict`
goes the other way, to load dsv4 weights into a transformers model (tests, export).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

# (HF module path fragment, official fragment), applied in order to the part after `model.layers.L.`
_HF_MODULE_RENAMES: tuple[tuple[str, str], ...] = (
    ("self_attn.compressor.indexer.scorer.weights_proj.", "attn.indexer.weights_proj."),
    ("self_attn.compressor.indexer.q_b_proj.", "attn.indexer.wq_b."),
    ("self_attn.compressor.indexer.kv_proj.", "attn.indexer.compressor.wkv."),
    ("self_attn.compressor.indexer.gate_proj.", "attn.indexer.compressor.wgate."),
    ("self_attn.compressor.indexer.kv_norm.", "attn.indexer.compressor.norm."),
    ("self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
    ("self_attn.compressor.kv_proj.", "attn.compressor.wkv."),
    ("self_attn.compressor.gate_proj.", "attn.compressor.wgate."),
    ("self_attn.compressor.kv_norm.", "attn.compressor.norm."),
    ("self_attn.compressor.position_bias", "attn.compressor.ape"),
    ("self_attn.q_a_proj.", "attn.wq_a."), ("self_attn.q_a_norm.", "attn.q_norm."),
    ("self_attn.q_b_proj.", "attn.wq_b."), ("self_attn.kv_proj.", "attn.wkv."),
    ("self_attn.kv_norm.", "attn.kv_norm."), ("self_attn.o_a_proj.", "attn.wo_a."),
    ("self_attn.o_b_proj.", "attn.wo_b."), ("self_attn.sinks", "attn.attn_sink"),
    ("input_layernorm.", "attn_norm."), ("post_attention_layernorm.", "ffn_norm."),
    ("attn_hc.fn", "hc_attn_fn"), ("attn_hc.base", "hc_attn_base"),
    ("attn_hc.scale", "hc_attn_scale"),
    ("ffn_hc.fn", "hc_ffn_fn"), ("ffn_hc.base", "hc_ffn_base"), ("ffn_hc.scale", "hc_ffn_scale"),
    ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"), ("mlp.gate.", "ffn.gate."),
    ("mlp.shared_experts.gate_proj.", "ffn.shared_experts.w1."),
    ("mlp.shared_experts.up_proj.", "ffn.shared_experts.w3."),
    ("mlp.shared_experts.down_proj.", "ffn.shared_experts.w2."),
)
_TOP_LEVEL = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
              "head.weight": "head.weight", "model.norm.weight": "norm.weight",
              "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
              "model.hc_head.hc_scale": "hc_head_scale"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def is_hf_name(name: str) -> bool:
    """True for a tensor name of either transformers layout."""
    return name.startswith("model.") or name == "lm_head.weight"


def hf_to_official(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Map one transformers tensor to official (name, tensor) pairs, splitting stacked experts."""
    if name in _TOP_LEVEL:
        yield _TOP_LEVEL[name], tensor
        return
    m = _LAYER.match(name)
    if m is None:
        raise ValueError(f"unexpected tensor `{name}` in a transformers-layout checkpoint")
    prefix, rest = f"layers.{m.group(1)}.", m.group(2)
    # HF's FP8 quantizer name for the block scale
    rest = re.sub(r"\.weight_scale_inv$", ".scale", rest)
    if rest.startswith("mlp.experts."):
        yield from _split_stacked_experts(prefix, rest, tensor)
        return
    if rest == "attn.norm.weight":  # save_pretrained's name for the attention kv_norm
        rest = "attn.kv_norm.weight"
    for hf, official in _HF_MODULE_RENAMES:
        if rest.startswith(hf):
            rest = official + rest[len(hf):]
            break
    yield prefix + rest, tensor


def _split_stacked_experts(prefix: str, rest: str,
                           t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    kind = rest.removeprefix("mlp.experts.")
    if kind == "gate_up_proj":           # [E, 2I, d] = cat(w1, w3, dim=1)
        inter = t.shape[1] // 2
        parts = {"w1": t[:, :inter], "w3": t[:, inter:]}
    elif kind == "down_proj":            # [E, d, I]
        parts = {"w2": t}
    else:
        raise ValueError(f"unexpected expert tensor `model.{prefix}{rest}` "
                         "(expected gate_up_proj/down_proj)")
    for w, stacked in parts.items():
        for e in range(stacked.shape[0]):
            yield f"{prefix}ffn.experts.{e}.{w}.weight", stacked[e]


def to_hf_state_dict(official: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Official-named, dequantised tensors (per-expert) -> transformers module names.

    `mtp.*` is dropped (transformers has no MTP layer).
    """
    inverse_top = {v: k for k, v in _TOP_LEVEL.items() if k != "head.weight"}
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, t in official.items():
        if name.startswith("mtp."):
            continue
        if name in inverse_top:
            out[inverse_top[name]] = t
            continue
        m = re.match(r"^(layers\.\d+\.)ffn\.experts\.(\d+)\.(w[123])\.weight$", name)
        if m:
            experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = t
            continue
        prefix, rest = re.match(r"^(layers\.\d+\.)(.+)$", name).groups()  # type: ignore[union-attr]
        for hf, off in _HF_MODULE_RENAMES:
            if rest.startswith(off):
                rest = hf + rest[len(off):]
                break
        out[f"model.{prefix}{rest}"] = t
    for (prefix, w), per in experts.items():
        stacked = torch.stack([per[e] for e in sorted(per)])
        if w == "w2":
            out[f"model.{prefix}mlp.experts.down_proj"] = stacked
    for (prefix, w), per in experts.items():
        if w == "w1":
            w3 = torch.stack([t for _, t in sorted(experts[(prefix, "w3")].items())])
            out[f"model.{prefix}mlp.experts.gate_up_proj"] = torch.cat((torch.stack(
                [t for _, t in sorted(per.items())]), w3), dim=1)
    return out
