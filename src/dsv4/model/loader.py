"""`load_model`: config + weights -> a ready `DeepSeekV4ForCausalLM` in eval mode.

The model is built on the meta device (no random init, no double memory), materialised on the
target device with the dtype policy of `DeepSeekV4ForCausalLM.cast_`, then filled from the shards.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dsv4.config.engine import WeightFormat, check_weight_format
from dsv4.config.model import ModelConfig
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.model.moe import Experts
from dsv4.model.quant_experts import QuantExperts
from dsv4.model.quant_linear import quantize_linears_
from dsv4.model.state_dict_adapter import is_hf_name
from dsv4.model.weights import checkpoint_keys, fp8_linear_names, load_weights, shard_files
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
DEVICES = ("cpu", "cuda")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; allowed: {sorted(DTYPES)}")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device) -> torch.device:
    kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    if kind not in DEVICES:
        raise ValueError(f"device={device!r} is not supported; allowed: {list(DEVICES)}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but no CUDA GPU is available")
    return dev


def empty_model(config: ModelConfig, dtype: torch.dtype, device: torch.device,
                weight_format: WeightFormat = "bf16",
                fp8_linears: set[str] | None = None) -> DeepSeekV4ForCausalLM:
    """Uninitialised model with the right dtypes on `device` (contents are garbage until loaded).

    weight_format "checkpoint": routed experts are `QuantExperts` (FP4 codes + scales, as official
    V4 stores them), the linears the checkpoint stores in FP8 are `QuantLinear`s
    (`model/quant_linear.py`): those named in `fp8_linears` (module names; the loaders pass the
    checkpoint's), by default the official release's FP8 set (`quant_linear.FP8_LINEAR`, what
    the writer quantises; random weights of `load_format="dummy"`), and the compressor
    projections stay bf16 as stored (`DeepSeekV4ForCausalLM.cast_`).
    """
    check_weight_format(weight_format)
    with torch.device("meta"):
        model = DeepSeekV4ForCausalLM(config)
        if weight_format == "checkpoint":
            for module in model.modules():
                if isinstance(getattr(module, "experts", None), Experts):
                    module.experts = QuantExperts.from_config(config, "fp4")
            quantize_linears_(model, fp8_linears)
    model.cast_(dtype, checkpoint_precision=weight_format == "checkpoint")
    model.to_empty(device=device)
    model.reset_buffers()
    return model


def _mtp_checked(config: ModelConfig, keys: list[str]) -> ModelConfig:
    """`config` without MTP when a transformers-layout checkpoint has no `mtp.*` tensor.

    transformers drops the MTP layer when it saves, so such a checkpoint is loaded without MTP
    (logged). The official layout must carry its MTP weights.
    """
    if (config.num_mtp_layers and any(is_hf_name(k) for k in keys)
            and not any(k.startswith("mtp.") for k in keys)):
        logger.warning("transformers-layout checkpoint has no mtp.* tensors: "
                       "loading without the MTP layer")
        return config.replace(num_mtp_layers=0)
    return config


def checkpoint_config(path: Path) -> ModelConfig:
    """The config a checkpoint loads as: its config.json, less MTP where the tensors lack it."""
    return _mtp_checked(ModelConfig.from_hf(path), checkpoint_keys(shard_files(path)))


def load_model(path: str | Path, dtype: str | torch.dtype = "bfloat16",
               device: str | torch.device = "cpu", progress: bool = True,
               weight_format: WeightFormat = "bf16") -> DeepSeekV4ForCausalLM:
    """Load a DeepSeek-V4 checkpoint (official or transformers layout) for inference or training.

    `weight_format`: "bf16" dequantises the FP4 / FP8 weights to `dtype`; "checkpoint" keeps the
    routed experts in their FP4 encoding and the linears the checkpoint stores in FP8 in theirs
    (serving only; see `model/quant_experts.py`, `model/quant_linear.py`).
    """
    check_weight_format(weight_format)
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint path does not exist: {path}")
    torch_dtype, dev = resolve_dtype(dtype), resolve_device(device)
    config = checkpoint_config(path)
    fp8_linears = fp8_linear_names(checkpoint_keys(shard_files(path)))
    model = empty_model(config, torch_dtype, dev, weight_format, fp8_linears)
    load_weights(model, path, progress)
    logger.info("loaded %s (%d layers, dtype=%s, device=%s, weights=%s)", path, config.num_layers,
                torch_dtype, dev, weight_format)
    return model.eval()
