"""Write a randomly initialised checkpoint in the official DeepSeek-V4 layout (`dsv4 init`).

Tensors are generated one official tensor at a time (one expert at a time), each from its own
generator seeded by (seed, tensor name), so the result does not depend on iteration order and
never needs more memory than one tensor plus one shard. Storage follows the official release:
bf16 by default; fp32 for mHC, sinks, ape and the gate bias; int64 tid2eid; with `--quant fp8`
the FP8 linears become e4m3 + UE8M0 128x128 scales, and with `fp8+fp4` the routed experts become
packed e2m1 + per-32 UE8M0 scales. Parameters the transformers init leaves at zero/one (tid2eid,
gate bias, sinks, mHC base/scale, ape) get non-trivial values so tests are not degenerate.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from dsv4.assets import GENERATED_MARKER
from dsv4.checkpoint.tokenizer import build_tokenizer
from dsv4.config.engine import WeightFormat
from dsv4.config.model import WEIGHT_QUANTS, ModelConfig
from dsv4.kernels.ref import quant
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.model.quant_experts import QuantExperts
from dsv4.model.quant_linear import QuantLinear, is_fp8_linear
from dsv4.model.random_init import expert_generator, init_tensor, name_generator
from dsv4.model.weights import internal_to_official
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)

_EXPERT = re.compile(r"ffn\.experts\.\d+\.w[123]\.weight$")
_FP32_STORED = re.compile(r"(hc_(attn|ffn|head)_(fn|base|scale)|attn_sink|\.ape|gate\.bias)$")


def official_specs(config: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(official name, shape) of every tensor of the model, experts one by one."""
    with torch.device("meta"):
        model = DeepSeekV4ForCausalLM(config)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("inv_freq"):
            continue
        for official, expert in internal_to_official(name, config.n_routed_experts):
            yield official, tuple(t.shape[1:] if expert is not None else t.shape)


def encode_tensor(name: str, value: torch.Tensor, weight_quant: str) -> dict[str, torch.Tensor]:
    """One official tensor -> the stored tensors (weight, and `.scale` when quantised)."""
    scale_name = name.removesuffix(".weight") + ".scale"
    if weight_quant == "fp8+fp4" and _EXPERT.search(name):
        packed, scale = quant.quant_fp4_group(value)
        return {name: packed.view(torch.int8), scale_name: scale}
    fp8_linear = name.endswith(".weight") and is_fp8_linear(name.removesuffix(".weight"))
    if weight_quant != "none" and (fp8_linear or _EXPERT.search(name)):
        w, scale = quant.quant_fp8_block(value)
        return {name: w, scale_name: scale}
    if value.dtype == torch.int64:
        return {name: value.contiguous()}
    return {name: value.to(torch.float32 if _FP32_STORED.search(name)
                           else torch.bfloat16).contiguous()}


def _flush(out: Path, shard: dict[str, torch.Tensor], index: int) -> str:
    file = f"model-{index:05d}.safetensors"
    save_file(shard, str(out / file), metadata={"format": "pt"})
    return file


def _finish_shards(out: Path, weight_map: dict[str, str], num_shards: int, total: int) -> None:
    renames = {f"model-{i + 1:05d}.safetensors":
               f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)}
    for old, new in renames.items():
        (out / old).rename(out / new)
    index = {"metadata": {"total_size": total},
             "weight_map": {k: renames[v] for k, v in weight_map.items()}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))


def write_checkpoint(config: ModelConfig, out: Path, seed: int = 0, weight_quant: str = "none",
                     shard_bytes: int = 4 << 30, tokenizer: bool = True,
                     weights: bool = True) -> ModelConfig:
    """Write config.json, safetensors shards + index and a tokenizer to `out`; returns the written
    config. `weights=False` writes no tensors: a directory that `dsv4 serve --load-format dummy`
    fills with random weights in memory (a model too large to write)."""
    if weights:
        specs = list(official_specs(config))
        tensors = ((name, init_tensor(name, shape, config, seed)) for name, shape in
                   tqdm(specs, desc=f"init {out.name}", unit="tensor", disable=len(specs) < 2000))
        config = write_official(config, tensors, out, weight_quant, shard_bytes)
    else:
        config = config.replace(weight_quant=weight_quant)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(config.to_official_dict(), indent=2))
    marker = {"seed": seed, "random_weights": True}
    (out / GENERATED_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    if tokenizer:
        build_tokenizer(out, config.vocab_size)
    return config


def write_official(config: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]], out: Path,
                   weight_quant: str = "none", shard_bytes: int = 4 << 30) -> ModelConfig:
    """Write (official name, unquantised value) pairs as a checkpoint in the official layout
    (config.json, shards, index), quantising per `weight_quant`; returns the written config.
    Shards never exceed `shard_bytes` unless one tensor alone does."""
    if weight_quant not in WEIGHT_QUANTS:
        raise ValueError(f"quant={weight_quant!r} is not supported; allowed: {list(WEIGHT_QUANTS)}")
    config = config.replace(weight_quant=weight_quant)
    out.mkdir(parents=True, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    size = total = num_shards = 0
    for name, value in tensors:
        for key, t in encode_tensor(name, value, weight_quant).items():
            nbytes = t.numel() * t.element_size()
            if shard and size + nbytes > shard_bytes:
                num_shards += 1
                weight_map.update(dict.fromkeys(shard, _flush(out, shard, num_shards)))
                shard, size = {}, 0
            shard[key], size, total = t, size + nbytes, total + nbytes
    num_shards += 1
    weight_map.update(dict.fromkeys(shard, _flush(out, shard, num_shards)))
    _finish_shards(out, weight_map, num_shards, total)
    (out / "config.json").write_text(json.dumps(config.to_official_dict(), indent=2))
    logger.info("wrote %s: %d tensors, %.1f MB in %d shard(s)", out, len(weight_map), total / 1e6,
                num_shards)
    return config


def random_model(config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 seed: int = 0, weight_format: WeightFormat = "bf16") -> DeepSeekV4ForCausalLM:
    """A model of `config` filled in memory by `randomize_` (eval mode): benchmark weights without
    a checkpoint. `weight_format` "checkpoint": the routed experts are FP4 codes and scales built
    on the device directly (`QuantExperts.randomize_`), as a checkpoint-precision model holds
    them, and so are the linears the official release stores in FP8 (`QuantLinear.randomize_`),
    so real-scale geometries fit where their float weights would not."""
    from dsv4.model.loader import empty_model  # local: the loader imports nothing from checkpoint/

    return randomize_(empty_model(config, dtype, device, weight_format), seed).eval()


@torch.no_grad()
def randomize_(model: DeepSeekV4ForCausalLM, seed: int = 0) -> DeepSeekV4ForCausalLM:
    """Fill a model in place with the same kind of random values `write_checkpoint` writes
    (unquantised), generated on the model's device: for benchmarks at sizes where writing a
    checkpoint is pointless."""
    config = model.config
    coded: set[int] = set()
    for module_name, module in model.named_modules():
        if isinstance(module, QuantExperts):
            module.randomize_(functools.partial(expert_generator, seed, module_name,
                                                module.w13.device))
            coded.update(id(b) for b in module.buffers())
        elif isinstance(module, QuantLinear):
            module.randomize_(name_generator(seed, module_name, module.weight.device))
            coded.update(id(b) for b in module.buffers())
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("inv_freq") or id(t) in coded:
            continue
        for official, expert in internal_to_official(name, config.n_routed_experts):
            dest = t[expert] if expert is not None else t
            dest.copy_(init_tensor(official, tuple(dest.shape), config, seed, t.device).to(t.dtype))
    return model
