"""TrainBatch: rollout samples packed for one trainer forward, and the rewards -> advantages step.

Layout (B samples, L = longest sample): `inputs` [B, L-1] are tokens[:-1] right-padded with 0,
`targets` [B, L-1] tokens[1:]; `mask` [B, L-1] is 1 where the target is a response token (target
index t >= prompt_len - 1). `rollout_logp` [B, L-1] holds the engine's log-prob at those
positions (0 elsewhere). `replay` carries the recorded selections padded with -1 rows, aligned so
that row t is the routing of input token t (the engine fed exactly tokens[:-1]). The same layout
is what a multi-process trainer would receive over the wire: tensors only, no Python objects.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from dsv4.model.forward_mode import Replay
from dsv4.rl.algorithms import grpo_advantages, nonzero_spread, overlong_penalty
from dsv4.rl.rollout import Sample


@dataclass
class TrainBatch:
    inputs: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    rollout_logp: torch.Tensor
    advantages: torch.Tensor
    replay: Replay | None

    def to(self, device: torch.device) -> TrainBatch:
        replay = None if self.replay is None else Replay(
            experts=None if self.replay.experts is None else self.replay.experts.to(device),
            indexer=None if self.replay.indexer is None else self.replay.indexer.to(device))
        return TrainBatch(self.inputs.to(device), self.targets.to(device), self.mask.to(device),
                          self.rollout_logp.to(device), self.advantages.to(device), replay)


def group_rewards(samples: list[Sample]) -> dict[int, list[Sample]]:
    groups: dict[int, list[Sample]] = defaultdict(list)
    for s in samples:
        groups[s.group].append(s)
    return dict(groups)


def shape_overlong(samples: list[Sample], max_tokens: int, buffer: int) -> None:
    """DAPO overlong shaping: add the length penalty to each sample's reward (in place)."""
    lengths = torch.tensor([s.response_len for s in samples])
    for s, p in zip(samples, overlong_penalty(lengths, max_tokens, buffer).tolist(), strict=True):
        s.reward += p


def keep_informative(groups: dict[int, list[Sample]]) -> dict[int, list[Sample]]:
    """DAPO dynamic sampling: the groups whose rewards are not all equal."""
    if not groups:
        return {}
    rewards = torch.tensor([[s.reward for s in g] for g in groups.values()])
    keep = nonzero_spread(rewards).tolist()
    return {k: g for (k, g), ok in zip(groups.items(), keep, strict=True) if ok}


def advantages_of(groups: dict[int, list[Sample]]) -> torch.Tensor:
    """GRPO advantages, one per sample, in the order of `pack`'s samples."""
    rewards = torch.tensor([[s.reward for s in g] for g in groups.values()])
    return grpo_advantages(rewards).flatten()


def pack(samples: list[Sample], advantages: torch.Tensor, routing: bool,
         indexer: bool) -> TrainBatch:
    """Samples -> a right-padded TrainBatch (see the module docstring)."""
    B, L = len(samples), max(len(s.tokens) for s in samples)
    inputs = torch.zeros(B, L - 1, dtype=torch.long)
    targets = torch.zeros(B, L - 1, dtype=torch.long)
    mask = torch.zeros(B, L - 1)
    rollout = torch.zeros(B, L - 1)
    first = samples[0]
    experts = torch.full((B, L - 1, *first.experts.shape[1:]), -1, dtype=torch.int32)
    picks = (torch.full((B, L - 1, *first.indexer.shape[1:]), -1, dtype=torch.int32)
             if indexer and first.indexer is not None else None)
    for b, s in enumerate(samples):
        n = len(s.tokens) - 1
        ids = torch.tensor(s.tokens)
        inputs[b, :n], targets[b, :n] = ids[:-1], ids[1:]
        start = s.prompt_len - 1
        mask[b, start:n] = 1.0
        rollout[b, start:n] = torch.tensor(s.logprobs, dtype=torch.float32)
        experts[b, :n] = s.experts
        if picks is not None and s.indexer is not None:
            picks[b, :n] = s.indexer
    replay = Replay(experts=experts, indexer=picks) if routing else None
    return TrainBatch(inputs, targets, mask, rollout, advantages.float(), replay)
