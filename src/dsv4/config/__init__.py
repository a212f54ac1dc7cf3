"""Frozen configurations built at the edge and passed down."""

from dsv4.config.model import ModelConfig, YarnConfig

__all__ = ["ModelConfig", "YarnConfig"]
