"""RL math: GRPO advantages, DAPO pieces, the clipped policy loss, TIS / MIS weights, metrics.

Pure tensor functions with no host synchronisation: every result (stats included) is a tensor on
the inputs' device, computed in fp32. Definitions follow Miles (rl-reference.md §2.3, §2.4, §4.3).

Conventions shared by every function:

* Token tensors are `[B, T]` (B samples, T response positions): `logp` the current policy's
  log-probs of the sampled tokens, `old_logp` the trainer's rescoring before the update,
  `rollout_logp` the engine's. `mask` is bool or 0/1 float, nonzero marks a response token.
* Masked tokens never reach a result: differentiable inputs are selected with `torch.where`
  before any nonlinearity and reductions select again, so NaN / inf on padding cannot leak into
  a loss or a gradient.
* Empty denominators are `max(count, 1)`: a mean over no tokens is 0, never NaN.
* Every mean over samples or tokens takes its denominator from `denom` (`Denominators`) when
  given, else from its own inputs. A data-parallel rank holding a slice of the batch passes the
  GLOBAL counts: its result is then its share of the global value (the shares of all ranks sum
  to the single-process result), and so is its loss's gradient (`rl/fsdp.py`).
* Importance weights and statistics are detached; only losses carry gradients.

Test: `pytest tests/rl/test_algorithms.py`; the `denom` shares: `tests/rl/test_fsdp.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Aggregation = Literal["token", "sample"]
AGGREGATIONS: tuple[str, ...] = ("token", "sample")


@dataclass(frozen=True)
class Denominators:
    """The counts that turn sums into means: `samples` (B: the "sample" aggregation, the drift
    metric) and `tokens` (valid tokens: the "token" aggregation and every token mean), 0-dim
    integer tensors. `of(mask)` gives a batch's own counts; data-parallel ranks all-reduce them."""

    samples: Tensor
    tokens: Tensor

    @classmethod
    def of(cls, mask: Tensor) -> Denominators:
        return cls(torch.tensor(mask.shape[0], device=mask.device), _keep(mask).sum())


def _check_same_shape(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"shapes must match, got {shapes}")


def _keep(mask: Tensor) -> Tensor:
    """The mask as bool: nonzero = valid token."""
    return mask if mask.dtype == torch.bool else mask != 0


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None,
                count: Tensor | None = None) -> Tensor:
    """sum(m * x) / max(sum(m), 1) over all elements (dim=None, 0-dim result) or along `dim`.

    `mask` has x's shape; masked entries of x are ignored even when NaN or inf; an all-masked
    slice gives 0. `count` (dim=None only) replaces sum(m) in the denominator.
    """
    _check_same_shape(x=x, mask=mask)
    keep = _keep(mask)
    total = torch.where(keep, x.float(), 0.0)
    if dim is None:
        return total.sum() / (keep.sum() if count is None else count).clamp(min=1)
    if count is not None:
        raise ValueError("count replaces the denominator of a full mean only (dim=None)")
    return total.sum(dim) / keep.sum(dim).clamp(min=1)


def _tokens(denom: Denominators | None) -> Tensor | None:
    return None if denom is None else denom.tokens


def _sample_mean(per_sample: Tensor, denom: Denominators | None) -> Tensor:
    """(1/B) sum_b x_b with B = the batch's own size, or `denom.samples`."""
    if denom is None:
        return per_sample.mean()
    return per_sample.sum() / denom.samples.clamp(min=1)


