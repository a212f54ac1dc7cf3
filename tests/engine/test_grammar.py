"""Structured output in the engine (`engine/grammar.py`, `sampler.apply_token_bitmask`): dsv4-tiny
on CPU follows JSON schemas, JSON objects, regexes, choices and EBNF grammars, greedy and sampled;
bad specs are refused at the edge; a constrained row does not change its neighbours."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer

from dsv4 import LLM, EngineConfig, SamplingParams
from dsv4.assets import default_model_path
from dsv4.engine.engine import LLMEngine
from dsv4.engine.grammar import (
    advance_grammar,
    apply_token_bitmask,
    encoded_vocab,
    token_bitmask,
)
from dsv4.engine.sampling_params import StructuredOutput
from dsv4.server.ipc import AddRequest, decode, encode

SCHEMAS = [
    {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0,
                                                 "maximum": 999}}, "required": ["answer"]},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "ok": {"type": "boolean"}}, "required": ["name", "ok"]},
    {"type": "object", "properties": {"xs": {"type": "array", "maxItems": 3, "items": {
        "type": "integer", "minimum": 0, "maximum": 9}}}, "required": ["xs"]},
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(default_model_path(), device="cpu")


def _params(kind: str, spec: str = "", temperature: float = 0.0) -> SamplingParams:
    return SamplingParams(max_tokens=48, temperature=temperature, seed=1,
                          structured=StructuredOutput(kind, spec))


def test_bitmask_masks_exactly_the_disallowed_tokens() -> None:
    """Bit v % 32 of word v // 32 (sign bit included), a vocabulary that is no multiple of 32."""
    logits = torch.zeros(2, 70)
    bits = torch.zeros(2, 3, dtype=torch.int32)
    bits[0, 0] = 1 << 5
    bits[0, 1] = -(1 << 31)                      # bit 31 of word 1: token 63
    bits[1] = -1                                 # everything
    out = apply_token_bitmask(logits, bits)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [5, 63]
    assert torch.isfinite(out[1]).all()
    assert token_bitmask([None, None], 70) is None


def test_encoded_vocab_is_the_tokenizers_vocabulary() -> None:
    path = default_model_path() / "tokenizer.json"
    vocab, kind = encoded_vocab(path)
    tok = Tokenizer.from_file(str(path))
    assert kind == "BYTE_LEVEL" and len(vocab) == tok.get_vocab_size()
    assert all(vocab[i] == tok.id_to_token(i) for i in range(len(vocab)))


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_outputs_follow_their_grammar(llm: LLM, temperature: float) -> None:
    prompts = ["What is 12+7?", "What is 3*4?"]
    for schema in SCHEMAS:
        for out in llm.generate(prompts, _params("json_schema", json.dumps(schema), temperature),
                                use_tqdm=False):
            jsonschema.validate(json.loads(out.text), schema)
            assert out.finish_reason == "stop", out.text
    for out in llm.generate(prompts, _params("json_object", "", temperature), use_tqdm=False):
        assert isinstance(json.loads(out.text), dict)
    for out in llm.generate(prompts, _params("regex", r"[0-9]{1,3} apples", temperature),
                            use_tqdm=False):
        assert re.fullmatch(r"[0-9]{1,3} apples", out.text), out.text
    choices = ["yes", "no", "maybe"]
    for out in llm.generate(prompts, _params("choice", json.dumps(choices), temperature),
                            use_tqdm=False):
        assert out.text in choices
    ebnf = 'root ::= "(" [0-9] [0-9]? ("+" [0-9])? ")"'
    for out in llm.generate(prompts, _params("ebnf", ebnf, temperature), use_tqdm=False):
        assert re.fullmatch(r"\([0-9][0-9]?(\+[0-9])?\)", out.text), out.text


def test_a_constrained_row_leaves_its_neighbours_alone(llm: LLM) -> None:
    free = SamplingParams(max_tokens=8, temperature=0.0)
    alone = llm.generate(["What is 5+5?"], free, use_tqdm=False)[0].token_ids
    engine = llm.engine
    a = engine.add_request(llm.encode("What is 5+5?"), free)
    engine.add_request(llm.encode("What is 1+2?"),
                       _params("json_schema", json.dumps(SCHEMAS[0])))
    while engine.has_unfinished():
        engine.step()
    assert a.output_ids == alone


