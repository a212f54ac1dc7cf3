"""Weight updates into a live engine: in place (addresses kept), atomic (a bad update changes
nothing), equal to a fresh engine on the new weights (prefix cache and running requests included),
re-quantised for checkpoint-format experts, and read from checkpoint directories."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import write_checkpoint, write_official
from dsv4.config.engine import EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.engine.request import Request
from dsv4.engine.sampling_params import SamplingParams
from dsv4.engine.weight_sync import check_finite, read_checkpoint_dir, update_weights
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.model.loader import load_model
from dsv4.model.quant_experts import QuantExperts, quantize_experts_
from dsv4.model.quant_linear import QuantLinear, quantize_linears_
from dsv4.model.weights import official_state_dict

TOL = 1e-6
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=20)
PROMPT = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(7)).tolist()
Named = dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("weight_sync")
    out = {"plain": root / "plain", "quant": root / "quant"}
    write_checkpoint(micro(), out["plain"], seed=3, tokenizer=False)
    write_checkpoint(micro(), out["quant"], seed=3, weight_quant="fp8+fp4", tokenizer=False)
    return out


def perturbed(model: DeepSeekV4ForCausalLM, seed: int = 0) -> Named:
    """The model's state dict with noise on every float tensor and the hash routes rotated."""
    g = torch.Generator().manual_seed(seed)
    out: Named = {}
    for name, t in model.state_dict().items():
        if t.is_floating_point():
            out[name] = t.float() + 0.05 * torch.randn(t.shape, generator=g)
        else:
            out[name] = (t + 1) % model.config.n_routed_experts   # tid2eid
    return out


def engine_on(model: DeepSeekV4ForCausalLM) -> LLMEngine:
    return LLMEngine(model, EngineConfig(page_size=16, max_total_tokens=1024, seed=0))


def run(engine: LLMEngine, prompt: list[int], params: SamplingParams = GREEDY) -> Request:
    req = engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    return engine.pop(req.rid)


def assert_same_output(got: Request, want: Request) -> None:
    assert got.output_ids == want.output_ids
    assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True)) <= TOL
    for a, b in zip(got.top_logprobs, want.top_logprobs, strict=True):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) <= TOL for t in a)


def test_update_equals_fresh_engine_and_keeps_addresses(ckpts: dict[str, Path]) -> None:
    engine = engine_on(load_model(ckpts["plain"], dtype="float32"))
    model = engine.runner.model
    new = perturbed(model)
    fresh_model = load_model(ckpts["plain"], dtype="float32")
    fresh_model.load_state_dict(new)
    want = run(engine_on(fresh_model), PROMPT)
    before = run(engine, PROMPT)      # leaves the prompt's pages in the prefix cache
    assert engine.runner.table.shared, "the prefix cache should hold the prompt"
    ptrs = {name: t.data_ptr() for name, t in model.state_dict().items()}
    assert engine.update_weights(new) == len(new) and engine.weight_version == 1
    assert {name: t.data_ptr() for name, t in model.state_dict().items()} == ptrs
    assert not engine.runner.table.shared, "the prefix cache must be flushed"
    after = run(engine, PROMPT)
    assert after.cached_tokens == 0 and before.output_ids != after.output_ids
    assert_same_output(after, want)
    engine.check_integrity()


def test_running_request_is_recomputed_with_the_new_weights(ckpts: dict[str, Path]) -> None:
    engine = engine_on(load_model(ckpts["plain"], dtype="float32"))
    new = perturbed(engine.runner.model, seed=1)
    req = engine.add_request(PROMPT, GREEDY)
    while len(req.output_ids) < 4:
        engine.step()
    done = len(req.output_ids)
    engine.update_weights(new)
    assert req in engine.scheduler.waiting and req.num_cached == 0
    while engine.has_unfinished():
        engine.step()
    fresh_model = load_model(ckpts["plain"], dtype="float32")
    fresh_model.load_state_dict(new)
    rest = SamplingParams(max_tokens=GREEDY.max_tokens - done, temperature=0.0, ignore_eos=True,
                          logprobs=20)
    want = run(engine_on(fresh_model), PROMPT + req.output_ids[:done], rest)
    assert req.output_ids[done:] == want.output_ids
    assert max(abs(a - b) for a, b in zip(req.logprobs[done:], want.logprobs, strict=True)) <= TOL
    engine.pop(req.rid)
    engine.check_integrity()
    engine.flush_cache()
    assert engine.runner.table.full.num_free == engine.runner.table.full.num_usable


