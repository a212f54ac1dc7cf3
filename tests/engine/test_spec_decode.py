"""MTP speculative decoding (engine/spec_decode.py), fp32 on CPU.

Greedy: the speculative engine's tokens equal the plain engine's token for token (the plain
engine equals full recomputation: test_engine_equivalence.py), for N = 1..4, with requests
joining mid-batch, chunked prefill, prefix-cache hits and preemption. The random `micro` MTP block
drafts badly, so an `Oracle` also replaces the drafts with the true continuation, corrupted at
chosen places: every acceptance length occurs, and rejected drafts' cache writes (SWA rows,
compressor rings, compressed entries) must never reach a later token. The shipped dsv4-tiny
drafts for real (acceptance > 2 at N = 3).
Sampling: the emitted tokens have the target's distribution (chi-square against the plain
sampler, temperature 1 and 0.7 with top-p). Plus hand examples of `verify`.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.assets import default_model_path
from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import write_checkpoint
from dsv4.engine.cuda_graph import DecodeGraphs
from dsv4.engine.engine import LLMEngine
from dsv4.engine.request import Request
from dsv4.engine.sampler import SamplingBatch
from dsv4.engine.spec_decode import Segments, verify
from dsv4.engine.step_output import StepResult
from dsv4.rl.rewards import ArithmeticTask

MAX_TOKENS = 14
Outputs = dict[str, list[int]]      # rid -> output token ids


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("spec") / "micro"
    write_checkpoint(micro(), path, seed=2, tokenizer=False)
    return path


def prompts(seed: int) -> list[list[int]]:
    cfg = micro()
    W, m, M = cfg.window, cfg.csa_ratio, cfg.hca_ratio
    lengths = [1, W - 1, W + 1, 2 * m + 1, M - 1, M + 1, 2 * M + 3]
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lengths]


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class Oracle:
    """Overwrites each request's drafts after every step with its true greedy continuation,
    with the draft at index (step + rid) % (N + 1) corrupted (index N: none corrupted)."""

    def __init__(self, engine: LLMEngine, truth: dict[str, list[int]], N: int) -> None:
        self.engine, self.truth, self.N, self.steps = engine, truth, N, 0
        original = engine._process

        def process(result: StepResult) -> list[Request]:
            updated = original(result)
            self.steps += 1
            for req in engine.scheduler.running:
                if req.draft_ids:
                    req.draft_ids = self.drafts(req)
            return updated
        engine._process = process  # type: ignore[method-assign]

    def drafts(self, req: Request) -> list[int]:
        out = self.truth[req.rid][len(req.output_ids):len(req.output_ids) + self.N]
        out += [0] * (self.N - len(out))
        bad = (self.steps + int(req.rid)) % (self.N + 1)
        if bad < self.N:
            out[bad] = (out[bad] + 1) % self.engine.vocab_size
        return out


def run_staggered(engine: LLMEngine, token_lists: list[list[int]],
                  max_tokens: list[int]) -> dict[str, list[int]]:
    """Requests join two at a time while others run."""
    reqs: dict[str, Request] = {}
    pending = list(enumerate(token_lists))
    while pending or engine.has_unfinished():
        for _ in range(2):
            if pending:
                i, p = pending.pop(0)
                reqs[str(i)] = engine.add_request(p, greedy(max_tokens[i]), rid=str(i))
        engine.step()
    return {rid: r.output_ids for rid, r in reqs.items()}


def assert_pools_free(engine: LLMEngine) -> None:
    table = engine.runner.table
    engine.check_integrity()
    engine.flush_cache()
    assert table.full.num_free == table.full.num_usable
    assert table.swa.num_free == table.swa.num_usable
    assert table.num_free_slots == engine.config.max_running_requests


@pytest.fixture(scope="module")
def plain_runs() -> dict[int, Outputs]:
    """The plain engine's greedy outputs per N, shared by that N's mtp and oracle rows."""
    return {}


@pytest.mark.parametrize(("N", "page_size", "chunk"), [(1, 16, 3), (2, 16, 33), (3, 32, 7),
                                                         (4, 16, 64)])
@pytest.mark.parametrize("oracle", [False, True], ids=["mtp", "oracle"])
def test_greedy_speculation_equals_plain_decoding(ckpt: Path, plain_runs: dict[int, Outputs],
                                                  N: int, page_size: int, chunk: int,
                                                  oracle: bool) -> None:
    token_lists = prompts(seed=N)
    max_tokens = [5 + (7 * i) % 13 for i in range(len(token_lists))]
    kw = dict(dtype="float32", device="cpu", page_size=page_size, chunked_prefill_size=chunk,
              max_running_requests=5, max_total_tokens=4096)
    if N not in plain_runs:
        plain_runs[N] = run_staggered(LLM(ckpt, **kw).engine,  # type: ignore[arg-type]
                                      token_lists, max_tokens)
    want = plain_runs[N]
    spec = LLM(ckpt, speculative_num_steps=N, **kw)  # type: ignore[arg-type]
    if oracle:
        Oracle(spec.engine, want, N)
    got = run_staggered(spec.engine, token_lists, max_tokens)
    assert got == want
    engine = spec.engine
    assert sum(engine.spec_accept_hist) > 0, "no verify pass ran"
    if oracle:       # every acceptance length happened
        assert all(h > 0 for h in engine.spec_accept_hist), engine.spec_accept_hist
    assert_pools_free(engine)


def _through_graphs(ckpt: Path, device: str, capture: bool, backend: str) -> None:
    """Verify passes (uniform steps of N + 1 tokens) through `DecodeGraphs` with streams: the same
    greedy tokens as the plain engine; on CUDA with captured graphs, replayed."""
    token_lists = prompts(seed=11)
    max_tokens = [9 + i for i in range(len(token_lists))]
    kw = dict(dtype="float32", device=device, page_size=16, max_running_requests=4,
              max_total_tokens=4096, kernel_backend=backend)
    want = run_staggered(LLM(ckpt, disable_cuda_graph=True, **kw).engine,  # type: ignore[arg-type]
                         token_lists, max_tokens)
    spec = LLM(ckpt, speculative_num_steps=3, disable_cuda_graph=True,
               **kw)  # type: ignore[arg-type]
    runner = spec.engine.runner
    runner.graphs = DecodeGraphs(runner.model, runner.table, runner.pools, runner.ops, 4,
                                 capture=capture, max_tokens=4, with_streams=True)
    Oracle(spec.engine, want, 3)
    assert run_staggered(spec.engine, token_lists, max_tokens) == want
    assert runner.graphs.replays > 0 and all(h > 0 for h in spec.engine.spec_accept_hist)
    assert_pools_free(spec.engine)


def test_verify_through_static_graph_buffers(ckpt: Path) -> None:
    _through_graphs(ckpt, "cpu", capture=False, backend="ref")


@pytest.mark.gpu
def test_verify_through_captured_graphs_on_gpu(ckpt: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    _through_graphs(ckpt, "cuda", capture=True, backend="triton")


def test_penalties_carry_across_verify_steps(ckpt: Path) -> None:
    """A repetition penalty, then a presence penalty (their state counts every emitted token,
    accepted drafts included), give the plain engine's greedy tokens under speculation; each
    changes those tokens, so a state that missed a token would show."""
    token_lists = prompts(seed=5)[:4]
    kw = dict(dtype="float32", device="cpu", page_size=16, max_total_tokens=4096)
    plain = LLM(ckpt, **kw)  # type: ignore[arg-type]
    free = [o.token_ids for o in plain.generate(prompt_token_ids=token_lists,
                                                sampling_params=greedy(16), use_tqdm=False)]
    for penalty in ({"repetition_penalty": 3.0}, {"presence_penalty": 2.0}):
        _penalised_run(ckpt, plain, token_lists, free, penalty)


def _penalised_run(ckpt: Path, plain: LLM, token_lists: list[list[int]], free: list[list[int]],
                   penalty: dict[str, float]) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, **penalty)
    kw = dict(dtype="float32", device="cpu", page_size=16, max_total_tokens=4096)
    want = [o.token_ids for o in plain.generate(prompt_token_ids=token_lists,
                                                sampling_params=params, use_tqdm=False)]
    assert want != free, f"{penalty} was meant to change the greedy tokens"
    spec = LLM(ckpt, speculative_num_steps=3, **kw)  # type: ignore[arg-type]
    Oracle(spec.engine, {str(i): w for i, w in enumerate(want)}, 3)
    reqs = [spec.engine.add_request(p, params, rid=str(i)) for i, p in enumerate(token_lists)]
    while spec.engine.has_unfinished():
        spec.engine.step()
    assert [r.output_ids for r in reqs] == want
    assert spec.engine.spec_accepted_tokens > 0


def test_prefix_cache_hits_and_preemption(ckpt: Path) -> None:
    """Shared prefixes (cache hits mid-prompt) under a pool small enough to preempt."""
    base = prompts(seed=7)[-1]
    token_lists = [base + [i, i + 1, i + 2] for i in range(6)] + [base]
    plain = LLM(ckpt, dtype="float32", device="cpu", page_size=16, max_total_tokens=4096)
    want = [o.token_ids for o in plain.generate(prompt_token_ids=token_lists,
                                                sampling_params=greedy(), use_tqdm=False)]
    truth = {str(i): w for i, w in enumerate(want)}
    for oracle in (False, True):
        spec = LLM(ckpt, dtype="float32", device="cpu", page_size=16, max_total_tokens=160,
                   max_running_requests=6, chunked_prefill_size=32, speculative_num_steps=3)
        if oracle:
            Oracle(spec.engine, truth, 3)
        first = spec.generate(prompt_token_ids=token_lists[:1], sampling_params=greedy(),
                              use_tqdm=False)
        rest = spec.generate(prompt_token_ids=token_lists[1:], sampling_params=greedy(),
                             use_tqdm=False)
        assert [o.token_ids for o in first + rest] == want
        assert sum(o.cached_tokens for o in rest) > 0, "no prefix-cache hit"
        assert spec.engine.scheduler.num_preemptions > 0, "the pool was meant to preempt"
        assert_pools_free(spec.engine)


def test_dsv4_tiny_drafts_for_real(tiny_engines: dict[int, LLM]) -> None:
    """The shipped model's MTP block: the greedy tokens of the plain engine (the sampling rows'),
    more than 2 tokens per verify pass."""
    texts = [q.text for q in ArithmeticTask((3, 4, 5)).train_prompts(random.Random(0), 6)]
    kw = dict(dtype="float32", device="cpu", page_size=128, max_total_tokens=8192)
    params = greedy(20)
    want = [o.token_ids for o in tiny_engines[0].generate(texts, params, use_tqdm=False)]
    spec = LLM(default_model_path(), speculative_num_steps=3, **kw)  # type: ignore[arg-type]
    got = spec.generate(texts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == want
    accept = spec.engine.mean_acceptance_length()
    assert accept is not None and accept > 2.0, spec.engine.spec_accept_hist
    assert sum(o.spec_accepted_tokens for o in got) == spec.engine.spec_accepted_tokens
    assert all(o.spec_draft_tokens > 0 for o in got)


def test_needs_an_mtp_block(tmp_path: Path) -> None:
    path = tmp_path / "no-mtp"
    write_checkpoint(micro().replace(num_mtp_layers=0), path, seed=0, tokenizer=False)
    with pytest.raises(ValueError, match="speculative_num_steps=2 needs a checkpoint with an MTP"):
        LLM(path, dtype="float32", device="cpu", page_size=16, max_total_tokens=512,
            speculative_num_steps=2)


# ---- verify: hand examples ----------------------------------------------------------------------

def _batch(params: list[SamplingParams], steps: list[int]) -> SamplingBatch:
    return SamplingBatch.build(params, steps, [7] * len(params), "cpu", vocab_size=5)


def test_verify_greedy_accepts_the_leading_run() -> None:
    # two segments: drafts [2, 3] then [] ; rows' argmax: 2, 1, 4 | 0
    logits = torch.full((4, 5), -5.0)
    for row, tok in enumerate([2, 1, 4, 0]):
        logits[row, tok] = 5.0
    segs = Segments.build([3, 1], torch.tensor([9, 2, 3, 9]))
    out = verify(logits, segs, _batch([greedy()] * 4, [0, 1, 2, 0]), None, None)
    assert out.accepted.tolist() == [1, 0]          # draft 2 accepted, draft 3 != argmax 1
    assert out.tokens.tolist() == [2, 1, -1, 0]      # accepted draft, correction, -, plain


def test_verify_counts_drafts_in_the_penalties() -> None:
    """A presence penalty on the drafts fed before a row changes that row's argmax."""
    logits = torch.tensor([[0.0, 3.0, 2.9, 0.0, 0.0]] * 3)
    segs = Segments.build([3], torch.tensor([0, 1, 1]))           # drafts 1, 1
    params = SamplingParams(max_tokens=4, temperature=0.0, presence_penalty=1.0)
    counts = torch.zeros(3, 5, dtype=torch.int32)
    seen = torch.zeros(3, 5, dtype=torch.bool)
    out = verify(logits, segs, _batch([params] * 3, [0, 1, 2]), counts, seen)
    # row 0: argmax 1 == draft 1; row 1 has seen draft 1: argmax 2 != draft 1
    assert out.accepted.tolist() == [1]
    assert out.tokens.tolist() == [1, 2, -1]


