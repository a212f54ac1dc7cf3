"""dsv4: serve and RL-train DeepSeek-V4-family models (PyTorch + Triton).

Public API: `load_model(path, dtype, device)` returns the DeepSeek-V4 model; `ModelConfig`.
"""

from dsv4.config.model import ModelConfig
from dsv4.model.loader import load_model

__version__ = "0.1.0"
__all__ = ["ModelConfig", "load_model", "__version__"]