@pytest.mark.parametrize(("change", "match"), [
    (lambda n: n.update({"head.weight": n["head.weight"][:-1]}),
     r"'head.weight' has shape \[511, 64\]; allowed: the model's shape \[512, 64\]"),
    (lambda n: n.update({"nope.weight": n["head.weight"]}), r"'nope.weight' is not a parameter"),
    (lambda n: n["norm.weight"].__setitem__(3, float("nan")), r"'norm.weight' contains non-finite"),
    (lambda n: n.update({"layers.0.ffn.gate.tid2eid": n["layers.0.ffn.gate.tid2eid"] + 8}),
     r"tid2eid' holds expert ids outside \[0, 8\)"),
    (lambda n: n.update({"layers.0.ffn.gate.tid2eid": n["layers.0.ffn.gate.tid2eid"].float()}),
     r"tid2eid' is torch.float32; allowed: an integer tensor"),
    (lambda n: n.update({"layers.2.ffn.experts.w2": n["layers.2.ffn.experts.w1"]}),
     r"'layers.2.ffn.experts.w2' has shape \[8, 32, 64\]; "
     r"allowed: the model's shape \[8, 64, 32\]"),
])
@pytest.mark.parametrize("weight_format", ["bf16", "checkpoint"])
def test_bad_update_changes_nothing(ckpts: dict[str, Path], change: object, match: str,
                                    weight_format: str) -> None:
    path = ckpts["plain" if weight_format == "bf16" else "quant"]
    engine = LLMEngine(load_model(path, dtype="float32", weight_format=weight_format),
                       EngineConfig(page_size=16, max_total_tokens=1024))
    model = engine.runner.model
    before = {name: t.clone() for name, t in model.state_dict().items()}
    new = perturbed(load_model(path, dtype="float32"))   # float experts: re-quantised if needed
    assert callable(change)
    change(new)
    with pytest.raises(ValueError, match=match):
        engine.update_weights(new)
    assert engine.weight_version == 0
    for name, t in model.state_dict().items():
        assert torch.equal(t, before[name]), f"{name} changed"


def assert_same_weights(a: DeepSeekV4ForCausalLM, b: DeepSeekV4ForCausalLM) -> None:
    """Bitwise equal weights; checkpoint-format experts and FP8 linears compare decoded (an FP4
    group whose largest code is 3 re-encodes as 6 at half the scale: other codes, the same
    values; likewise an FP8 block whose largest magnitude is under 224)."""
    quant = {n for n, m in a.named_modules() if isinstance(m, QuantExperts)}
    linears = {n for n, m in a.named_modules() if isinstance(m, QuantLinear)}
    for name, t in b.state_dict().items():
        if name.rsplit(".", 1)[0] not in quant | linears:
            assert torch.equal(a.state_dict()[name], t), name
    for name in linears:
        mine, theirs = a.get_submodule(name), b.get_submodule(name)
        assert isinstance(mine, QuantLinear) and isinstance(theirs, QuantLinear)
        assert torch.equal(mine.dequantized(torch.float32), theirs.dequantized(torch.float32))
    for name in quant:
        mine, theirs = a.get_submodule(name), b.get_submodule(name)
        assert isinstance(mine, QuantExperts) and isinstance(theirs, QuantExperts)
        for x, y in zip(mine.dequantized(torch.float32), theirs.dequantized(torch.float32),
                        strict=True):
            assert torch.equal(x, y), name


