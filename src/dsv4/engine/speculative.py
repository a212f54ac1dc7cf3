"""Verification of speculative drafts: which drafted tokens a target pass accepts, and the token
that follows them (the building block of MTP speculative decoding, issue 19).

A step feeds the last accepted token plus N drafted tokens d_0..d_{N-1} to the target model, which
returns N+1 next-token distributions p_0..p_N (p_i predicts the token after position i). The
result per request is `accepted` (0..N) and `tokens` [N+1]: the accepted drafts, then one token
sampled by the target (a correction at the first rejection, or a bonus token when all N were
accepted), then -1 padding. So every step yields `accepted + 1` tokens.

* `greedy_verify`: temperature 0. Draft i is accepted while it equals the target's argmax; the
  output equals plain greedy decoding token for token.
* `speculative_sample`: the standard speculative rejection sampler (Leviathan et al. 2023; Chen
  et al. 2023). Draft i (drawn from q_i) is accepted with probability min(1, p_i(d_i) / q_i(d_i));
  at the first rejection the token is drawn from the residual max(0, p_i - q_i), renormalised;
  if all are accepted the bonus token is drawn from p_N. Every output token is then distributed
  exactly as the target's own sampler would draw it. `draft_probs=None` means a top-1 (greedy)
  drafter, q_i = one-hot(d_i): accept with probability p_i(d_i), residual = p_i without d_i.

The distributions passed in are the target's and drafter's *sampling* distributions (after
temperature, top-k / top-p / min-p and penalties, applied alike to both sides by the caller).
Randomness comes in as tensors (`uniforms` for the accept tests, `race` uniforms for the draws:
an exponential race argmax(r / -log u), as in `sampler.py`), so results are a pure function of
the inputs: no host sync, no global RNG.

Tests: `pytest tests/engine/test_speculative.py` (hand examples and chi-square checks of the
output distribution).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _leading_true(ok: Tensor) -> Tensor:
    """[B, N] bool -> [B] int64: the length of each row's leading run of True."""
    return ok.to(torch.int64).cumprod(dim=1).sum(dim=1)


def _assemble(draft: Tensor, accepted: Tensor, last: Tensor) -> Tensor:
    """tokens [B, N+1]: draft[:, :a], then `last` at column a, then -1."""
    B, N = draft.shape
    cols = torch.arange(N + 1, device=draft.device).expand(B, -1)
    padded = torch.cat((draft, torch.full_like(draft[:, :1], -1)), dim=1)
    out = torch.where(cols < accepted[:, None], padded, torch.full_like(padded, -1))
    return out.scatter(1, accepted[:, None], last[:, None])


def greedy_verify(draft: Tensor, target_argmax: Tensor) -> tuple[Tensor, Tensor]:
    """draft [B, N] int64, target_argmax [B, N+1] int64 -> (accepted [B], tokens [B, N+1])."""
    _check(draft, target_argmax.shape[:2])
    accepted = _leading_true(draft == target_argmax[:, :-1])
    last = target_argmax.gather(1, accepted[:, None])[:, 0]
    return accepted, _assemble(draft, accepted, last)


def speculative_sample(draft: Tensor, draft_probs: Tensor | None, target_probs: Tensor,
                       uniforms: Tensor, race: Tensor) -> tuple[Tensor, Tensor]:
    """draft [B, N] int64; draft_probs [B, N, V] (None: top-1 drafter); target_probs [B, N+1, V]
    (rows sum to 1, or are proportional to the distribution); uniforms [B, N] in (0, 1); race
    [B, V] uniforms in (0, 1) for the one token drawn -> (accepted [B], tokens [B, N+1])."""
    B, N = draft.shape
    _check(draft, target_probs.shape[:2])
    p = target_probs.float() / target_probs.float().sum(dim=-1, keepdim=True)
    p_draft = p[:, :N].gather(2, draft[..., None])[..., 0]                       # [B, N]
    if draft_probs is None:
        q = torch.zeros_like(p[:, :N]).scatter_(2, draft[..., None], 1.0)
    else:
        q = draft_probs.float() / draft_probs.float().sum(dim=-1, keepdim=True)
    q_draft = q.gather(2, draft[..., None])[..., 0]
    # accept d_i with probability min(1, p/q): u * q < p (q > 0 wherever d_i was drawn)
    accepted = _leading_true(uniforms.float() * q_draft < p_draft)
    # the distribution of the token at column `accepted`: residual, or p_N when all accepted
    q_pad = torch.cat((q, torch.zeros_like(p[:, :1])), dim=1)                    # [B, N+1, V]
    rows = torch.arange(B, device=draft.device)
    residual = (p[rows, accepted] - q_pad[rows, accepted]).clamp(min=0.0)      # [B, V]
    # p == q exactly leaves no residual mass: any token of p is then a valid draw
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p[rows, accepted], residual)
    last = (residual / -torch.log(race.float())).argmax(dim=-1)
    return accepted, _assemble(draft, accepted, last)


def _check(draft: Tensor, target_rows: tuple[int, ...] | torch.Size) -> None:
    if draft.dim() != 2 or tuple(target_rows) != (draft.shape[0], draft.shape[1] + 1):
        raise ValueError(f"draft must be [B, N] and the target [B, N+1, ...]; got draft "
                         f"{list(draft.shape)} and target rows {list(target_rows)}")