def test_compiling_requests_wait_outside_the_scheduler(llm: LLM,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A grammar compiles on the worker thread: its request stays out of the scheduler (the
    others keep decoding) until the grammar is ready, and can be aborted meanwhile."""
    engine, gate = llm.engine, threading.Event()
    assert engine.grammars is not None
    compile_ = engine.grammars._compile
    monkeypatch.setattr(engine.grammars, "_compile",
                        lambda *a: compile_(*a) if gate.wait(30) else None)
    free = engine.add_request(llm.encode("What is 5+5?"), SamplingParams(max_tokens=4,
                                                                         temperature=0.0))
    slow = engine.add_request(llm.encode("What is 1+2?"), _params("regex", "[0-9]{2} pears"))
    dropped = engine.add_request(llm.encode("What is 2+2?"), _params("regex", "[a-z]{3} cats"))
    assert slow not in engine.scheduler.waiting and engine.has_unfinished()
    engine.abort(dropped.rid)
    assert dropped.is_finished and dropped.finish_reason == "abort"
    for _ in range(8):
        engine.step()
    assert free.is_finished and not slow.output_ids
    gate.set()
    while engine.has_unfinished():
        engine.step()
    assert llm.tokenizer is not None
    assert re.fullmatch(r"[0-9]{2} pears", llm.tokenizer.decode(slow.output_ids))
    for req in (free, slow, dropped):
        engine.pop(req.rid)


@pytest.mark.parametrize(("kind", "spec", "message"), [
    ("regex", "(", "structured.spec does not compile as regex"),
    ("json_schema", '{"type": 5}', "structured.spec does not compile as json_schema"),
    ("ebnf", "root ::= ", "structured.spec does not compile as ebnf"),
    ("choice", "[]", "structured.spec does not compile as choice"),
])
def test_bad_specs_are_refused_when_added(llm: LLM, kind: str, spec: str, message: str) -> None:
    before = dict(llm.engine.requests)
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request([5, 6], _params(kind, spec))
    assert llm.engine.requests == before


def test_structured_output_fields_are_validated() -> None:
    with pytest.raises(ValueError, match=r"^structured.kind='xml' is invalid"):
        StructuredOutput("xml", "<a/>")
    with pytest.raises(ValueError, match=r"^structured.spec="):
        StructuredOutput("json_object", "{}")
    with pytest.raises(ValueError, match=r"^structured.spec="):
        StructuredOutput("regex", "")


def test_an_engine_without_a_tokenizer_refuses_structured_requests(llm: LLM) -> None:
    engine = LLMEngine(llm.model, EngineConfig(page_size=128, max_total_tokens=1024))
    with pytest.raises(ValueError, match="structured output needs an engine with a tokenizer"):
        engine.add_request([5, 6], _params("regex", "a+"))


def test_structured_params_cross_the_engine_process_boundary() -> None:
    params = _params("json_schema", json.dumps(SCHEMAS[1]))
    msg = AddRequest(rid="r", prompt_ids=[1, 2], params=params, routing=[])
    assert decode(encode(msg)) == msg


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_structured_output_under_cuda_graphs_cuda() -> None:
    """bf16 on the GPU with the defaults (triton kernels, CUDA graphs): the mask is applied to the
    graphed forward's logits, batched with unconstrained rows."""
    llm = LLM(default_model_path(), device="cuda", dtype="bfloat16")
    assert llm.engine.runner.graphs is not None
    prompts = [f"What is {i}+{2 * i}?" for i in range(8)]
    free = SamplingParams(max_tokens=8, temperature=0.0)
    for temperature in (0.0, 1.0):
        for schema in SCHEMAS:
            params = [_params("json_schema", json.dumps(schema), temperature), free] * 4
            outs = llm.generate(prompts, params, use_tqdm=False)
            for out in outs[0::2]:
                jsonschema.validate(json.loads(out.text), schema)


class _Matcher:
    """A matcher that accepts the tokens in `ok` and is complete after `done` of them."""

    def __init__(self, ok: set[int], done: int) -> None:
        self.ok, self.done, self.fed = ok, done, 0

    def accept_token(self, tok: int) -> bool:
        self.fed += tok in self.ok
        return tok in self.ok

    def is_terminated(self) -> bool:
        return self.fed >= self.done


def test_advance_grammar_stops_when_complete_or_on_a_rejected_token(
        caplog: pytest.LogCaptureFixture) -> None:
    """None while the grammar runs; "stop" once it is complete; a token it rejects (a bug: the
    mask allows only accepted ones) ends the request with "stop", logged as an error."""
    m = _Matcher({1, 2}, done=2)
    assert advance_grammar(m, 1, "r") is None
    assert advance_grammar(m, 2, "r") == "stop"
    assert advance_grammar(_Matcher({1}, done=9), 7, "r7") == "stop"
    assert "request r7: its grammar rejected token 7" in caplog.text