def test_checkpoint_format_requantises(ckpts: dict[str, Path], tmp_path: Path) -> None:
    """Float experts into FP4 codes and float linears into FP8 codes and block scales: the codes
    `quantize_experts_` / `quantize_linears_` make; the compressor projections rounded to the
    bf16 they are stored in (`cast_(checkpoint_precision=True)`); and an update read from
    an exported checkpoint serves exactly what loading that checkpoint serves."""
    engine = LLMEngine(load_model(ckpts["quant"], dtype="float32", weight_format="checkpoint"),
                       EngineConfig(page_size=16, max_total_tokens=1024))
    model = engine.runner.model
    float_model = load_model(ckpts["quant"], dtype="float32")
    new = perturbed(float_model, seed=2)
    ptrs = {name: t.data_ptr() for name, t in model.state_dict().items()}
    engine.update_weights(new)
    assert {name: t.data_ptr() for name, t in model.state_dict().items()} == ptrs
    float_model.load_state_dict(new)
    quantize_linears_(quantize_experts_(float_model))
    float_model.cast_(torch.float32, checkpoint_precision=True)
    expected = float_model.state_dict()
    got = model.state_dict()
    assert any(isinstance(m, QuantExperts) for m in model.modules())
    assert got.keys() == expected.keys()
    for name in got:
        assert torch.equal(got[name], expected[name]), name
    # export -> read -> update vs load: bitwise the same weights, the same outputs
    float_model = load_model(ckpts["quant"], dtype="float32")
    float_model.load_state_dict(perturbed(float_model, seed=3))
    out = tmp_path / "exported"
    write_official(float_model.config, official_state_dict(float_model).items(), out, "fp8+fp4")
    assert engine.load_weights_from_dir(out) > 0 and engine.weight_version == 2
    loaded = load_model(out, dtype="float32", weight_format="checkpoint")
    assert_same_weights(model, loaded)
    want = run(LLMEngine(loaded, EngineConfig(page_size=16, max_total_tokens=1024)), PROMPT)
    assert_same_output(run(engine, PROMPT), want)


def test_read_checkpoint_dir_refuses_bad_directories(ckpts: dict[str, Path],
                                                     tmp_path: Path) -> None:
    model = load_model(ckpts["plain"], dtype="float32")
    named = read_checkpoint_dir(ckpts["plain"], model)
    assert named.keys() == model.state_dict().keys()
    assert all(torch.equal(named[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="is not a checkpoint directory"):
        read_checkpoint_dir(tmp_path / "missing", model)
    other = tmp_path / "other"
    write_checkpoint(micro().replace(moe_inter_dim=64, index_topk=8), other, tokenizer=False)
    with pytest.raises(ValueError, match=r"another architecture: index_topk=8 \(served: 4\); "
                                         r"moe_inter_dim=64 \(served: 32\)"):
        read_checkpoint_dir(other, model)
    shard = next(other.glob("*.safetensors"))
    write_checkpoint(micro(), other, tokenizer=False)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])   # truncated
    with pytest.raises(ValueError, match="cannot be read"):
        read_checkpoint_dir(other, model)
    assert update_weights(model, named) == len(named)


@pytest.mark.parametrize("chunk", [1, 5, 7, 1000])
@pytest.mark.parametrize("bad", [None, (0, 0), (3, 1), (5, 2)])
def test_check_finite_in_slices(chunk: int, bad: tuple[int, int] | None) -> None:
    """The sliced check (bounded temporary memory) finds an inf or nan in any row, also in a
    strided view, and accepts an all-finite tensor."""
    base = torch.randn(6, 3, 2)
    t = base[:, :, 0]                         # strided [6, 3]: slicing must not need a copy
    if bad is not None:
        t[bad] = float("inf") if bad[0] % 2 else float("nan")
    if bad is None:
        check_finite({"w": t}, chunk=chunk)
    else:
        with pytest.raises(ValueError, match="'w' contains non-finite"):
            check_finite({"w": t}, chunk=chunk)
