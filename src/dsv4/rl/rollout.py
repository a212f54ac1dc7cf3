"""Rollouts from the serving engine, in process: token ids, sampling log-probs, recorded routing.

`generate_samples` drives an `LLMEngine` (no HTTP) over groups of prompts and returns one
`Sample` per completion with what the trainer needs:

* `tokens`: prompt + response ids (token in, token out: nothing is re-tokenised);
* `logprobs`: per response token, log pi_rollout = log_softmax(logits / temperature) at the
  sampled token, the distribution it was drawn from before top-k / top-p truncation
  (`SamplingParams.scaled_logprobs`; Miles' definition, rl-reference.md §4.3);
* `experts` [len(tokens) - 1, num_layers, k] and `indexer` [len(tokens) - 1, num_csa_layers,
  index_topk] int32: the engine's recorded selections for every token it fed (the last sampled
  token is never fed), -1 = none. The engine must run with `capture_routing=True` and no prefix
  cache (cached prompt tokens would have no recorded rows); `check_engine` enforces it.

Sampling is reproducible: request i of rollout `step` draws with seed hash(seed, step, i).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from dsv4.engine.engine import LLMEngine
from dsv4.engine.sampling_params import SamplingParams
from dsv4.rl.rewards import Prompt


@dataclass
class Sample:
    """One completion of one prompt (see the module docstring for the arrays); `prompt` is None
    for samples of raw token ids (`sample_token_ids`)."""

    prompt: Prompt | None
    group: int
    tokens: list[int]
    prompt_len: int
    logprobs: list[float]
    experts: torch.Tensor
    indexer: torch.Tensor | None
    text: str
    finish_reason: str | None
    reward: float = 0.0

    @property
    def response_len(self) -> int:
        return len(self.tokens) - self.prompt_len


def check_engine(engine: LLMEngine) -> None:
    """Raise ValueError unless the engine records complete routing for every fed token."""
    c = engine.config
    if not c.capture_routing:
        raise ValueError("the RL engine needs capture_routing=True (routing replay)")
    if not c.disable_prefix_cache:
        raise ValueError("the RL engine needs disable_prefix_cache=True: cached prompt tokens "
                         "have no recorded routing")


def sampling_params(temperature: float, max_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                          logprobs=0, scaled_logprobs=True)


def generate_samples(engine: LLMEngine, tokenizer: Tokenizer, prompts: list[Prompt],
                     group_size: int, temperature: float, max_tokens: int, seed: int,
                     first_group: int = 0) -> list[Sample]:
    """`group_size` samples of each prompt (groups numbered from `first_group`), run to
    completion together; returned grouped, in prompt order, with their decoded text."""
    samples = sample_token_ids(engine, prompt_token_ids(tokenizer, prompts), group_size,
                               temperature, max_tokens, seed, first_group)
    return label_samples(samples, tokenizer, prompts, first_group)


def prompt_token_ids(tokenizer: Tokenizer, prompts: list[Prompt]) -> list[list[int]]:
    return [list(tokenizer.encode(p.text).ids) for p in prompts]


def label_samples(samples: list[Sample], tokenizer: Tokenizer, prompts: list[Prompt],
                  first_group: int) -> list[Sample]:
    """`samples` (of groups numbered from `first_group`) with their prompt and decoded text."""
    for s in samples:
        s.prompt = prompts[s.group - first_group]
        s.text = tokenizer.decode(s.tokens[s.prompt_len:])
    return samples


def sample_seeds(prompt_ids: list[list[int]], group_size: int, seed: int,
                 first_group: int = 0) -> list[tuple[int, list[int], int]]:
    """(group, prompt ids, sampling seed) of every sample, in order: the seeds of rollout `seed`
    (one stream; the server-backed rollouts draw the same: rl/server_rollout.py)."""
    rng = random.Random(f"dsv4-rl-sample-{seed}")
    return [(g + first_group, ids, rng.randrange(2**62)) for g, ids in enumerate(prompt_ids)
            for _ in range(group_size)]


def sample_token_ids(engine: LLMEngine, prompt_ids: list[list[int]], group_size: int,
                     temperature: float, max_tokens: int, seed: int,
                     first_group: int = 0) -> list[Sample]:
    """`generate_samples` on token ids (no tokenizer, no task: `prompt` None, `text` "")."""
    check_engine(engine)
    requests = [(group, engine.add_request(ids, sampling_params(temperature, max_tokens, s)))
                for group, ids, s in sample_seeds(prompt_ids, group_size, seed, first_group)]
    while engine.has_unfinished():
        engine.step()
    samples = []
    for group, req in requests:
        done = engine.pop(req.rid)
        routing = {k: torch.cat(v) for k, v in done.routing.items()}
        tokens = done.prompt_ids + done.output_ids
        experts = routing["experts"].to(torch.int32)
        assert experts.shape[0] == len(tokens) - 1, "routing rows != fed tokens"
        indexer = routing.get("indexer")
        samples.append(Sample(None, group, tokens, len(done.prompt_ids), list(done.logprobs),
                              experts, None if indexer is None else indexer.to(torch.int32),
                              "", done.finish_reason))
    return samples


def greedy_answers(engine: LLMEngine, tokenizer: Tokenizer, prompts: list[Prompt],
                   max_tokens: int) -> list[str]:
    """Greedy completions of `prompts` (held-out evaluation), in order."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    reqs = [engine.add_request(list(tokenizer.encode(p.text).ids), params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [tokenizer.decode(engine.pop(r.rid).output_ids) for r in reqs]
