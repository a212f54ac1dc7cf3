"""Parity with transformers 5.23 `DeepseekV4ForCausalLM` (the test-only oracle), fp32 on CPU.

Three randomised tiny configs, together covering SWA / CSA / HCA layers, hash and routed MoE, YaRN
and plain RoPE, index_topk smaller than the number of C4 entries, sequence lengths that are not
multiples of 4, the HCA ratio or the window, and batch 2. Each is written by `dsv4 init`'s writer
in the official layout (with FP8 / FP4 quantisation in two of them), loaded by dsv4, converted
to transformers' names and loaded into transformers, then written by transformers'
`save_pretrained` and loaded by dsv4 again. Logits must agree to 1e-4.

Indexer ties (model-spec §13): when the k-th and (k+1)-th visible index scores of a query are
equal within 1e-5 relative, two correct implementations may select different entries, so logits
are compared only before the first such query of each row (and the test requires that most
positions are still compared).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dsv4 import load_model
from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import write_checkpoint
from dsv4.cli.main import main as cli_main
from dsv4.config.model import ModelConfig, YarnConfig
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.model.indexer import Indexer
from dsv4.model.state_dict_adapter import to_hf_state_dict
from dsv4.model.weights import official_state_dict

transformers = pytest.importorskip("transformers")

TOL = 1e-4


def config_b() -> ModelConfig:
    """V4-Pro-like: HCA first, wider heads, 3 hc streams, short Sinkhorn, odd top-k."""
    return micro().replace(
        num_layers=4, attn_types=("hca", "hca", "csa", "hca"),
        moe_types=("hash", "hash", "hash", "routed"), hidden_size=48, num_heads=4, head_dim=64,
        rope_head_dim=16, q_lora_rank=24, o_groups=4, o_lora_rank=8, window=16, hca_ratio=8,
        index_n_heads=12, index_head_dim=32, index_topk=3, hc_mult=3, hc_sinkhorn_iters=7,
        n_routed_experts=6, num_experts_per_tok=3, moe_inter_dim=16,
        routed_scaling_factor=2.5, yarn=YarnConfig(factor=8.0, original_max_position_embeddings=32),
        num_mtp_layers=1)


def config_c() -> ModelConfig:
    """V4-Flash-like: two SWA layers, odd window, large HCA ratio, no YaRN, no MTP."""
    return micro().replace(
        num_layers=5, attn_types=("swa", "swa", "csa", "hca", "csa"),
        moe_types=("hash", "hash", "hash", "routed", "routed"), window=5, hca_ratio=32,
        index_topk=6, hc_mult=2, n_routed_experts=5, num_experts_per_tok=2, yarn=None,
        num_mtp_layers=0, vocab_size=400)


CASES = {
    # name: (config factory, weight quantisation, sequence lengths)
    "tiny-fp8fp4": (micro, "fp8+fp4", (37, 61)),
    "pro-like-fp8": (config_b, "fp8", (45, 70)),
    "flash-like-bf16": (config_c, "none", (75, 99)),
}


def hf_model_from(model: DeepSeekV4ForCausalLM) -> torch.nn.Module:
    hf_cfg = transformers.DeepseekV4Config(**model.config.to_hf_dict())
    hf = transformers.DeepseekV4ForCausalLM(hf_cfg).eval()
    weights = {k: v.clone() for k, v in official_state_dict(model).items()}
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(weights), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return hf


def ambiguous_from(model: DeepSeekV4ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """[B] first query position whose indexer top-k boundary is tied (S if none)."""
    first = torch.full((ids.shape[0],), ids.shape[1])
    captured: list[torch.Tensor] = []

    def hook(module: Indexer, args: tuple[torch.Tensor, ...], _out: torch.Tensor) -> None:
        captured.append((module.scores(*args), module.topk))  # type: ignore[arg-type]

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, Indexer)]
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    for scores, k in captured:
        top = torch.sort(scores, dim=-1, descending=True).values
        if top.shape[-1] <= k:
            continue
        kth, nxt = top[..., k - 1], top[..., k]
        tied = torch.isfinite(nxt) & ((kth - nxt).abs() <= 1e-5 * kth.abs().clamp(min=1e-30))
        for b in range(ids.shape[0]):
            pos = tied[b].nonzero()
            if len(pos):
                first[b] = min(first[b], int(pos[0]))
    return first


def assert_parity(ours: torch.Tensor, theirs: torch.Tensor, first_tie: torch.Tensor) -> float:
    seq = ours.shape[1]
    worst = 0.0
    for b in range(ours.shape[0]):
        n = int(first_tie[b])
        assert n >= seq * 0.6, (f"row {b}: indexer tie at position {n} of {seq}; "
                                "too little left to compare")
        worst = max(worst, (ours[b, :n] - theirs[b, :n]).abs().max().item())
    assert worst <= TOL, f"max |logit difference| {worst:.3e} > {TOL}"
    return worst


def write_official(name: str, tmp: Path) -> Path:
    factory, quant, _ = CASES[name]
    out = tmp / f"{name}-official"
    if factory is micro:  # exercise the real command line for the preset
        assert cli_main(["init", "--preset", "micro", "--out", str(out), "--seed", "7",
                         "--quant", quant]) == 0
    else:
        write_checkpoint(factory(), out, seed=11, weight_quant=quant, tokenizer=False)
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_parity_both_layouts(name: str, tmp_path: Path) -> None:
    official_dir = write_official(name, tmp_path)
    ours = load_model(official_dir, dtype="float32", progress=False)
    expected_cfg = CASES[name][0]().replace(weight_quant=CASES[name][1])
    assert ours.config == expected_cfg
    hf = hf_model_from(ours)

    hf_dir = tmp_path / f"{name}-transformers"
    hf.save_pretrained(hf_dir)
    assert "layer_types" in json.loads((hf_dir / "config.json").read_text())
    from_hf = load_model(hf_dir, dtype="float32", progress=False)
    assert from_hf.config == expected_cfg.replace(num_mtp_layers=0, weight_quant="none")

    for seq in CASES[name][2]:
        ids = torch.randint(0, ours.config.vocab_size, (2, seq),
                            generator=torch.Generator().manual_seed(seq))
        with torch.no_grad():
            ref = hf(ids).logits
            a = ours(ids)
            b = from_hf(ids)
        assert torch.equal(a, b), "official-layout and transformers-layout loads disagree"
        assert_parity(a, ref, ambiguous_from(ours, ids))


def test_topk_is_smaller_than_entry_count() -> None:
    """The configs really exercise selection: more visible C4 entries than index_topk."""
    for factory, _, lengths in CASES.values():
        cfg = factory()
        assert "csa" in cfg.attn_types
        assert max(lengths) // cfg.csa_ratio > cfg.index_topk
        assert (max(lengths) % cfg.csa_ratio and max(lengths) % cfg.hca_ratio
                and max(lengths) % cfg.window)
    kinds = {t for f, _, _ in CASES.values() for t in f().attn_types}
    assert kinds == {"swa", "csa", "hca"}
    assert {t for f, _, _ in CASES.values() for t in f().moe_types} == {"hash", "routed"}
    assert any(f().yarn is not None for f, _, _ in CASES.values())


def test_parity_short_sequences(tmp_path: Path) -> None:
    """Sequences shorter than the window and the compress ratios (no compressed entry yet)."""
    write_checkpoint(micro(), tmp_path, seed=3, tokenizer=False)
    ours = load_model(tmp_path, dtype="float32", progress=False)
    hf = hf_model_from(ours)
    for seq in (1, 2, 3, 4, 5, 15, 16, 17):
        ids = torch.randint(0, ours.config.vocab_size, (2, seq),
                            generator=torch.Generator().manual_seed(seq))
        with torch.no_grad():
            assert_parity(ours(ids), hf(ids).logits, ambiguous_from(ours, ids))
