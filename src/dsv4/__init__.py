"""dsv4: serve and RL-train DeepSeek-V4-family models (PyTorch + Triton).

Public API: `LLM` + `SamplingParams` (offline generation), `EngineConfig`, `load_model(path, dtype,
device)` (the DeepSeek-V4 model itself), `ModelConfig`, and the full-sequence forward modes
`ForwardMode`, `INFERENCE`, `TRAINING`.
"""

import os

# idle OpenMP threads sleep instead of spinning (utils/threads.py); read when torch loads OpenMP
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from dsv4.config.engine import EngineConfig  # noqa: E402
from dsv4.config.model import ModelConfig  # noqa: E402
from dsv4.engine.llm import LLM  # noqa: E402
from dsv4.engine.sampling_params import SamplingParams  # noqa: E402
from dsv4.model.forward_mode import INFERENCE, TRAINING, ForwardMode  # noqa: E402
from dsv4.model.loader import load_model  # noqa: E402

__version__ = "0.1.0"
__all__ = ["INFERENCE", "LLM", "TRAINING", "EngineConfig", "ForwardMode", "ModelConfig",
           "SamplingParams", "load_model", "__version__"]
