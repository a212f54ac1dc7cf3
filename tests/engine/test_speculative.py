"""Speculative verification (`engine/speculative.py`): greedy acceptance on hand examples, and the
rejection sampler's output distribution against the target's (chi-square, p = 0.001)."""

from __future__ import annotations

import pytest
import torch

from dsv4.engine.speculative import greedy_verify, speculative_sample

CHI2_DF4_P001 = 18.467
V, ROWS = 5, 40_000


def test_greedy_verify_hand_examples() -> None:
    draft = torch.tensor([[5, 7, 9], [2, 7, 9], [5, 7, 9]])
    target = torch.tensor([[5, 7, 1, 4], [3, 7, 9, 4], [5, 7, 9, 4]])
    accepted, tokens = greedy_verify(draft, target)
    assert accepted.tolist() == [2, 0, 3]
    assert tokens.tolist() == [[5, 7, 1, -1], [3, -1, -1, -1], [5, 7, 9, 4]]


def test_shapes_are_checked() -> None:
    with pytest.raises(ValueError, match="draft must be"):
        greedy_verify(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))


def _chi2(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=V).double()
    expected = probs.double() * tokens.numel()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("drafter", ["sampled", "top1"])
def test_rejection_sampler_reproduces_the_target_distribution(drafter: str) -> None:
    """Token 0 is distributed as p_0; given draft 0 accepted, token 1 as p_1 (N = 2)."""
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, V, generator=gen) * 1.5, dim=-1)            # p_0, p_1, p_2
    q = torch.softmax(torch.randn(2, V, generator=gen) * 1.5, dim=-1)            # q_0, q_1
    if drafter == "sampled":
        draft = torch.stack([torch.multinomial(q[i], ROWS, replacement=True, generator=gen)
                             for i in range(2)], dim=1)
        draft_probs = q.expand(ROWS, -1, -1)
    else:                       # a greedy drafter that guesses the target's mode: a point mass
        draft = p[:2].argmax(dim=-1).expand(ROWS, -1).clone()
        draft_probs = None
    uniforms = torch.rand(ROWS, 2, generator=gen).clamp(1e-7, 1 - 1e-7)
    race = torch.rand(ROWS, V, generator=gen).clamp(1e-7, 1 - 1e-7)
    accepted, tokens = speculative_sample(draft, draft_probs, p.expand(ROWS, -1, -1), uniforms,
                                          race)
    assert _chi2(tokens[:, 0], p[0]) < CHI2_DF4_P001
    second = tokens[accepted >= 1, 1]
    assert second.numel() > 1000 and _chi2(second, p[1]) < CHI2_DF4_P001
    # every row: accepted drafts, then one drawn token, then padding
    cols = torch.arange(3).expand(ROWS, -1)
    assert bool((tokens[cols < accepted[:, None]] == draft[cols[:, :2] < accepted[:, None]])
                .all())
    assert bool((tokens[cols > accepted[:, None]] == -1).all())


def test_identical_draft_and_target_accept_everything() -> None:
    gen = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(1, 3, V, generator=gen), dim=-1).expand(64, -1, -1)
    draft = torch.multinomial(p[0, 0], 128, replacement=True, generator=gen).view(64, 2)
    accepted, tokens = speculative_sample(draft, p[:, :2], p, torch.rand(64, 2, generator=gen),
                                          torch.rand(64, V, generator=gen))
    assert accepted.tolist() == [2] * 64 and bool((tokens[:, :2] == draft).all())
