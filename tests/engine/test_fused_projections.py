"""Fused projections (`model/fused_projections.py`, `EngineConfig.fuse_projections`) in the engine.

fp32 on the CPU (ref backend): the fused engine's greedy tokens and every sampled row's logits are
bit-equal to those of one GEMM per projection (the CPU GEMM reduces each output alike whatever
the width), through chunked prefill (T > 1: the consumers read row-strided column slices),
requests joining mid-decode and decode batches, on the micro and tiny presets. The fused
parameters are views of the stacked weights (the state dict, its values and the bytes held
unchanged; fusing again is a no-op; a replaced parameter is re-fused). A weight update through
`update_weights` after fusion changes the outputs exactly as it does without fusion. The invariant
modes and `fuse_projections=False` run unfused (and undo an earlier fusion); the CLI flag reaches
the config. The triton backend's fused engine: tests/kernels/test_fused_projections_triton.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from dsv4.checkpoint.presets import micro, tiny
from dsv4.checkpoint.writer import random_model
from dsv4.config.engine import EngineConfig
from dsv4.config.model import ModelConfig
from dsv4.engine.engine import LLMEngine
from dsv4.engine.request import Request
from dsv4.engine.runner import ModelRunner
from dsv4.engine.sampler import SampleOutput
from dsv4.engine.sampling_params import SamplingParams
from dsv4.kernels.registry import create_kernels
from dsv4.model.attention import Attention
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.model.fused_projections import fuse_projections, is_fused
from dsv4.model.layers.fused import FusedRows
from dsv4.model.moe import MLP

CPU = torch.device("cpu")
Rows = dict[str, list[torch.Tensor]]


class Recorder:
    """Wraps ModelRunner._sample to keep every sampled row's logits, per runner and request."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rows: dict[int, Rows] = {}
        original = ModelRunner._sample

        def wrapped(runner: ModelRunner, logits: torch.Tensor, reqs: list[Request],
                    steps: list[int], **kw: Any) -> SampleOutput:
            mine = self.rows.setdefault(id(runner), {})
            for req, row in zip(reqs, logits, strict=True):
                mine.setdefault(req.rid, []).append(row.clone())
            return original(runner, logits, reqs, steps, **kw)

        monkeypatch.setattr(ModelRunner, "_sample", wrapped)


def engine_for(model: DeepSeekV4ForCausalLM, **config: Any) -> LLMEngine:
    page = 16 if model.config.window < 64 else 128
    return LLMEngine(model, EngineConfig(page_size=page, max_total_tokens=4096,
                                         chunked_prefill_size=48, seed=0, **config))


