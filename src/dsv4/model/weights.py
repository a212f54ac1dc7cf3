"""Checkpoint reading: safetensors shards -> a `DeepSeekV4ForCausalLM`, streaming shard by shard.

Reads the official DeepSeek layout (FP8 e4m3 weights with UE8M0 128x128 block scales in
`X.scale`, FP4 e2m1 experts packed [out, in/2] with per-32 UE8M0 scales, `mtp.*`) and both
transformers layouts (converted to official names by `state_dict_adapter.py`). Quantised weights are
dequantised on load to the model dtype, except into modules kept in checkpoint encoding
(`QuantExperts`, `QuantLinear`: `weight_format="checkpoint"`), which take the codes and scales as
they are (a float weight, as transformers-layout files hold, is encoded). Every parameter must be
filled exactly once: missing, unexpected or mis-shaped tensors raise a `CheckpointError` naming
the tensor (and both shapes). Never uses pickle: only `safetensors`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from dsv4.kernels.ref import quant
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.model.quant_experts import QuantExperts
from dsv4.model.quant_linear import QuantLinear
from dsv4.model.state_dict_adapter import hf_to_official, is_hf_name
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)

_HC = re.compile(r"(^|\.)hc_(attn|ffn|head)_(fn|base|scale)$")
_EXPERT = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w[123])\.(weight|scale)$")
_FP8_DTYPES = (torch.float8_e4m3fn,)
_FP4_DTYPES = (torch.int8, torch.uint8) + ((torch.float4_e2m1fn_x2,)
                                           if hasattr(torch, "float4_e2m1fn_x2") else ())


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: names the tensor and the shapes."""


@dataclass(frozen=True)
class Target:
    """Where an official tensor goes: internal parameter/buffer name and, for experts, the row."""

    name: str
    expert: int | None = None


def official_to_internal(name: str) -> Target:
    """Official DeepSeek name (weights only, not `.scale`) -> internal target."""
    m = _EXPERT.match(name)
    if m:
        return Target(f"{m.group(1)}.{m.group(3)}", int(m.group(2)))
    return Target(_HC.sub(r"\1hc_\2.\3", name))


def internal_to_official(name: str, num_experts: int) -> list[tuple[str, int | None]]:
    """Internal name -> official names (stacked experts fan out to one name per expert)."""
    m = re.match(r"^(.*\.ffn\.experts)\.(w[123])$", name)
    if m:
        return [(f"{m.group(1)}.{e}.{m.group(2)}.weight", e) for e in range(num_experts)]
    return [(re.sub(r"(^|\.)hc_(attn|ffn|head)\.(fn|base|scale)$", r"\1hc_\2_\3", name), None)]


def official_state_dict(model: DeepSeekV4ForCausalLM) -> dict[str, torch.Tensor]:
    """Official-named tensors of the model (dequantised; stacked experts fanned out as views)."""
    if any(isinstance(m, QuantExperts | QuantLinear) for m in model.modules()):
        raise ValueError("this model keeps its weights in checkpoint encoding "
                         "(weight_format='checkpoint'); load it with weight_format='bf16' to "
                         "export or train it")
    out: dict[str, torch.Tensor] = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("inv_freq"):
            continue
        for official, expert in internal_to_official(name, model.config.n_routed_experts):
            out[official] = (t[expert] if expert is not None else t).detach()
    return out


