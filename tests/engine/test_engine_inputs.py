"""Bad requests are rejected at the edge with a ValueError naming the field; the engine keeps
serving. Routing capture (for RL replay) records what the model routed, at no change to the
outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import write_checkpoint
from dsv4.model.indexer import Indexer
from dsv4.model.moe import Gate

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("inputs") / "tiny"
    write_checkpoint(micro(), out, seed=4)
    return out


@pytest.fixture(scope="module")
def llm(ckpt: Path) -> LLM:
    return LLM(ckpt, dtype="float32", device="cpu", page_size=16, max_total_tokens=1024,
               context_length=64)


@pytest.mark.parametrize(("prompt", "params", "match"), [
    ([], GREEDY, "prompt is empty"),
    (list(range(64)), GREEDY, "prompt has 64 tokens.*context length 64"),
    ([5, 600, 7], GREEDY, "prompt_token_ids contains unknown token ids \\[600\\]"),
    ([5, -1], GREEDY, "prompt_token_ids contains unknown token ids \\[-1\\]"),
])
def test_bad_requests_raise_and_engine_keeps_serving(llm: LLM, prompt: list[int],
                                                     params: SamplingParams, match: str) -> None:
    engine = llm.engine
    good = [engine.add_request([3, 4, 5, 6, 7], GREEDY),
            engine.add_request(list(range(10, 30)), GREEDY)]
    engine.step()
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    expected = llm.generate(prompt_token_ids=[r.prompt_ids for r in good], sampling_params=GREEDY,
                            use_tqdm=False)
    assert [r.output_ids for r in good] == [o.token_ids for o in expected]
    for r in good:
        engine.pop(r.rid)
    engine.check_integrity()


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"max_tokens": 0}, "max_tokens"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"temperature": -1.0}, "temperature"), ({"top_k": 0}, "top_k"),
])
def test_bad_sampling_params(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=f"{field}="):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_generate_validates_before_admitting(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate(prompt_token_ids=[[1, 2, 3], []], sampling_params=GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished() and not llm.engine.requests


def test_text_prompts_and_stop_strings(llm: LLM) -> None:
    out = llm.generate(["def f(x):", "hello"],
                       SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)
    assert all(o.text and len(o.token_ids) == 12 for o in out)
    assert llm.tokenizer is not None
    full = out[0].text
    stop = full[3:6]   # a stop string taken from the middle of the greedy text (may span tokens)
    stopped = llm.generate("def f(x):", SamplingParams(max_tokens=12, temperature=0.0,
                                                       ignore_eos=True, stop=(stop,)),
                           use_tqdm=False)[0]
    assert stopped.finish_reason == "stop" and stopped.text == full[:full.index(stop)]
    # the tokens end with the one that completed the stop string; the engine finished the request
    n = len(stopped.token_ids)
    assert n < 12 and stopped.token_ids == out[0].token_ids[:n]
    assert stop in llm.tokenizer.decode(stopped.token_ids)
    assert stop not in llm.tokenizer.decode(stopped.token_ids[:-1])
    assert not llm.engine.has_unfinished() and not llm.engine.requests


@pytest.mark.parametrize("prompt_len", [37, 1], ids=["long", "before-first-entry"])
def test_routing_capture_matches_model(ckpt: Path, prompt_len: int) -> None:
    """The captured experts and indexer picks are the model's, also for a prompt whose first
    decode steps come before any compressed entry exists (index rows all -1)."""
    prompt = torch.randint(0, 512, (prompt_len,),
                           generator=torch.Generator().manual_seed(1)).tolist()
    plain = LLM(ckpt, dtype="float32", device="cpu", page_size=16, max_total_tokens=1024,
                chunked_prefill_size=16)
    capture = LLM(ckpt, dtype="float32", device="cpu", page_size=16, max_total_tokens=1024,
                  chunked_prefill_size=16, capture_routing=True)
    a = plain.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, use_tqdm=False)[0]
    b = capture.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, use_tqdm=False)[0]
    assert a.token_ids == b.token_ids and a.routing is None and b.routing is not None
    fed = prompt + b.token_ids[:-1]
    cfg = capture.model.config
    experts, picks = b.routing["experts"], b.routing["indexer"]
    assert experts.shape == (len(fed), cfg.num_layers, cfg.num_experts_per_tok)
    assert picks.shape == (len(fed), cfg.attn_types.count("csa"), cfg.index_topk)
    seen: dict[str, list[torch.Tensor]] = {"gate": [], "indexer": []}
    hooks = [m.register_forward_hook(lambda _m, _a, out: seen["gate"].append(out[0]))
             for m in capture.model.layers.modules() if isinstance(m, Gate)]
    hooks += [m.register_forward_hook(lambda _m, _a, out: seen["indexer"].append(out[0]))
              for m in capture.model.layers.modules() if isinstance(m, Indexer)]
    with torch.no_grad():
        capture.model(torch.tensor([fed]))
    for h in hooks:
        h.remove()
    assert torch.equal(torch.stack(seen["gate"], dim=1), experts)
    for layer, full in enumerate(seen["indexer"]):          # same selected sets (order is by score)
        for t in range(len(fed)):
            want = sorted(i for i in full[t].tolist() if i >= 0)
            assert sorted(i for i in picks[t, layer].tolist() if i >= 0) == want