def serve(engine: LLMEngine, prompts: list[list[int]], max_tokens: int = 5) -> dict[str, list[int]]:
    """Greedy outputs by request id; the second half of the prompts joins after two steps (steps
    that mix prefill chunks and decode rows)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    half = len(prompts) // 2
    reqs = [engine.add_request(p, params, rid=str(i)) for i, p in enumerate(prompts[:half])]
    for _ in range(2):
        engine.step()
    reqs += [engine.add_request(p, params, rid=str(half + i))
             for i, p in enumerate(prompts[half:])]
    while engine.has_unfinished():
        engine.step()
    return {r.rid: list(engine.pop(r.rid).output_ids) for r in reqs}


def prompts_of(cfg: ModelConfig, lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lengths]


def assert_same_rows(a: Rows, b: Rows) -> None:
    assert a.keys() == b.keys()
    for rid in a:
        assert torch.equal(torch.stack(a[rid]), torch.stack(b[rid])), f"request {rid}: logits"


@pytest.mark.parametrize(("preset", "lengths", "fmt"), [
    (micro, (1, 9, 37, 70), "bf16"),
    (tiny, (5, 140, 530), "bf16"),
    # the FP8 groups' stacking, not the attention's lengths: two C128 entries suffice
    (tiny, (5, 140, 270), "checkpoint"),
], ids=["micro", "tiny", "tiny-fp8"])
def test_fused_equals_unfused(monkeypatch: pytest.MonkeyPatch,
                              preset: Callable[[], ModelConfig], lengths: tuple[int, ...],
                              fmt: str) -> None:
    """fmt "checkpoint": FP8 linears in checkpoint encoding, fused among themselves (wq_a | wkv,
    shared w1 | w3: codes and block scales stacked)."""
    cfg = preset()
    rec, prompts = Recorder(monkeypatch), prompts_of(cfg, lengths)
    outs, rows = [], []
    for fuse in (True, False):
        engine = engine_for(random_model(cfg, torch.float32, CPU, 3, fmt),
                            fuse_projections=fuse)
        assert (engine.runner.fused_groups > 0) == fuse == is_fused(engine.runner.model)
        fp8 = [m.fused_w13 for m in engine.runner.model.modules()
               if isinstance(m, MLP) and m.fused_w13 is not None and m.fused_w13.scale is not None]
        assert bool(fp8) == (fuse and fmt == "checkpoint")
        outs.append(serve(engine, prompts))
        rows.append(rec.rows[id(engine.runner)])
    assert outs[0] == outs[1]
    assert_same_rows(rows[0], rows[1])


def _groups(model: nn.Module) -> list[tuple[FusedRows, list[torch.Tensor]]]:
    """Every fused group of `model` with its members' weights, in the order they were stacked."""
    out = []
    for m in model.modules():
        if isinstance(m, Attention):
            index = m.indexer
            members = [(m.fused_x, [m.wq_a, m.wkv] + ([index.weights_proj] if index else [])),
                       (m.fused_q, [m.wq_b] + ([index.wq_b] if index else [])),
                       (m.fused_compress, [lin for c in m.compressors() for lin in (c.wkv, c.wgate)]
                        if m.compressor is not None else [])]
        elif isinstance(m, MLP):
            members = [(m.fused_w13, [m.w1, m.w3])]
        else:
            continue
        out += [(f, [lin.weight for lin in lins]) for f, lins in members if f is not None]
    return out


def storage_bytes(model: nn.Module) -> int:
    """Bytes of the distinct storages behind the model's parameters and buffers."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*model.parameters(), *model.buffers())}
    return sum(storages.values())


def test_fused_parameters_share_storage() -> None:
    model = random_model(micro(), torch.float32, CPU, seed=1)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    held = storage_bytes(model)
    # micro: 6 attention layers (SWA: x; CSA: x, q, compress; HCA: x, compress) and 6 MLPs
    assert fuse_projections(model) == 18
    assert storage_bytes(model) == held, "fusion must not hold a second copy of the weights"
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[n], before[n]) for n in before)
    groups = _groups(model)
    assert len(groups) == 18
    for fused, weights in groups:
        assert fused.holds(weights)
        assert sum(w.numel() for w in weights) == fused.weight.numel()
    # a write into a parameter is a write into its stacked weight
    attn = model.layers[1].attn
    assert isinstance(attn, Attention) and attn.fused_x is not None
    with torch.no_grad():
        attn.wkv.weight.fill_(0.5)
    q_lora = attn.wq_a.weight.shape[0]
    assert bool((attn.fused_x.weight[q_lora:q_lora + attn.wkv.weight.shape[0]] == 0.5).all())
    # fusing again keeps every group; a parameter replaced (not written in place) is re-fused
    kept = [id(f) for f, _ in groups]
    assert fuse_projections(model) == 18 and [id(f) for f, _ in _groups(model)] == kept
    attn.wq_a.weight = nn.Parameter(attn.wq_a.weight.detach() * 2)
    old = attn.fused_x
    assert not old.holds([attn.wq_a.weight, attn.wkv.weight, attn.indexer.weights_proj.weight])
    fuse_projections(model)
    assert attn.fused_x is not old and attn.fused_x is not None
    assert torch.equal(attn.fused_x.weight[:q_lora], attn.wq_a.weight)


def perturbed(model: DeepSeekV4ForCausalLM, seed: int = 0) -> dict[str, torch.Tensor]:
    """Noise on every float tensor of the model's state dict."""
    g = torch.Generator().manual_seed(seed)
    return {n: t.float() + 0.05 * torch.randn(t.shape, generator=g)
            for n, t in model.state_dict().items() if t.is_floating_point()}