def grpo_advantages(rewards: Tensor, std_normalize: bool = True, eps: float = 1e-6) -> Tensor:
    """Group-relative advantages `[P, G]` for rewards `[P, G]` (P prompts, G samples each):

        A_pg = (R_pg - mean_g R_p) / (std_g R_p + eps)     (GRPO, Miles' default)
        A_pg =  R_pg - mean_g R_p                          (std_normalize=False: Dr.GRPO)

    std is torch's default unbiased estimator (divides by G - 1), as in Miles, so GRPO needs
    G >= 2. A group whose rewards are all equal gets zero advantages.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [P, G], got shape {tuple(rewards.shape)}")
    if std_normalize and rewards.shape[1] < 2:
        raise ValueError(f"group size G={rewards.shape[1]} must be >= 2 with std_normalize")
    r = rewards.float()
    centred = r - r.mean(dim=1, keepdim=True)
    if not std_normalize:
        return centred
    return centred / (r.std(dim=1, keepdim=True) + eps)


def nonzero_spread(rewards: Tensor, tol: float = 1e-8) -> Tensor:
    """DAPO dynamic-sampling keep mask `[P]` bool: a group is kept iff std_g R_p > tol (unbiased
    std, Miles' `check_reward_nonzero_std`), i.e. not all of its samples scored the same. A group
    of one sample has no spread and is never kept."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [P, G], got shape {tuple(rewards.shape)}")
    if rewards.shape[1] < 2:
        return torch.zeros(rewards.shape[0], dtype=torch.bool, device=rewards.device)
    return rewards.float().std(dim=1) > tol


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int) -> Tensor:
    """DAPO overlong reward shaping `[N]` fp32 for response lengths `[N]`:

        0                                 L <= max_len - buffer
        ((max_len - buffer) - L) / buffer  max_len - buffer < L <= max_len
        -1                                L > max_len

    The middle piece runs linearly from 0 to -1, so the shaping is continuous.
    """
    if not 0 < buffer <= max_len:
        raise ValueError(f"buffer={buffer} must be in (0, max_len={max_len}]")
    start = float(max_len - buffer)
    return ((start - lengths.float()) / buffer).clamp(min=-1.0, max=0.0)


def policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                eps_low: float = 0.2, eps_high: float = 0.28,
                aggregation: Aggregation = "token", weights: Tensor | None = None,
                denom: Denominators | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with clip-higher (DAPO), per token, then aggregated:

        rho_t = exp(logp_t - old_logp_t)
        l_t   = w_t * max(-rho_t A_t, -clip(rho_t, 1 - eps_low, 1 + eps_high) A_t)

    `advantages` is `[B]` (broadcast over tokens) or `[B, T]`; `weights` (TIS / MIS, `[B, T]`) are
    1 when None. Only `logp` gets gradients: old_logp, advantages and weights are detached.

    aggregation "token" (DAPO): sum_bt m l / max(sum_bt m, 1).
    aggregation "sample" (Miles' default): (1/B) sum_b [sum_t m l / max(sum_t m, 1)]; a sample
    without tokens adds 0 and still counts in B. `denom` replaces B and sum_bt m (see the module
    docstring: a rank's share of the global loss).

    Returns (loss 0-dim, stats): `clip_frac`, the fraction of masked tokens where the clipped
    branch is the larger (active) one; `ratio_mean`, the masked mean of rho.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r} is unknown; allowed: {list(AGGREGATIONS)}")
    if not 0.0 <= eps_low < 1.0 or eps_high < 0.0:
        raise ValueError(f"eps_low={eps_low} must be in [0, 1) and eps_high={eps_high} >= 0")
    _check_same_shape(logp=logp, old_logp=old_logp, mask=mask)
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    adv = advantages.detach().float()
    if adv.shape == logp.shape[:1]:
        adv = adv[:, None]
    elif adv.shape != logp.shape:
        raise ValueError(f"advantages must be [B] or [B, T] = {tuple(logp.shape)}, "
                         f"got {tuple(advantages.shape)}")
    # NOTE: masked positions are zeroed before exp, so garbage there (NaN / inf logprobs on
    # padding) yields neither a NaN loss nor a NaN gradient into logp.
    keep = _keep(mask)
    ratio = torch.exp(torch.where(keep, logp.float() - old_logp.detach().float(), 0.0))
    unclipped = -ratio * adv
    clipped = -ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    loss_t = torch.maximum(unclipped, clipped)
    if weights is not None:
        _check_same_shape(logp=logp, weights=weights)
        loss_t = loss_t * weights.detach().float()
    count = _tokens(denom)
    if aggregation == "token":
        loss = masked_mean(loss_t, mask, count=count)
    else:
        loss = _sample_mean(masked_mean(loss_t, mask, dim=1), denom)
    stats = {"clip_frac": masked_mean((clipped > unclipped).detach(), mask, count=count),
             "ratio_mean": masked_mean(ratio.detach(), mask, count=count)}
    return loss, stats


def _rollout_ratio(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> Tensor:
    _check_same_shape(old_logp=old_logp, rollout_logp=rollout_logp, mask=mask)
    return torch.exp(old_logp.detach().float() - rollout_logp.detach().float())


def tis_weights(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, clip: float,
                denom: Denominators | None = None) -> tuple[Tensor, Tensor]:
    """Truncated importance sampling (Miles `vanilla_tis`, lower clip 0):

        w_t = min(exp(old_logp_t - rollout_logp_t), clip)

    Returns (w `[B, T]` fp32 detached, clip_frac 0-dim: the fraction of masked tokens whose raw
    ratio exceeds `clip`).
    """
    if clip <= 0:
        raise ValueError(f"clip={clip} must be > 0")
    ratio = _rollout_ratio(old_logp, rollout_logp, mask)
    return ratio.clamp(max=clip), masked_mean(ratio > clip, mask, count=_tokens(denom))


def mis_weights(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, lo: float, hi: float,
                denom: Denominators | None = None) -> tuple[Tensor, Tensor]:
    """Masked importance sampling: drop tokens whose ratio leaves [lo, hi].

        rho_t = exp(old_logp_t - rollout_logp_t),  w_t = 1[lo <= rho_t <= hi]

    NOTE: the weight is the 0/1 keep mask, not Miles' `mask` mode `rho_t * 1[...]`: tokens inside
    the band train unweighted, tokens outside are removed from the numerator (the loss's
    denominator still counts them, as in Miles). Multiply by `tis_weights` to get Miles' form.

    Returns (w `[B, T]` fp32 0/1, masked_frac 0-dim: the fraction of masked tokens dropped).
    """
    if not 0 < lo < hi:
        raise ValueError(f"lo={lo} and hi={hi} must satisfy 0 < lo < hi")
    ratio = _rollout_ratio(old_logp, rollout_logp, mask)
    keep = (ratio >= lo) & (ratio <= hi)
    return keep.float(), masked_mean(~keep, mask, count=_tokens(denom))


def k3_kl(logp: Tensor, ref_logp: Tensor, mask: Tensor,
          denom: Denominators | None = None) -> Tensor:
    """Schulman's k3 estimator of KL(pi || ref) at the sampled tokens, masked token mean:

        d_t = ref_logp_t - logp_t,   k3 = mean_t [exp(d_t) - d_t - 1]   (>= 0 per token)

    Differentiable in `logp` (a KL loss term); `ref_logp` is detached.
    """
    _check_same_shape(logp=logp, ref_logp=ref_logp, mask=mask)
    d = torch.where(_keep(mask), ref_logp.detach().float() - logp.float(), 0.0)
    return masked_mean(torch.exp(d) - d - 1.0, mask, count=_tokens(denom))


def drift_tokens(train_logp: Tensor, rollout_logp: Tensor, mask: Tensor
                 ) -> tuple[Tensor, Tensor]:
    """Where the train / rollout drift sits: (how many valid tokens have |a - b| > 0, the index
    of the largest one within its sample's response: 0 = the first valid token of its row, -1
    when no token differs), both 0-dim int64 and detached. In true on-policy mode both are
    diagnostics of a non-zero step (is it the first sampled token, a late one, one token or
    many)."""
    _check_same_shape(train_logp=train_logp, rollout_logp=rollout_logp, mask=mask)
    keep = _keep(mask)
    diff = torch.where(keep, (train_logp.detach().float() - rollout_logp.detach().float()).abs(),
                       0.0)
    count = (diff > 0).sum()
    if diff.dim() != 2 or diff.numel() == 0:
        return count, torch.full_like(count, -1)
    worst = diff.argmax()
    row, col = worst // diff.shape[1], worst % diff.shape[1]
    first = keep.int().argmax(dim=-1)[row]
    return count, torch.where(count > 0, col - first, -1)


def entropy(logits: Tensor) -> Tensor:
    """Entropy `[...]` fp32 of softmax(logits `[..., V]`): H = -sum_v p_v log p_v.

    Computed from log_softmax in fp32; -inf logits (banned tokens) contribute 0, not NaN.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    p_logp = torch.where(logp > float("-inf"), logp.exp() * logp, 0.0)
    return -p_logp.sum(dim=-1)


def logprob_abs_diff(train_logp: Tensor, rollout_logp: Tensor, mask: Tensor,
                     denom: Denominators | None = None) -> tuple[Tensor, Tensor]:
    """Train / rollout log-prob drift, Miles' `train_rollout_logprob_abs_diff` (§4.3):

        d_i    = sum_t m_it |a_it - b_it| / max(sum_t m_it, 1)      per sample
        metric = (1/B) sum_i d_i

    Returns (metric, max_t |a - b| over masked tokens, 0 when there is none), both 0-dim and
    detached.
    """
    _check_same_shape(train_logp=train_logp, rollout_logp=rollout_logp, mask=mask)
    diff = (train_logp.detach().float() - rollout_logp.detach().float()).abs()
    metric = _sample_mean(masked_mean(diff, mask, dim=-1), denom)
    worst = torch.where(_keep(mask), diff, 0.0).amax() if diff.numel() else diff.new_zeros(())
    return metric, worst
