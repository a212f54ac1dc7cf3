"""KV budget split of `cache/layout.py::plan_cache`: SWA pages for the prefix cache's anchors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4.cache.layout import full_bytes_per_token, plan_cache, swa_bytes_per_page
from dsv4.checkpoint.presets import get_preset
from dsv4.config.engine import EngineConfig
from dsv4.config.engine_defaults import resolve_swa_fraction

FLASH = get_preset("flash-4l")
BASE = EngineConfig(page_size=256, max_running_requests=32, chunked_prefill_size=2048,
                    kv_cache_memory_gb=60.0, context_length=1 << 20, swa_memory_fraction=0.25)


def used_gb(config: EngineConfig) -> float:
    layout = plan_cache(FLASH, config, torch.bfloat16)
    P = config.page_size
    full = (layout.num_full_pages - 1) * full_bytes_per_token(FLASH, torch.bfloat16) * P
    swa = layout.num_swa_pages * swa_bytes_per_page(FLASH, torch.bfloat16, P)
    return (full + swa) / (1 << 30)


def test_without_the_prefix_cache_swa_pages_cover_the_running_requests_only() -> None:
    layout = plan_cache(FLASH, dataclasses.replace(BASE, disable_prefix_cache=True),
                        torch.bfloat16)
    # 32 requests x (ceil(128 / 256) + 2) + 2048 / 256 + 1: the running need, nothing more
    assert layout.num_swa_pages == 32 * 3 + 8 + 1


def test_the_prefix_cache_gets_a_share_and_the_budget_the_full_pool_cannot_use() -> None:
    with_cache = plan_cache(FLASH, BASE, torch.bfloat16)
    without = plan_cache(FLASH, dataclasses.replace(BASE, disable_prefix_cache=True),
                         torch.bfloat16)
    swa_gb = with_cache.num_swa_pages * swa_bytes_per_page(FLASH, torch.bfloat16, 256) / (1 << 30)
    assert swa_gb >= 0.25 * 60.0 - 0.01
    # 32 requests of 1M tokens cap the full pool below the budget: the rest went to SWA pages
    assert with_cache.num_full_pages == without.num_full_pages == 32 * 4096 + 1
    assert 59.9 < used_gb(BASE) <= 60.0


def test_a_small_budget_keeps_the_share_and_fills_full_pages() -> None:
    small = dataclasses.replace(BASE, kv_cache_memory_gb=4.0)
    layout = plan_cache(FLASH, small, torch.bfloat16)
    swa_gb = layout.num_swa_pages * swa_bytes_per_page(FLASH, torch.bfloat16, 256) / (1 << 30)
    assert 0.99 <= swa_gb < 1.01 and used_gb(small) <= 4.0
    assert layout.num_full_pages > 1000


def test_a_zero_fraction_plans_the_running_need_only() -> None:
    """The CPU default (`resolve_swa_fraction`): no share, no leftover."""
    layout = plan_cache(FLASH, dataclasses.replace(BASE, swa_memory_fraction=0.0),
                        torch.bfloat16)
    assert layout.num_swa_pages == 32 * 3 + 8 + 1
    assert resolve_swa_fraction(None, "cuda") == 0.25 and resolve_swa_fraction(None, "cpu") == 0
    assert resolve_swa_fraction(0.5, "cpu") == 0.5


def test_explicit_swa_tokens_win_and_a_bad_fraction_is_refused() -> None:
    layout = plan_cache(FLASH, dataclasses.replace(BASE, swa_tokens=1024), torch.bfloat16)
    assert layout.num_swa_pages == 4 + 1
    with pytest.raises(ValueError, match="swa_memory_fraction"):
        dataclasses.replace(BASE, swa_memory_fraction=1.0)
