"""`checkpoint/presets.py::first_layers`: a preset cut to the prefix of its layer schedule, whose
layers are the full model's own (the per-layer cost of a geometry too large for one device is
measured on such a prefix)."""

from __future__ import annotations

import pytest
import torch

from dsv4.checkpoint.presets import first_layers, flash, get_preset
from dsv4.model.loader import empty_model


def _bytes(model: torch.nn.Module, prefix: str) -> int:
    return sum(t.numel() * t.element_size()
               for n, t in [*model.named_parameters(), *model.named_buffers()]
               if n.startswith(prefix))


def test_first_layers_is_the_schedule_prefix() -> None:
    full = flash()
    cut = first_layers(full, 5)
    assert cut.num_layers == 5
    assert cut.attn_types == ("swa", "swa", "csa", "hca", "csa")
    assert cut.moe_types == ("hash", "hash", "hash", "routed", "routed")
    assert cut.n_routed_experts == full.n_routed_experts == 256
    assert cut.num_mtp_layers == full.num_mtp_layers
    assert first_layers(full, full.num_layers) == full


def test_first_layers_keep_the_full_models_layer_bytes() -> None:
    """Each kept layer holds the bytes of the same layer in the full model (checkpoint precision,
    on the meta device): FP4 experts, FP8 linears and all."""
    config = get_preset("flash")
    meta = torch.device("meta")
    full = empty_model(config, torch.bfloat16, meta, "checkpoint")
    cut = empty_model(first_layers(config, 4), torch.bfloat16, meta, "checkpoint")
    for i in range(4):
        want = _bytes(full, f"layers.{i}.")
        assert want > 3e9       # 256 FP4 experts (hash or routed) and the attention
        assert _bytes(cut, f"layers.{i}.") == want
    assert _bytes(cut, "layers.4.") == 0


@pytest.mark.parametrize("n", [0, 44])
def test_first_layers_refuses_a_count_out_of_range(n: int) -> None:
    with pytest.raises(ValueError, match=rf"num_layers={n} is invalid; allowed: 1\.\.43"):
        first_layers(flash(), n)
