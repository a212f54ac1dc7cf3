"""dsv4: serve and RL-train DeepSeek-V4-family models (PyTorch + Triton).

Public API: `LLM` + `SamplingParams` (offline generation), `EngineConfig`, `load_model(path, dtype,
device)` (the DeepSeek-V4 model itself), `ModelConfig`, and the full-sequence forward modes
`ForwardMode`, `INFERENCE`, `TRAINING`.
"""

from dsv4.config.engine import EngineConfig
from dsv4.config.model import ModelConfig
from dsv4.engine.llm import LLM
from dsv4.engine.sampling_params import SamplingParams
from dsv4.model.forward_mode import INFERENCE, TRAINING, ForwardMode
from dsv4.model.loader import load_model

__version__ = "0.1.0"
__all__ = ["INFERENCE", "LLM", "TRAINING", "EngineConfig", "ForwardMode", "ModelConfig",
           "SamplingParams", "load_model", "__version__"]