def chi2_p(table: list[list[int]]) -> float:
    """p-value of the chi-square test that the rows of a contingency table come from one
    distribution (columns with fewer than 10 counts in all are dropped)."""
    t = torch.tensor(table, dtype=torch.float64)
    t = t[:, t.sum(0) >= 10]
    expected = t.sum(1, keepdim=True) * t.sum(0, keepdim=True) / t.sum()
    stat = ((t - expected) ** 2 / expected).sum()
    df = (t.shape[0] - 1) * (t.shape[1] - 1)
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


def test_verify_sampling_reproduces_the_target_distribution() -> None:
    """20,000 segments of 2 drafts (the mode of each row's p, a top-1 drafter) with their own
    seeds: token 0 is distributed as p_0 and, given draft 0 accepted, token 1 as p_1."""
    V, n = 5, 20_000
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, V, generator=gen) * 1.5, dim=-1)
    drafts = p[:2].argmax(dim=-1)
    logits = p.log().repeat(n, 1)                                          # [3n, V]
    segs = Segments.build([3] * n, torch.cat((torch.tensor([0]), drafts)).repeat(n))
    params = SamplingParams(max_tokens=3, temperature=1.0)
    batch = SamplingBatch.build([params] * 3 * n, [0, 1, 2] * n,
                                [s for s in range(n) for _ in range(3)], "cpu", vocab_size=V)
    out = verify(logits, segs, batch, None, None)
    tokens = out.tokens.view(n, 3)
    expected = (p * n).round().long().tolist()
    assert chi2_p([torch.bincount(tokens[:, 0], minlength=V).tolist(), expected[0]]) > 1e-3
    second = tokens[out.accepted >= 1, 1]
    assert second.numel() > 1000
    want = (p[1] * second.numel()).round().long().tolist()
    assert chi2_p([torch.bincount(second, minlength=V).tolist(), want]) > 1e-3
    cols = torch.arange(3).expand(n, -1)
    assert bool((tokens[cols > out.accepted[:, None]] == -1).all())