def shard_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint (index json, single file, or all `*.safetensors`)."""
    if not path.exists():
        raise FileNotFoundError(f"checkpoint path does not exist: {path}")
    if path.is_file():
        return [path]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shard files that do not exist: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in checkpoint directory {path}")
    return files


def checkpoint_keys(files: list[Path]) -> list[str]:
    """Every tensor name of the checkpoint (reads only the safetensors headers)."""
    keys: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            keys.extend(f.keys())
    return keys


def fp8_linear_names(keys: list[str]) -> set[str]:
    """Official names (less `.weight`) of the non-expert weights the checkpoint stores with a
    block scale (`X.scale`, or transformers' `X.weight_scale_inv`): its FP8 linears."""
    names = set()
    for key in keys:
        if is_hf_name(key):
            if ".mlp.experts." in key:
                continue
            key = next(hf_to_official(key, torch.empty(0)))[0]
        if key.endswith(".scale") and not _EXPERT.match(key):
            names.add(key.removesuffix(".scale"))
    return names


def iter_official_tensors(files: list[Path],
                          progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (official name, tensor) over the shards, converting transformers names on the fly."""
    for file in tqdm(files, desc="loading shards", unit="shard",
                     disable=not progress or len(files) < 2):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                tensor = f.get_tensor(key)
                if is_hf_name(key):
                    yield from hf_to_official(key, tensor)
                else:
                    yield key, tensor


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Codes + UE8M0 scales -> `dtype`: FP8 e4m3 with 128x128 blocks, else packed FP4 per 32.
    Elementwise (code x its block's scale), so any block-aligned part of a tensor dequantises to
    the same values as that part of the whole."""
    if weight.dtype in _FP8_DTYPES:
        return quant.dequant_fp8_block(weight, scale, dtype)
    return quant.dequant_fp4_group(weight, scale, dtype)


class WeightLoader:
    """Fills model parameters from official-named tensors; pairs quantised weights with scales."""

    def __init__(self, model: DeepSeekV4ForCausalLM) -> None:
        self.model = model
        # experts kept in checkpoint encoding take their codes and scales as they are (no pairing,
        # no dequant)
        self.quant_experts = {name: m for name, m in model.named_modules()
                              if isinstance(m, QuantExperts)}
        # FP8 linears kept in checkpoint encoding: codes and scales copied in as they are
        self.quant_linears = {name: m for name, m in model.named_modules()
                              if isinstance(m, QuantLinear)}
        coded = self.quant_experts.keys() | self.quant_linears.keys()
        self.params = {name: t
                       for name, t in list(model.named_parameters()) + list(model.named_buffers())
                       if name.rsplit(".", 1)[0] not in coded}
        self.pending_weights: dict[str, torch.Tensor] = {}
        self.pending_scales: dict[str, torch.Tensor] = {}
        self.filled: set[tuple[str, int | None]] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        m = _EXPERT.match(name)
        prefix, _, kind = name.rpartition(".")
        if m and m.group(1) in self.quant_experts:
            self._assign_code(name, m.group(1), int(m.group(2)), m.group(3), tensor,
                              m.group(4) == "scale")
        elif prefix in self.quant_linears and kind in ("weight", "scale"):
            self._assign_linear(name, prefix, tensor, kind == "scale")
        elif name.endswith(".scale"):
            base = name[: -len(".scale")] + ".weight"
            if base in self.pending_weights:
                self._assign(base, self._dequant(base, self.pending_weights.pop(base), tensor))
            else:
                self.pending_scales[base] = tensor
        elif tensor.dtype in _FP8_DTYPES or (tensor.dtype in _FP4_DTYPES
                                             and name.endswith(".weight")):
            if name in self.pending_scales:
                self._assign(name, self._dequant(name, tensor, self.pending_scales.pop(name)))
            else:
                self.pending_weights[name] = tensor
        else:
            self._assign(name, tensor)

    def finish(self) -> None:
        """Raise if anything is unpaired or any parameter was never filled."""
        if self.pending_weights:
            raise CheckpointError(f"quantised weights without a `.scale` tensor: "
                                  f"{sorted(self.pending_weights)[:8]}")
        if self.pending_scales:
            raise CheckpointError(f"`.scale` tensors without a quantised weight: "
                                  f"{sorted(self.pending_scales)[:8]}")
        missing = []
        for name, p in self.params.items():
            if name.endswith("inv_freq"):
                continue  # non-persistent, recomputed
            if re.search(r"\.ffn\.experts\.w[123]$", name):
                missing += [f"{internal_to_official(name, p.shape[0])[e][0]}"
                            for e in range(p.shape[0])
                            if (name, e) not in self.filled and (name, None) not in self.filled]
            elif (name, None) not in self.filled:
                missing.append(internal_to_official(name, 0)[0][0])
        for prefix, module in self.quant_experts.items():
            missing += [f"{prefix}.{e}.{w}.{kind}" for e in range(module.w13.shape[0])
                        for w in ("w1", "w2", "w3") for kind in ("weight", "scale")
                        if (f"{prefix}.{w}.{kind}", e) not in self.filled]
        missing += [f"{prefix}.{kind}" for prefix in self.quant_linears
                    for kind in ("weight", "scale")
                    if (f"{prefix}.{kind}", None) not in self.filled]
        if missing:
            raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s), "
                                  f"e.g. {missing[:8]}")

    def _assign_code(self, name: str, prefix: str, expert: int, which: str, tensor: torch.Tensor,
                     scale: bool) -> None:
        """An expert tensor for a `QuantExperts`: codes / scales are copied in.

        A float weight (a transformers-layout checkpoint stores experts dequantised) is encoded,
        which is exact for weights that came from FP4.
        """
        module = self.quant_experts[prefix]
        key = (f"{prefix}.{which}.{'scale' if scale else 'weight'}", expert)
        if key in self.filled:
            raise CheckpointError(f"tensor `{name}` appears twice in the checkpoint")
        if not 0 <= expert < module.w13.shape[0]:
            raise CheckpointError(f"unexpected tensor `{name}`: "
                                  f"expert {expert} >= {module.w13.shape[0]}")
        try:
            if not scale and tensor.is_floating_point() and tensor.element_size() > 1:
                module.quantize_from(which, expert, tensor.to(module.w13.device))
                self.filled.add((f"{prefix}.{which}.scale", expert))
            else:
                module.load(which, expert, tensor.to(module.w13.device), scale)
        except ValueError as err:
            raise CheckpointError(f"tensor `{name}`: {err}") from err
        self.filled.add(key)

    def _assign_linear(self, name: str, prefix: str, tensor: torch.Tensor, scale: bool) -> None:
        """A weight or scale of a `QuantLinear`: codes / scales copied in; a float weight (no
        scale in the file) is encoded, exactly for a weight decoded from FP8."""
        module, key = self.quant_linears[prefix], (name, None)
        if key in self.filled:
            raise CheckpointError(f"tensor `{name}` appears twice in the checkpoint")
        try:
            if not scale and tensor.is_floating_point() and tensor.element_size() > 1:
                module.quantize_from(tensor)
                self.filled.add((f"{prefix}.scale", None))
            else:
                module.load(tensor, scale)
        except ValueError as err:
            raise CheckpointError(f"tensor `{name}`: {err}") from err
        self.filled.add(key)

    def _dequant(self, name: str, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        try:
            return dequantize(weight, scale, self._target_param(name).dtype)
        except ValueError as err:
            raise CheckpointError(f"tensor `{name}`: {err}") from err

    def _target_param(self, name: str) -> torch.Tensor:
        target = official_to_internal(name)
        if target.name not in self.params:
            raise CheckpointError(f"unexpected tensor `{name}`: "
                                  f"the model has no parameter `{target.name}`")
        return self.params[target.name]

    def _assign(self, name: str, tensor: torch.Tensor) -> None:
        target = official_to_internal(name)
        dest = self._target_param(name)
        if target.expert is not None:
            if not 0 <= target.expert < dest.shape[0]:
                raise CheckpointError(f"unexpected tensor `{name}`: "
                                      f"expert {target.expert} >= {dest.shape[0]}")
            dest = dest[target.expert]
        if tuple(tensor.shape) != tuple(dest.shape):
            raise CheckpointError(f"tensor `{name}` has shape {tuple(tensor.shape)} in the "
                                  f"checkpoint but the model expects {tuple(dest.shape)}")
        key = (target.name, target.expert)
        if key in self.filled:
            raise CheckpointError(f"tensor `{name}` appears twice in the checkpoint")
        with torch.no_grad():
            dest.copy_(tensor.to(dest.dtype))
        self.filled.add(key)


def load_weights(model: DeepSeekV4ForCausalLM, path: Path, progress: bool = True) -> None:
    """Fill every parameter and persistent buffer of `model` from the checkpoint at `path`."""
    loader = WeightLoader(model)
    for name, tensor in iter_official_tensors(shard_files(path), progress):
        loader.add(name, tensor)
    loader.finish()