def test_weight_update_after_fusion(monkeypatch: pytest.MonkeyPatch) -> None:
    """`update_weights` writes into the fused parameters in place: the fused GEMMs see the new
    weights, and the fused engine's outputs after the update equal the unfused engine's."""
    cfg = micro()
    rec, prompts = Recorder(monkeypatch), prompts_of(cfg, (3, 41), seed=5)
    engines = [engine_for(random_model(cfg, torch.float32, CPU, seed=2), fuse_projections=fuse)
               for fuse in (True, False)]
    new = perturbed(engines[0].runner.model)
    before = [serve(e, prompts) for e in engines]
    fused_rows = [f for f, _ in _groups(engines[0].runner.model)]
    addresses = [f.weight.data_ptr() for f in fused_rows]
    for e in engines:
        assert e.update_weights(new) == len(new)
    for fused, weights in _groups(engines[0].runner.model):
        assert fused.holds(weights)
    assert [f.weight.data_ptr() for f, _ in _groups(engines[0].runner.model)] == addresses
    wkv = engines[0].runner.model.layers[2].attn.compressor.wkv.weight
    assert torch.equal(wkv, new["layers.2.attn.compressor.wkv.weight"])
    rec.rows.clear()
    after = [serve(e, prompts) for e in engines]
    assert after[0] == after[1] and after[0] != before[0]
    assert_same_rows(*(rec.rows[id(e.runner)] for e in engines))


@pytest.mark.parametrize("config", [dict(fuse_projections=False), dict(batch_invariant=True),
                                    dict(invariant_plans=True)],
                         ids=["off", "batch_invariant", "invariant_plans"])
def test_unfused_modes(config: dict[str, Any]) -> None:
    """Unfused engines leave the model unfused, and undo an earlier engine's fusion."""
    model = random_model(micro(), torch.float32, CPU, seed=1)
    assert engine_for(model).runner.fused_groups == 18 and is_fused(model)
    engine = engine_for(model, kernel_backend="ref", **config)
    assert engine.runner.fused_groups == 0 and not is_fused(model)


def test_serve_flag_reaches_the_engine_config() -> None:
    from dsv4.cli.main import build_parser
    from dsv4.cli.serve import build_config

    args = build_parser().parse_args(["serve", "--device", "cpu", "--disable-fused-projections"])
    assert build_config(args).engine_config.fuse_projections is False
    default = build_config(build_parser().parse_args(["serve", "--device", "cpu"]))
    assert default.engine_config.fuse_projections is True


@pytest.mark.parametrize("fmt", ["bf16", "checkpoint"])
def test_index_weights_run_once(fmt: str) -> None:
    """The indexer's weights_proj runs once per CSA layer: as a column slice of the fused x GEMM
    where it rides it (float weights), else as a GEMM of its own in the indexer's branch
    (`Attention._index_weights_alone`: on the side stream with multi-stream), since an FP8
    checkpoint's wq_a | wkv never carries it. Either way its values are weights_proj(x)."""
    cfg = micro()
    model = random_model(cfg, torch.float32, CPU, 3, fmt)
    fuse_projections(model)
    ops = create_kernels("ref")
    x = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    layers = [m for m in model.modules() if isinstance(m, Attention) and m.indexer is not None]
    assert layers
    for attn in layers:
        assert attn.indexer is not None
        alone = attn._index_weights_alone(x, ops)
        fused = attn._x_projections(x, ops)[2]
        assert (alone is None) is (fmt == "bf16") and (fused is None) is (fmt == "checkpoint")
        got = alone if alone is not None else fused
        assert got is not None and torch.equal(got, attn.indexer.weights_proj(x))