@pytest.fixture(scope="module")
def tiny_engines() -> dict[int, LLM]:
    """dsv4-tiny plain (N = 0) and speculative (N = 3), shared by the sampling rows: each request
    carries its own sampling parameters and seed, so a row's tokens do not depend on the other's
    run."""
    kw = dict(dtype="float32", device="cpu", page_size=128, max_total_tokens=1 << 16,
              max_running_requests=256)
    return {N: LLM(default_model_path(), speculative_num_steps=N, **kw)  # type: ignore[arg-type]
            for N in (0, 3)}


def shared_page_prompt(llm: LLM) -> list[int]:
    """One page and one token (129 ids): bos, then the end of a chat of 20 solved level-6
    problems and a new one's question. The requests share the page through the prefix cache
    (each prefills one token), and the model is unsure of the answer's digits, so that its drafts
    are accepted and rejected often enough for a wrong acceptance rule or residual to show."""
    task = ArithmeticTask((6,))
    eos = llm.model.config.eos_token_id
    chat = [t for p in task.train_prompts(random.Random(2), 20)
            for t in llm.encode(p.text + p.problem.answer)[1:] + [eos]]
    question = llm.encode(task.train_prompts(random.Random(1), 1)[0].text)
    return question[:1] + (chat + question[1:])[-llm.engine.config.page_size:]


