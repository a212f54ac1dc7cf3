"""ShadowRadix in the engine: cache on == cache off (tokens and logits), hits where prefixes are
shared, SWA-safe re-matching after tombstoning (and tombstone recovery), and the SWA footprint of a
long request."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_engine_equivalence import LogitRecorder, assert_pools_free

from dsv4 import LLM, SamplingParams
from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import write_checkpoint
from dsv4.engine.engine import LLMEngine
from dsv4.engine.request import Request

TOL = 1e-4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("prefix") / "tiny"
    write_checkpoint(micro(), out, seed=6, tokenizer=False)
    return out


def pair(ckpt: Path, **kw: object) -> tuple[LLM, LLM]:
    args = dict(dtype="float32", device="cpu", page_size=16, max_total_tokens=8192,
                chunked_prefill_size=40, **kw)
    return LLM(ckpt, **args), LLM(ckpt, disable_prefix_cache=True, **args)  # type: ignore[arg-type]


def toks(n: int, seed: int) -> list[int]:
    return torch.randint(2, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_one(engine: LLMEngine, prompt: list[int], params: SamplingParams, rid: str) -> Request:
    req = engine.add_request(prompt, params, rid=rid)
    while not req.is_finished:
        engine.step()
    return req


def compare(on: LLM, off: LLM, rec: LogitRecorder, reqs_on: list[Request],
            reqs_off: list[Request]) -> None:
    for a, b in zip(reqs_on, reqs_off, strict=True):
        assert a.output_ids == b.output_ids, f"request {a.rid}: cache on/off outputs differ"
        diff = (torch.stack(rec.rows[a.rid]) - torch.stack(rec.rows[b.rid])).abs().max().item()
        assert diff <= TOL, f"request {a.rid}: logits differ by {diff}"


def test_multi_turn_chat(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rec = LogitRecorder(monkeypatch)
    on, off = pair(ckpt)
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    reqs_on, reqs_off = [], []
    for conv in range(3):
        # lengths not multiples of 4, 16 (P, m') or 8 (W)
        history = toks(13 + 6 * conv, seed=conv)
        for turn in range(4):
            history = history + toks(7 + turn, seed=100 * conv + turn)
            a = run_one(on.engine, history, params, f"on-{conv}-{turn}")
            b = run_one(off.engine, history, params, f"off-{conv}-{turn}")
            reqs_on.append(a)
            reqs_off.append(b)
            history = history + a.output_ids
            if turn:
                assert a.cached_tokens >= 16, "a later turn must hit the cached conversation"
    compare(on, off, rec, reqs_on, reqs_off)
    assert on.engine.prefix_hit_rate() > 0.5 and off.engine.prefix_hit_rate() == 0.0
    on.engine.check_integrity()
    assert_pools_free(on.engine)


def test_group_samples_and_few_shot(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rec = LogitRecorder(monkeypatch)
    on, off = pair(ckpt)
    prompt = toks(53, seed=7)
    first = [run_one(e.engine, prompt, SamplingParams(max_tokens=4, temperature=0.0), f"{n}-warm")
             for e, n in ((on, "on"), (off, "off"))]
    reqs: dict[str, list[Request]] = {"on": [first[0]], "off": [first[1]]}
    for llm, name in ((on, "on"), (off, "off")):
        for i in range(16):     # 16 samples of one prompt, all in flight together
            params = SamplingParams(max_tokens=6, temperature=0.8, seed=i)
            reqs[name].append(llm.engine.add_request(prompt, params, rid=f"{name}-s{i}"))
        header = toks(75, seed=8)
        for i in range(5):      # few-shot prompts sharing a long header
            params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
            reqs[name].append(llm.engine.add_request(header + toks(3 + 2 * i, seed=20 + i), params,
                                                     rid=f"{name}-f{i}"))
        while llm.engine.has_unfinished():
            llm.engine.step()
    compare(on, off, rec, reqs["on"], reqs["off"])
    assert all(r.cached_tokens == 48 for r in reqs["on"][1:17]), \
        "every sample hits the warmed prompt"
    assert len({tuple(r.output_ids) for r in reqs["on"][1:17]}) > 1, "seeded samples should differ"
    assert_pools_free(on.engine)


def test_tombstoned_prefix_is_rematched_safely(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rec = LogitRecorder(monkeypatch)
    on, off = pair(ckpt)
    cache = on.engine.cache
    assert cache is not None
    params = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    base = toks(70, seed=11)
    reqs_on = [run_one(on.engine, base, params, "on-0")]
    reqs_off = [run_one(off.engine, base, params, "off-0")]
    follow = base + reqs_on[0].output_ids + toks(9, seed=12)
    long_params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    # runs on, full-locking the shared path
    x = on.engine.add_request(follow, long_params, rid="on-x")
    # ... a horizon past it: SWA lock dropped
    while len(x.output_ids) < 2 * cache.horizon:
        on.engine.step()
    # SWA pressure: tombstone what is unlocked
    cache.evict(0, cache.swa_live)
    assert cache.swa_live == 0 and cache.num_pages > 0
    on.engine.check_integrity()
    y = run_one(on.engine, follow, params, "on-y")  # prefix is tombstones only: no hit
    assert y.cached_tokens == 0
    assert cache.swa_live > 0, \
        "y's duplicate pages inside its horizon revived a tombstone (recovery)"
    while not x.is_finished:
        on.engine.step()
    reqs_on += [x, y]
    reqs_off.append(run_one(off.engine, follow, long_params, "off-x"))
    reqs_off.append(run_one(off.engine, follow, params, "off-y"))
    z = run_one(on.engine, follow + toks(5, seed=13), params, "on-z")
    assert z.cached_tokens >= 64, "after recovery the prefix is SWA-safe again"
    reqs_on.append(z)
    reqs_off.append(run_one(off.engine, follow + toks(5, seed=13), params, "off-z"))
    compare(on, off, rec, reqs_on, reqs_off)
    on.engine.check_integrity()
    assert_pools_free(on.engine)


def held_swa_tokens(engine: LLMEngine, req: Request) -> int:
    """Positions behind the first SWA page this request holds (private with SWA, or SWA-locked in
    the tree)."""
    table, cache = engine.runner.table, engine.cache
    assert cache is not None and req.slot is not None
    locked = {p for n in cache._nodes() if n.swa_lock for p in n.pages}
    held = [i for i, p in enumerate(table.full_pages[req.slot])
            if (p in table.swa_of and p not in table.shared) or p in locked]
    return req.num_cached - min(held) * table.P


def test_long_request_swa_footprint_and_later_hit(tmp_path: Path) -> None:
    cfg = micro().replace(window=128, hca_ratio=128, max_position_embeddings=16384,
                          num_mtp_layers=0)
    write_checkpoint(cfg, tmp_path, seed=1, tokenizer=False)
    llm = LLM(tmp_path, dtype="float32", device="cpu", page_size=256, chunked_prefill_size=512,
              max_running_requests=4, max_total_tokens=8192)
    engine = llm.engine
    # 12 pages in 6 chunks; the decode slides the window past the prompt's end
    prompt = toks(3_000, seed=3)
    req = engine.add_request(prompt, SamplingParams(max_tokens=cfg.window + 32, temperature=0.0,
                                                    ignore_eos=True))
    worst = 0
    while not req.is_finished:
        engine.step()
        if not req.is_finished and req.num_cached >= len(prompt):
            worst = max(worst, held_swa_tokens(engine, req))
    assert 0 < worst <= cfg.window + 256, f"the request held {worst} SWA slots after its prefill"
    later = engine.add_request(prompt[:2700] + toks(40, seed=4), SamplingParams(max_tokens=2))
    while not later.is_finished:
        engine.step()
    assert later.cached_tokens >= 2304
    engine.check_integrity()


def test_penalties_start_from_the_request_on_a_cache_hit(ckpt: Path) -> None:
    """A request that continues a cached prefix (its first step does not start at position 0) gets
    its slot's penalty state rebuilt from its own tokens, not the slot's previous occupant's: with
    repetition, presence and frequency penalties, greedy outputs are the same cache on and off."""
    on, off = pair(ckpt)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                            repetition_penalty=1.5, presence_penalty=2.0, frequency_penalty=1.0)
    prompt = toks(70, seed=41)
    outs = {}
    for name, llm in (("on", on), ("off", off)):
        first = run_one(llm.engine, prompt, params, rid="first")
        second = run_one(llm.engine, prompt[:-3] + toks(3, seed=42), params, rid="second")
        outs[name] = (first.output_ids, second.output_ids, second.cached_tokens)
    assert outs["on"][2] > 0 and outs["off"][2] == 0, "only the cache-on second request hits"
    assert outs["on"][:2] == outs["off"][:2]


def test_copies_of_one_prompt_arriving_together_compute_it_once(ckpt: Path) -> None:
    """In-batch prefix sharing: 8 copies of a 100-token prompt added at once (the step budget
    would admit them all together) wait for the first one's pages: every later copy reuses all
    its whole pages but the last (96 of 100 tokens here), with the cache-off tokens. With the
    cache off nothing waits (all 8 prefill in one step)."""
    on, off = (LLM(ckpt, dtype="float32", device="cpu", page_size=16, max_total_tokens=8192,
                   chunked_prefill_size=2048, disable_prefix_cache=disabled)
               for disabled in (False, True))
    prompt = toks(100, seed=3)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    got = on.generate(prompt_token_ids=[prompt] * 8, sampling_params=params, use_tqdm=False)
    want = off.generate(prompt_token_ids=[prompt] * 8, sampling_params=params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.cached_tokens for o in got] == [0] + [96] * 7
    assert off.engine.steps == 6 and on.engine.steps == 7   # one step of waiting, with the cache
    assert_pools_free(on.engine)


def test_repeated_prompts_hit_when_their_pages_outgrow_the_swa_pool(ckpt: Path) -> None:
    """Issue 20's workload at 1/16 scale: 32 distinct prompts of 16 pages less one token (in two
    prefill chunks), then the same 32 again, default pool sizing: their cached pages (512) are
    more than the SWA pool's (201), so eviction tombstones inner nodes. The point a repeat
    matches (the prompt's last whole page before its last token) is an anchor and keeps its SWA
    after the other inner nodes: every repeat reuses 15 of its 16 pages, with the same outputs.
    (Before anchors, inner nodes went least recent prompt first, its match point included: 32%
    of the prompt tokens were reused at full scale.)"""
    llm = LLM(ckpt, dtype="float32", device="cpu", page_size=16, chunked_prefill_size=128)
    prompts = [toks(16 * 16 - 1, seed=100 + i) for i in range(32)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert 32 * 16 > llm.engine.runner.table.swa.num_usable, "no SWA pressure: nothing to test"
    again = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.cached_tokens for o in again] == [15 * 16] * 32
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    llm.engine.check_integrity()
