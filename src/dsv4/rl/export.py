"""Export an RL run's policy as a servable checkpoint in the official DeepSeek layout.

`export_policy(run_dir, out)` reads the run's `rl_config.json` and `state.pt`, rebuilds the
policy on the meta device with the architecture of the run's source checkpoint (`RLConfig.model`,
its `config.json`), writes config.json + safetensors shards (quantised per `weight_quant`; shards
small enough for the device tool's 16 MiB file limit), copies the source tokenizer and writes
`rl.json` (the run's config, step, wall time, quantisation). The result loads with
`dsv4.model.loader.load_model` and serves with `dsv4 serve --model OUT`.

Invariant: with `weight_quant="none"` the export is lossless for every value the official layout
stores in full precision (fp32 tensors) and for matrices whose fp32 values are bf16-representable
(matrices are stored in bf16, as in the official release).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from dsv4.checkpoint.writer import write_official
from dsv4.config.model import WEIGHT_QUANTS, ModelConfig
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.model.weights import official_state_dict
from dsv4.rl.config import RLConfig
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
SUMMARY_FILE = "rl.json"


def export_policy(run_dir: Path, out: Path, weight_quant: str = "fp8+fp4",
                  shard_bytes: int = 12 << 20) -> Path:
    """Write the policy of `run_dir` as a checkpoint in `out`; returns `out`."""
    if weight_quant not in WEIGHT_QUANTS:
        raise ValueError(f"weight_quant={weight_quant!r} is not supported; "
                         f"allowed: {list(WEIGHT_QUANTS)}")
    run_dir, out = Path(run_dir), Path(out)
    config, state = _read_run(run_dir)
    source = Path(config.model)
    if out.resolve() == source.resolve():
        raise ValueError(f"out={out} is the run's source checkpoint; choose another directory")
    tokenizer = _tokenizer_files(source)
    model = policy_model(ModelConfig.from_hf(source), state["policy"])
    write_official(model.config, official_state_dict(model).items(), out, weight_quant,
                   shard_bytes)
    for src in tokenizer:
        shutil.copyfile(src, out / src.name)
    summary = {"rl_config": config.to_dict(), "step": int(state["step"]),
               "train_time_s": float(state["elapsed_s"]), "weight_quant": weight_quant}
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    logger.info("exported %s (step %d, %s) to %s", run_dir, summary["step"], weight_quant, out)
    return out


def _read_run(run_dir: Path) -> tuple[RLConfig, dict[str, Any]]:
    """The run's RLConfig and state.pt (tensors memory-mapped: the optimizer moments stay on
    disk)."""
    config_path, state_path = run_dir / "rl_config.json", run_dir / "state.pt"
    for path in (config_path, state_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path} missing: export needs an RL run directory "
                                    "(rl_config.json + state.pt, written by `dsv4 rl run`)")
    config = RLConfig.from_dict(json.loads(config_path.read_text()))
    state = torch.load(state_path, map_location="cpu", weights_only=True, mmap=True)
    missing = [k for k in ("policy", "step", "elapsed_s") if k not in state]
    if missing:
        raise ValueError(f"{state_path} lacks {missing}; allowed: a state.pt of `dsv4 rl run`")
    return config, state


def policy_model(model_config: ModelConfig,
                 policy: dict[str, torch.Tensor]) -> DeepSeekV4ForCausalLM:
    """The policy as a model whose tensors are the state dict's own (built on meta, assigned).

    NOTE: `load_model` drops MTP for a transformers-layout source without `mtp.*` tensors, so a
    policy trained from one has no MTP weights; the export then has no MTP layer either.
    """
    if model_config.num_mtp_layers and not any(k.startswith("mtp.") for k in policy):
        model_config = model_config.replace(num_mtp_layers=0)
    with torch.device("meta"):
        model = DeepSeekV4ForCausalLM(model_config)
    model.load_state_dict(policy, assign=True)
    return model


def _tokenizer_files(source: Path) -> list[Path]:
    """The source checkpoint's tokenizer files (checked before anything is written)."""
    files = [source / name for name in TOKENIZER_FILES]
    for src in files:
        if not src.is_file():
            raise FileNotFoundError(f"{src} missing: export copies the tokenizer of the run's "
                                    "source checkpoint (RLConfig.model)")
    return files
