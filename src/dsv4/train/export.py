"""Export a training run as a servable checkpoint in the official DeepSeek layout (FP8 linears,
FP4 experts).

`export_run(run_dir, data_dir, out)` loads the run's `state.pt`, writes config.json + safetensors
shards (quantised per `weight_quant`, shards small enough for the device tool's 16 MiB file
limit), copies the tokenizer the data recipe trained, and writes `training.json` (the run's
config, step and wall time). The result loads with `dsv4.model.loader.load_model` like any
released checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from dsv4.checkpoint.writer import write_official
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.model.weights import official_state_dict
from dsv4.train.config import TrainConfig
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def export_run(run_dir: Path, data_dir: Path, out: Path, weight_quant: str = "fp8+fp4",
               shard_bytes: int = 12 << 20) -> Path:
    config = TrainConfig.from_dict(json.loads((run_dir / "train_config.json").read_text()))
    state = torch.load(run_dir / "state.pt", map_location="cpu", weights_only=True)
    model_config = config.model_config()
    with torch.device("meta"):
        model = DeepSeekV4ForCausalLM(model_config)
    model.load_state_dict(state["model"], assign=True)
    write_official(model_config, official_state_dict(model).items(), out, weight_quant, shard_bytes)
    for name in TOKENIZER_FILES:
        src = data_dir / name
        if not src.is_file():
            raise FileNotFoundError(f"{src} missing: "
                                    "export needs the tokenizer of the data recipe in --data")
        shutil.copyfile(src, out / name)
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    tok_config["model_max_length"] = model_config.max_position_embeddings    # the trained context
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2,
                                                          ensure_ascii=False) + "\n")
    summary = {"train_config": config.to_dict(), "step": int(state["step"]),
               "train_time_s": state["elapsed_s"],
               "tokens": int(state["step"]) * config.tokens_per_step, "weight_quant": weight_quant}
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    logger.info("exported %s (step %d) to %s", run_dir, summary["step"], out)
    return out