@pytest.mark.slow
@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_speculative_sampling_keeps_the_distribution(tiny_engines: dict[int, LLM],
                                                     temperature: float, top_p: float) -> None:
    """Tokens 1-3 of many seeded requests of one prompt (`shared_page_prompt`): speculative vs
    plain sampling, chi-square per position (two samples of one distribution) well above the
    1e-3 level."""
    ids = shared_page_prompt(tiny_engines[0])
    n = 512
    runs = {}
    for N, llm in tiny_engines.items():
        accepted = llm.engine.spec_accepted_tokens
        params = [SamplingParams(max_tokens=4, temperature=temperature, top_p=top_p,
                                 ignore_eos=True, seed=s + 100_000 * N) for s in range(n)]
        outs = llm.generate(prompt_token_ids=[ids] * n, sampling_params=params, use_tqdm=False)
        runs[N] = [o.token_ids for o in outs]
        if N:
            assert llm.engine.spec_accepted_tokens > accepted
    for pos in (1, 2, 3):
        a = [t[pos] for t in runs[0]]
        b = [t[pos] for t in runs[3]]
        vocab = sorted(set(a) | set(b))
        table = [[a.count(v) for v in vocab], [b.count(v) for v in vocab]]
        p = chi2_p(table)
        assert p > 1e-3, (pos, p, table)
