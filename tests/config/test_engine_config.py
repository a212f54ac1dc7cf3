"""EngineConfig validation at the edge: each bad value names its field and the allowed values."""

from __future__ import annotations

import pytest

from dsv4.config.engine import MAX_SPECULATIVE_STEPS, EngineConfig
from dsv4.config.engine_defaults import (
    CPU_KV_CACHE_GB,
    kv_budget_gb,
    resolve_index_cache_dtype,
    resolve_kernel_backend,
)


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
    ({"fuse_projections": "yes"}, "fuse_projections"),
    ({"decode_gemv": 1}, "decode_gemv"),
])
def test_bad_values_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}=.* is invalid; allowed: "):
        EngineConfig(**kwargs)  # type: ignore[arg-type]


def test_speculation_doubles_the_compressor_rings_by_default() -> None:
    assert EngineConfig().rings == 1
    assert EngineConfig(ring_multiplier=2).rings == 2
    assert EngineConfig(speculative_num_steps=3).rings == 2
    assert EngineConfig(speculative_num_steps=3, ring_multiplier=2).rings == 2


def test_kernel_backend_resolution() -> None:
    assert resolve_kernel_backend(None, "cuda") == "triton"
    assert resolve_kernel_backend(None, "cpu") == "ref"
    assert resolve_kernel_backend("ref", "cuda") == "ref"
    assert resolve_kernel_backend("triton", "cpu") == "triton"


def test_index_cache_dtype_resolution() -> None:
    assert resolve_index_cache_dtype(None, "cuda", "triton") == "fp8"
    assert resolve_index_cache_dtype(None, "cuda", "ref") == "model"
    assert resolve_index_cache_dtype(None, "cpu", "triton") == "model"
    assert resolve_index_cache_dtype(None, "cpu", "ref") == "model"
    assert resolve_index_cache_dtype("model", "cuda", "triton") == "model"
    assert resolve_index_cache_dtype("fp8", "cpu", "ref") == "fp8"
    assert EngineConfig().index_cache_dtype is None


def test_kv_budget_resolution() -> None:
    gb = 2**30
    assert kv_budget_gb(EngineConfig(kv_cache_memory_gb=2.5), "cuda", 100 * gb, 10 * gb) == 2.5
    assert kv_budget_gb(EngineConfig(), "cpu", 0, 0) == CPU_KV_CACHE_GB
    assert kv_budget_gb(EngineConfig(), "cuda", 100 * gb, 10 * gb) == pytest.approx(78.0)
    assert kv_budget_gb(EngineConfig(mem_fraction_static=0.5), "cuda", 100 * gb,
                        10 * gb) == pytest.approx(40.0)
    with pytest.raises(ValueError, match="mem_fraction_static=0.1 leaves no KV memory"):
        kv_budget_gb(EngineConfig(mem_fraction_static=0.1), "cuda", 100 * gb, 20 * gb)
    with pytest.raises(ValueError, match="^mem_fraction_static=1.0 is invalid"):
        EngineConfig(mem_fraction_static=1.0)


def test_batch_invariant_triton_needs_invariant_plans() -> None:
    """A batch-invariant engine on the triton kernels must also run their token-count-invariant
    launch plans; the ref ops take no plans."""
    with pytest.raises(ValueError, match="needs invariant_plans=True"):
        EngineConfig(kernel_backend="triton", batch_invariant=True)
    EngineConfig(kernel_backend="triton", batch_invariant=True, invariant_plans=True)
    EngineConfig(kernel_backend="ref", batch_invariant=True)
