"""EngineConfig validation at the edge: each bad value names its field and the allowed values."""

from __future__ import annotations

import pytest

from dsv4.config.engine import MAX_SPECULATIVE_STEPS, EngineConfig


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"page_size": 0}, "page_size"),
    ({"max_total_tokens": -1}, "max_total_tokens"),
    ({"kv_cache_memory_gb": 0}, "kv_cache_memory_gb"),
    ({"kernel_backend": "cuda"}, "kernel_backend"),
    ({"speculative_num_steps": -1}, "speculative_num_steps"),
    ({"speculative_num_steps": MAX_SPECULATIVE_STEPS + 1}, "speculative_num_steps"),
    ({"speculative_num_steps": True}, "speculative_num_steps"),
    ({"ring_multiplier": 3}, "ring_multiplier"),
    ({"speculative_num_steps": 2, "ring_multiplier": 1}, "ring_multiplier"),
])
def test_bad_values_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}=.* is invalid; allowed: "):
        EngineConfig(**kwargs)  # type: ignore[arg-type]


def test_speculation_doubles_the_compressor_rings_by_default() -> None:
    assert EngineConfig().rings == 1
    assert EngineConfig(ring_multiplier=2).rings == 2
    assert EngineConfig(speculative_num_steps=3).rings == 2
    assert EngineConfig(speculative_num_steps=3, ring_multiplier=2).rings == 2
