"""Routing (R3) and indexer replay through ForwardMode.replay: the recorded selections are used
even when the live router / indexer would choose otherwise, the gate keeps its gradient, and bad
arrays are refused with the array's name and expected shape."""

from __future__ import annotations

import pytest
import torch

from dsv4.assets import default_model_path
from dsv4.config.engine import EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.model.forward_mode import INFERENCE, TRAINING, Replay
from dsv4.model.loader import load_model
from dsv4.model.moe import Experts
from dsv4.rl.batch import pack
from dsv4.rl.rewards import ArithmeticTask
from dsv4.rl.rollout import generate_samples


@pytest.fixture(scope="module")
def rollout():
    """A policy, and a packed batch of 6 engine samples with their recorded selections."""
    from tokenizers import Tokenizer

    path = default_model_path()
    model = load_model(path, dtype="float32", device="cpu")
    engine = LLMEngine(load_model(path, dtype="float32", device="cpu"),
                       EngineConfig(page_size=128, max_total_tokens=4096, capture_routing=True,
                                    disable_prefix_cache=True))
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    import random

    prompts = ArithmeticTask((4, 5)).train_prompts(random.Random(0), 3)
    samples = generate_samples(engine, tok, prompts, 2, 1.0, 8, seed=0)
    batch = pack(samples, torch.zeros(len(samples)), routing=True, indexer=True)
    return model, batch


def _used_experts(model, inputs, mode) -> list[torch.Tensor]:
    used: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda mod, args, out: used.append(args[1].clone()))
             for m in model.modules() if isinstance(m, Experts)]
    with torch.no_grad():
        model(inputs, mode)
    for h in hooks:
        h.remove()
    return used


def test_recorded_experts_are_used_when_live_routing_differs(rollout) -> None:
    model, batch = rollout
    replay = batch.replay
    saved = {n: p.detach().clone() for n, p in model.named_parameters() if "gate" in n}
    try:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("gate.weight"):
                    p.add_(torch.randn_like(p) * 5)
        live = _used_experts(model, batch.inputs, INFERENCE)
        used = _used_experts(model, batch.inputs, INFERENCE.with_replay(replay))
        rows = batch.inputs.numel()
        differs = False
        for layer, (a, b) in enumerate(zip(live, used, strict=True)):
            rec = replay.experts[:, :, layer].reshape(rows, -1).long()
            real = rec[:, 0] >= 0
            assert torch.equal(b[real], rec[real]), f"layer {layer} did not use the recording"
            differs |= not torch.equal(a[real], rec[real])
        assert differs, "perturbing the gates did not change live routing: the test is vacuous"
    finally:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in saved:
                    p.copy_(saved[n])


def test_recorded_indexer_picks_are_used(rollout) -> None:
    """With indexer replay the indexer's weights cannot change the output, and the recorded
    entries are what the attention reads: a recording that drops all but each query's first
    pick changes the output. (These sequences are shorter than index_topk * ratio, so the live
    indexer keeps every visible entry whatever its weights.)"""
    model, batch = rollout
    mode = INFERENCE.with_replay(batch.replay)
    with torch.no_grad():
        before_replay, before_live = model(batch.inputs, mode), model(batch.inputs, INFERENCE)
        saved = {n: p.clone() for n, p in model.named_parameters() if ".indexer." in n}
        for n, p in model.named_parameters():
            if n in saved and n.endswith("wq_b.weight"):
                p.copy_(torch.randn_like(p))
        after_replay, after_live = model(batch.inputs, mode), model(batch.inputs, INFERENCE)
        for n, p in model.named_parameters():
            if n in saved:
                p.copy_(saved[n])
    assert torch.equal(before_replay, after_replay)
    assert torch.equal(before_live, after_live)
    fewer = batch.replay.indexer.clone()
    fewer[..., 1:] = -1
    assert int((batch.replay.indexer[..., 1] >= 0).sum()) > 0, "no query had two entries"
    with torch.no_grad():
        dropped = model(batch.inputs, INFERENCE.with_replay(Replay(batch.replay.experts, fewer)))
    assert not torch.equal(dropped, before_replay)


@pytest.mark.parametrize("base", [INFERENCE, TRAINING], ids=["inference", "training"])
def test_gate_weights_get_gradient_through_gathered_scores(rollout, base) -> None:
    model, batch = rollout
    model.zero_grad(set_to_none=True)
    logits = model(batch.inputs, base.with_replay(batch.replay))
    logits.log_softmax(-1).gather(-1, batch.targets[..., None]).sum().backward()
    for i, layer in enumerate(model.layers):
        gate = layer.ffn.gate
        if gate.tid2eid is None:                      # routed layer: scores are gathered
            assert gate.weight.grad is not None and gate.weight.grad.abs().sum() > 0, i
    model.zero_grad(set_to_none=True)


def test_bad_replay_arrays_raise_with_the_array_name(rollout) -> None:
    model, batch = rollout
    r = batch.replay
    B, S = batch.inputs.shape
    cases = [(Replay(experts=r.experts[:, :-1]), "replay.experts has shape"),
             (Replay(indexer=r.indexer[..., :3]), "replay.indexer has shape"),
             (Replay(experts=r.experts.float()), "replay.experts has shape"),
             (Replay(experts=torch.full_like(r.experts, 99)), "outside"),
             (Replay(experts=r.experts.roll(1, dims=2)), "tid2eid")]
    for replay, message in cases:
        with pytest.raises(ValueError, match=message), torch.no_grad():
            model(batch.inputs, INFERENCE.with_replay(replay))
    assert (B, S) == tuple(batch.inputs.shape)
