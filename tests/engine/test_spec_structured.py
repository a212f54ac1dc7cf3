"""Structured output under MTP speculative decoding, fp32 on CPU with the `micro` model and its
own 512-token tokenizer.

Greedy: JSON schema, regex, choice and EBNF requests (and an unconstrained neighbour) give the
plain engine's tokens and finish reasons for N = 1..3, drafted by the MTP block and by an
`Oracle` that feeds the true continuation with one draft per step replaced, alternately, by the
target's unconstrained argmax where the grammar forbids it (a draft that unmasked verification
would accept) and by a token the grammar allows but the target does not pick. The oracle's drafts
run past the end of the output, so the grammar terminates (eos) inside accepted drafts and the
tokens after it must be dropped, with eos honoured and with `ignore_eos` (the grammar's own
stop). Plus `draft_token_bitmask` against a matcher stepped by hand, and masked `verify`: greedy
and sampled rejection of disallowed drafts, and the sampled tokens' distribution (chi-square
against the masked target)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_spec_decode import chi2_p

from dsv4 import LLM, SamplingParams
from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import write_checkpoint
from dsv4.engine.cuda_graph import DecodeGraphs
from dsv4.engine.engine import LLMEngine
from dsv4.engine.grammar import draft_token_bitmask, new_matcher, token_bitmask
from dsv4.engine.request import Request
from dsv4.engine.sampler import SamplingBatch
from dsv4.engine.sampling_params import StructuredOutput
from dsv4.engine.spec_decode import Segments, verify
from dsv4.engine.step_output import StepResult

SCHEMA = {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"enum": ["x", "yz"]},
    "c": {"type": "boolean"}}, "required": ["a", "b", "c"]}
SPECS = [StructuredOutput("json_schema", json.dumps(SCHEMA)),
         StructuredOutput("regex", r"[0-9]{1,3}(,[a-f]{1,2}){0,3}"),
         StructuredOutput("choice", json.dumps(["alpha", "beta", "gamma"])),
         StructuredOutput("ebnf", 'root ::= "(" [0-9] [0-9]? ("+" [0-9])? ")"'),
         StructuredOutput("json_schema", json.dumps(SCHEMA)),
         StructuredOutput("regex", r"[a-z]{2,5}(-[0-9])?"),
         None]
KW: dict[str, Any] = dict(dtype="float32", device="cpu", page_size=16, max_total_tokens=4096,
                          max_running_requests=4, chunked_prefill_size=24)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("spec_structured") / "micro"
    write_checkpoint(micro(), path, seed=2)             # with its tokenizer
    return path


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(4, 512, (n,), generator=g).tolist() for n in (3, 9, 17, 30, 5, 12, 7)]


def _params(i: int, spec: StructuredOutput | None) -> SamplingParams:
    # even requests ignore eos: their grammar's termination ends them
    return SamplingParams(max_tokens=40 if spec is not None else 12, temperature=0.0,
                          ignore_eos=i % 2 == 0, structured=spec)


def _run(engine: LLMEngine) -> list[tuple[list[int], str | None]]:
    """Requests join two at a time while others run (popped once done); each is scheduled as it
    joins (its grammar compiled first), so every run batches alike."""
    reqs: list[Request] = []
    pending = list(enumerate(zip(_prompts(), SPECS, strict=True)))
    while pending or engine.has_unfinished():
        for _ in range(2):
            if pending:
                i, (p, spec) = pending.pop(0)
                reqs.append(engine.add_request(p, _params(i, spec), rid=str(i)))
        while engine._compiling:
            engine._admit_compiled(wait_s=0.05)
        engine.step()
    for r in reqs:
        engine.pop(r.rid)
    return [(r.output_ids, r.finish_reason) for r in reqs]


Reference = tuple[list[tuple[list[int], str | None]], list[list[int]]]


@pytest.fixture(scope="module")
def plain(ckpt: Path) -> Reference:
    return reference(LLM(ckpt, **KW))


def reference(llm: LLM) -> Reference:
    """The plain engine's (tokens, finish reason) per request, and per request the target's
    unconstrained argmax at each of its output positions (prompt log-probs over prompt + output)."""
    want = _run(llm.engine)
    assert all(reason == "stop" for (_, reason), s in zip(want, SPECS, strict=True) if s), want
    full = [p + toks for p, (toks, _) in zip(_prompts(), want, strict=True)]
    outs = llm.generate(prompt_token_ids=full, use_tqdm=False, sampling_params=SamplingParams(
        max_tokens=1, temperature=0.0, prompt_logprobs=1))
    argmax = []
    for p, out in zip(_prompts(), outs, strict=True):
        assert out.prompt_top_logprobs is not None
        argmax.append([max(top, key=top.__getitem__)
                       for top in out.prompt_top_logprobs[len(p):]])
    return want, argmax


class Oracle:
    """After every step, each drafting request's drafts become its true continuation (padded with
    token 0 past its end), the draft at index (step + rid) % (N + 1) replaced (index N: none;
    none either once the continuation ends inside the drafts): on even steps by the target's
    unconstrained argmax there when the grammar forbids it, else by the true token + 1. Counts
    the forbidden drafts fed after a correct prefix (`forbidden`) and keeps the requests whose
    last step emitted tokens past the one that finished them (`dropped`)."""

    def __init__(self, engine: LLMEngine, truth: list[list[int]], argmax: list[list[int]],
                 N: int) -> None:
        self.engine, self.truth, self.argmax, self.N = engine, truth, argmax, N
        self.steps = self.forbidden = 0
        self.dropped: set[int] = set()
        original = engine._process

        def process(result: StepResult) -> list[Request]:
            before = {id(r): len(r.output_ids) for r in result.requests}
            updated = original(result)
            self.steps += 1
            for req, out in zip(result.requests, result.outputs, strict=True):
                if req.is_finished and len(req.output_ids) - before[id(req)] < len(out.token_ids):
                    self.dropped.add(int(req.rid))
            for req in engine.scheduler.running:
                if req.draft_ids:
                    req.draft_ids = self.drafts(req)
            return updated
        engine._process = process  # type: ignore[method-assign]

    def drafts(self, req: Request) -> list[int]:
        i, n = int(req.rid), len(req.output_ids)
        out = self.truth[i][n:n + self.N]
        out += [0] * (self.N - len(out))
        bad = (self.steps + i) % (self.N + 1)
        if bad >= self.N or n + self.N >= len(self.truth[i]):
            return out
        alt = self.argmax[i][n + bad]
        if self.steps % 2 == 0 and req.grammar is not None and alt != out[bad]:
            m = req.grammar.fork()
            assert all(m.accept_token(t) for t in out[:bad])
            assert not m.accept_token(alt), "the unconstrained argmax is allowed"
            out[bad] = alt
            self.forbidden += 1
        else:
            out[bad] = (out[bad] + 1) % self.engine.vocab_size
        return out


@pytest.mark.parametrize("N", [1, 2, 3])
@pytest.mark.parametrize("oracle", [False, True], ids=["mtp", "oracle"])
def test_greedy_structured_speculation_equals_plain_decoding(ckpt: Path, plain: Reference,
                                                             N: int, oracle: bool) -> None:
    want, argmax = plain
    spec = LLM(ckpt, speculative_num_steps=N, **KW)
    engine = spec.engine
    drafts = Oracle(engine, [t for t, _ in want], argmax, N) if oracle else None
    assert _run(engine) == want
    assert sum(engine.spec_accept_hist) > 0, "no verify pass ran"
    if drafts is not None:
        assert all(h > 0 for h in engine.spec_accept_hist), engine.spec_accept_hist
        assert drafts.forbidden > 0, "no draft the grammar forbids was fed"
        # finished inside the accepted drafts: by eos, and by the grammar's end (ignore_eos)
        assert {i % 2 for i in drafts.dropped if SPECS[i]} == {0, 1}, drafts.dropped
    engine.check_integrity()
    engine.flush_cache()
    table = engine.runner.table
    assert table.full.num_free == table.full.num_usable
    assert table.num_free_slots == engine.config.max_running_requests


def _through_graphs(ckpt: Path, device: str, capture: bool, backend: str,
                    plain: Reference | None = None) -> None:
    """Verify passes (uniform steps of N + 1 tokens) through `DecodeGraphs` with streams, the
    masks applied to the graph's logits: the plain engine's tokens and finish reasons."""
    kw = {**KW, "device": device, "kernel_backend": backend, "disable_cuda_graph": True}
    want, argmax = plain if plain is not None else reference(LLM(ckpt, **kw))
    spec = LLM(ckpt, speculative_num_steps=3, **kw)
    runner = spec.engine.runner
    runner.graphs = DecodeGraphs(runner.model, runner.table, runner.pools, runner.ops, 4,
                                 capture=capture, max_tokens=4, with_streams=True)
    drafts = Oracle(spec.engine, [t for t, _ in want], argmax, 3)
    assert _run(spec.engine) == want
    assert runner.graphs.replays > 0 and drafts.forbidden > 0
    assert spec.engine.spec_accepted_tokens > 0


def test_structured_verify_through_static_graph_buffers(ckpt: Path, plain: Reference) -> None:
    _through_graphs(ckpt, "cpu", capture=False, backend="ref", plain=plain)


@pytest.mark.gpu
def test_structured_verify_through_captured_graphs_on_gpu(ckpt: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    _through_graphs(ckpt, "cuda", capture=True, backend="triton")


def test_speculative_engine_takes_structured_requests_but_not_prompt_logprobs(
        ckpt: Path) -> None:
    engine = LLM(ckpt, speculative_num_steps=2, **KW).engine
    engine.validate([5, 6], _params(0, SPECS[0]))
    with pytest.raises(ValueError, match="prompt_logprobs is not supported with speculative"):
        engine.validate([5, 6], SamplingParams(max_tokens=2, prompt_logprobs=1))


# ---- draft_token_bitmask -----------------------------------------------------------------------

def test_draft_bitmask_rows_follow_the_drafts_and_leave_the_matcher(ckpt: Path) -> None:
    llm = LLM(ckpt, **KW)
    assert llm.engine.grammars is not None and llm.tokenizer is not None
    compiled = llm.engine.grammars.prepare(StructuredOutput("regex", "ab(c|d)")).result()
    a, b, c, d = (llm.tokenizer.token_to_id(ch) for ch in "abcd")
    eos = llm.engine.eos_token_id

    def stepped(tokens: list[int]) -> torch.Tensor:
        m = new_matcher(compiled)
        assert all(m.accept_token(t) for t in tokens)
        bits = token_bitmask([m], 512)
        assert bits is not None
        return bits[0]

    m = new_matcher(compiled)
    assert m.accept_token(a)
    before = token_bitmask([m], 512)
    cases = [
        ([b, c, eos], [[a], [a, b], [a, b, c], [a, b, c]]),   # terminates on the last draft
        ([b, a, c], [[a], [a, b], [a, b], [a, b]]),          # a rejected: its row and after repeat
        ([c, b, d], [[a], [a], [a], [a]]),                  # the first draft rejected
        ([], [[a]]),
    ]
    other = new_matcher(compiled)
    bits = draft_token_bitmask([m, None, other], [cases[0][0], [7, 8], [a, b]], 512)
    assert bits is not None and bits.shape == (4 + 3 + 3, 16)
    assert torch.equal(bits[:4], torch.stack([stepped(t) for t in cases[0][1]]))
    assert bool((bits[4:7] == -1).all())                    # no grammar: everything allowed
    assert torch.equal(bits[7:], torch.stack([stepped(t) for t in ([], [a], [a, b])]))
    for drafts, states in cases[1:]:
        bits = draft_token_bitmask([m], [drafts], 512)
        assert bits is not None
        assert torch.equal(bits, torch.stack([stepped(t) for t in states]))
    assert torch.equal(token_bitmask([m], 512), before)     # rolled back every time
    assert m.accept_token(b) and not m.accept_token(a)
    assert draft_token_bitmask([None], [[1, 2]], 512) is None


# ---- verify with masks ------------------------------------------------------------------------

def _bits(allowed: list[list[int]], V: int) -> torch.Tensor:
    bits = torch.zeros(len(allowed), (V + 31) // 32, dtype=torch.int32)
    for row, toks in enumerate(allowed):
        for t in toks:
            bits[row, t // 32] |= 1 << (t % 32)
    return bits


def test_verify_greedy_rejects_a_draft_the_mask_forbids() -> None:
    """Each row's raw argmax is 4; the masks forbid it on row 0 (draft 4 rejected, token 1) and
    allow it on row 1 of the second segment."""
    logits = torch.tensor([[0.0, 2.0, 1.0, 0.0, 5.0]] * 5)
    segs = Segments.build([3, 2], torch.tensor([9, 4, 4, 9, 4]))
    allowed = _bits([[1, 2], [0, 1, 2, 3, 4], [4], [1, 4], [4]], 5)
    batch = SamplingBatch.build([SamplingParams(max_tokens=4, temperature=0.0)] * 5,
                                [0, 1, 2, 0, 1], [7] * 5, "cpu", vocab_size=5)
    out = verify(logits, segs, batch, None, None, allowed)
    assert out.accepted.tolist() == [0, 1]
    assert out.tokens.tolist() == [1, -1, -1, 4, 4]
    unmasked = verify(logits, segs, batch, None, None)
    assert unmasked.accepted.tolist() == [2, 1]


def test_masked_rejection_sampling_reproduces_the_masked_target() -> None:
    """20,000 seeded segments of 2 drafts, the first the mode of the unmasked row-0 p, which the
    row-0 mask forbids: never accepted, token 0 distributed as the masked p_0. A second half has
    an allowed first draft: given it is accepted, token 1 is distributed as the masked p_1."""
    V, n = 6, 20_000
    gen = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(3, V, generator=gen) * 1.5, dim=-1)
    mode = int(p[0].argmax())
    masks = [[t for t in range(V) if t != mode], [t for t in range(V) if t % 2 == 0],
             list(range(V))]
    masked = p * torch.tensor([[float(t in m) for t in range(V)] for m in masks])
    masked = masked / masked.sum(dim=-1, keepdim=True)
    allowed_draft = int(masked[0].argmax())
    drafts = torch.tensor([[mode, int(masked[1].argmax())], [allowed_draft, 0]])
    inputs = torch.cat((torch.zeros(2, 1, dtype=torch.int64), drafts), dim=1)   # [2, 3]
    logits = p.log().repeat(n, 1)
    segs = Segments.build([3] * n, inputs.repeat(n // 2, 1).flatten())
    batch = SamplingBatch.build([SamplingParams(max_tokens=3, temperature=1.0)] * 3 * n,
                                [0, 1, 2] * n, [s for s in range(n) for _ in range(3)], "cpu",
                                vocab_size=V)
    out = verify(logits, segs, batch, None, None, _bits(masks, V).repeat(n, 1))
    tokens = out.tokens.view(n // 2, 2, 3)
    accepted = out.accepted.view(n // 2, 2)
    assert bool((accepted[:, 0] == 0).all()), "a draft the mask forbids was accepted"
    first = tokens[:, :, 0].flatten()
    assert bool((first != mode).all())
    want = (masked[0] * first.numel()).round().long().tolist()
    assert chi2_p([torch.bincount(first, minlength=V).tolist(), want]) > 1e-3
    second = tokens[accepted[:, 1] >= 1, 1, 1]
    assert second.numel() > 1000
    assert bool((second % 2 == 0).all())
    want = (masked[1] * second.numel()).round().long().tolist()
    assert chi2_p([torch.bincount(second, minlength=V).tolist(), want]) > 1e-3
