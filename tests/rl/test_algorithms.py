"""Tests for dsv4.rl.algorithms: every function against a small hand-computed example."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch
from torch import Tensor

from dsv4.rl.algorithms import (
    Aggregation,
    drift_tokens,
    entropy,
    grpo_advantages,
    k3_kl,
    logprob_abs_diff,
    masked_mean,
    mis_weights,
    nonzero_spread,
    overlong_penalty,
    policy_loss,
    tis_weights,
)

INF = float("inf")
NAN = float("nan")


def _t(rows: Sequence[Sequence[float]]) -> Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def _close(actual: Tensor, expected: object) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32),
                               rtol=1e-5, atol=1e-6)


# --- advantages and dynamic sampling ---------------------------------------------------------

def test_grpo_advantages_hand_computed() -> None:
    # group [1, 0, 0, 1]: mean 0.5, unbiased var (4 * 0.25) / 3 = 1/3, std 0.5773503
    #   A = +-0.5 / (0.5773503 + 1e-6) = +-0.8660239
    # group [2, 0, 1, 1]: mean 1, unbiased var (1 + 1) / 3 = 2/3, std 0.8164966
    #   A = +-1 / (0.8164966 + 1e-6) = +-1.2247434, 0, 0
    # group [3, 3, 3, 3]: all equal -> zeros
    adv = grpo_advantages(_t([[1, 0, 0, 1], [2, 0, 1, 1], [3, 3, 3, 3]]))
    a, b = 0.8660239, 1.2247434
    _close(adv, [[a, -a, -a, a], [b, -b, 0, 0], [0, 0, 0, 0]])
    assert adv.dtype == torch.float32


def test_grpo_advantages_dr_grpo_is_mean_centred_only() -> None:
    adv = grpo_advantages(torch.tensor([[1, 0, 0, 1], [2, 0, 1, 1]]), std_normalize=False)
    _close(adv, [[0.5, -0.5, -0.5, 0.5], [1, -1, 0, 0]])


def test_grpo_advantages_validates_shape_and_group_size() -> None:
    with pytest.raises(ValueError, match="rewards must be"):
        grpo_advantages(torch.ones(4))
    with pytest.raises(ValueError, match="group size G=1"):
        grpo_advantages(torch.ones(3, 1))
    _close(grpo_advantages(_t([[2], [5]]), std_normalize=False), [[0], [0]])


def test_nonzero_spread_keeps_only_mixed_groups() -> None:
    keep = nonzero_spread(_t([[1, 0, 0, 1], [1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 1]]))
    assert keep.dtype == torch.bool and keep.tolist() == [True, False, False, True]
    assert nonzero_spread(_t([[1], [0]])).tolist() == [False, False]
    # std of [0, 1e-9] is 7.1e-10: below the default tol, above tol=0
    assert nonzero_spread(_t([[0, 1e-9]])).tolist() == [False]
    assert nonzero_spread(_t([[0, 1e-9]]), tol=0.0).tolist() == [True]


# --- overlong shaping --------------------------------------------------------------------------

def test_overlong_penalty_hand_computed() -> None:
    # max_len 10, buffer 4: free up to 6, then (6 - L) / 4, -1 beyond 10
    lengths = torch.tensor([0, 6, 7, 8, 10, 11, 100])
    pen = overlong_penalty(lengths, max_len=10, buffer=4)
    _close(pen, [0, 0, -0.25, -0.5, -1, -1, -1])
    _close(overlong_penalty(torch.tensor([5]), max_len=10, buffer=10), [-0.5])


@pytest.mark.parametrize("buffer", [0, -1, 11])
def test_overlong_penalty_validates_buffer(buffer: int) -> None:
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(torch.tensor([1]), max_len=10, buffer=buffer)


# --- policy loss -------------------------------------------------------------------------------

# ratios rho (old_logp = 0, logp = log rho), clip range [0.8, 1.28], mask drops the last token
# of sample 1:
#   sample 0, A = +1: rho 1.25 -> max(-1.25, -1.25) = -1.25  (in range, not clipped)
#                     rho 1.3  -> max(-1.3,  -1.28) = -1.28  (clipped branch active)
#                     rho 0.7  -> max(-0.7,  -0.8)  = -0.7   (unclipped)
#   sample 1, A = -1: rho 0.7  -> max( 0.7,   0.8)  =  0.8   (clipped branch active)
#                     rho 1.0  -> max( 1.0,   1.0)  =  1.0
#                     rho 5.0  -> masked
# token mean:  (-1.25 - 1.28 - 0.7 + 0.8 + 1.0) / 5 = -1.43 / 5 = -0.286
# sample mean: ((-3.23 / 3) + (1.8 / 2)) / 2 = (-1.0766667 + 0.9) / 2 = -0.0883333
# clip_frac 2 / 5 = 0.4; ratio_mean (1.25 + 1.3 + 0.7 + 0.7 + 1.0) / 5 = 0.99
RATIOS = [[1.25, 1.3, 0.7], [0.7, 1.0, 5.0]]
MASK = [[1, 1, 1], [1, 1, 0]]
ADV = [1.0, -1.0]


def _loss_inputs() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    logp = _t(RATIOS).log().requires_grad_()
    return logp, torch.zeros(2, 3), torch.tensor(ADV), _t(MASK)


@pytest.mark.parametrize("aggregation, expected", [("token", -0.286), ("sample", -0.0883333)])
def test_policy_loss_hand_computed(aggregation: Aggregation, expected: float) -> None:
    logp, old, adv, mask = _loss_inputs()
    loss, stats = policy_loss(logp, old, adv, mask, aggregation=aggregation)
    _close(loss, expected)
    _close(stats["clip_frac"], 0.4)
    _close(stats["ratio_mean"], 0.99)
    assert all(v.dim() == 0 and not v.requires_grad for v in stats.values())


def test_policy_loss_gradient_hand_computed() -> None:
    # d loss / d logp_t = -rho_t A_t / 5 where the unclipped branch is active, else 0
    logp, old, adv, mask = _loss_inputs()
    loss, _ = policy_loss(logp, old, adv, mask.bool())
    loss.backward()
    assert logp.grad is not None
    _close(logp.grad, [[-0.25, 0, -0.14], [0, 0.2, 0]])


def test_policy_loss_token_advantages_match_broadcast() -> None:
    logp, old, adv, mask = _loss_inputs()
    per_token = adv[:, None].expand(2, 3).clone()
    aggregations: tuple[Aggregation, ...] = ("token", "sample")
    for aggregation in aggregations:
        a, _ = policy_loss(logp, old, adv, mask, aggregation=aggregation)
        b, _ = policy_loss(logp, old, per_token, mask, aggregation=aggregation)
        torch.testing.assert_close(a, b)


def test_policy_loss_weights_scale_tokens_without_gradient() -> None:
    # weight 2 on the first token: (-2.5 - 1.28 - 0.7 + 0.8 + 1.0) / 5 = -0.536
    logp, old, adv, mask = _loss_inputs()
    weights = _t([[2, 1, 1], [1, 1, 1]]).requires_grad_()
    adv.requires_grad_()
    loss, _ = policy_loss(logp, old, adv, mask, weights=weights)
    _close(loss, -0.536)
    loss.backward()
    assert weights.grad is None and adv.grad is None
    assert logp.grad is not None
    _close(logp.grad, [[-0.5, 0, -0.14], [0, 0.2, 0]])


@pytest.mark.parametrize("rho, eps_high, expected_loss, expected_clip", [
    (1.25, 0.28, -1.25, 0.0),   # inside the asymmetric band: not clipped
    (1.3, 0.28, -1.28, 1.0),    # above 1 + eps_high: clipped
    (1.25, 0.2, -1.2, 1.0),     # symmetric eps would clip 1.25
])
def test_policy_loss_clip_higher_is_asymmetric(rho: float, eps_high: float,
                                               expected_loss: float,
                                               expected_clip: float) -> None:
    logp = torch.tensor([[math.log(rho)]])
    loss, stats = policy_loss(logp, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1),
                              eps_high=eps_high)
    _close(loss, expected_loss)
    _close(stats["clip_frac"], expected_clip)


def test_policy_loss_masked_garbage_and_empty_mask() -> None:
    logp = torch.tensor([[0.0, NAN]], requires_grad=True)
    old = torch.tensor([[0.0, -INF]])
    mask = torch.tensor([[True, False]])
    loss, stats = policy_loss(logp, old, torch.tensor([[1.0, NAN]]), mask,
                              weights=torch.tensor([[1.0, INF]]))
    _close(loss, -1.0)
    loss.backward()
    assert logp.grad is not None
    _close(logp.grad, [[-1.0, 0.0]])
    empty, stats = policy_loss(logp, old, torch.tensor([1.0]), torch.zeros(1, 2),
                               aggregation="sample")
    _close(empty, 0.0)
    _close(stats["clip_frac"], 0.0)


def test_policy_loss_validates_arguments() -> None:
    logp, old, adv, mask = _loss_inputs()
    with pytest.raises(ValueError, match=r"aggregation='seq'.*\['token', 'sample'\]"):
        policy_loss(logp, old, adv, mask, aggregation="seq")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logp, old, torch.ones(3), mask)
    with pytest.raises(ValueError, match="shapes must match"):
        policy_loss(logp, old, adv, mask[:, :2])
    with pytest.raises(ValueError, match="eps_low"):
        policy_loss(logp, old, adv, mask, eps_low=1.0)


# --- importance weights ------------------------------------------------------------------------

def test_tis_weights_truncate_at_clip() -> None:
    # rho = [0.5, 1.5, 3.0 | 10.0 masked], clip 2 -> w = [0.5, 1.5, 2.0, 2.0], 1 of 3 clipped
    old = _t([[0.5, 1.5, 3.0, 10.0]]).log()
    rollout = torch.zeros(1, 4)
    w, frac = tis_weights(old, rollout, _t([[1, 1, 1, 0]]), clip=2.0)
    _close(w, [[0.5, 1.5, 2.0, 2.0]])
    _close(frac, 1 / 3)
    assert not w.requires_grad
    with pytest.raises(ValueError, match="clip"):
        tis_weights(old, rollout, torch.ones(1, 4), clip=0.0)


def test_tis_weights_are_detached() -> None:
    old = torch.zeros(1, 2, requires_grad=True)
    w, frac = tis_weights(old, torch.zeros(1, 2), torch.ones(1, 2), clip=2.0)
    assert not w.requires_grad and not frac.requires_grad


def test_mis_weights_mask_outside_band() -> None:
    # rho = [0.4, 0.5, 1.0, 2.0, 2.5 | 100 masked], band [0.45, 2.2] -> keep [0, 1, 1, 1, 0]
    old = _t([[0.4, 0.5, 1.0, 2.0, 2.5, 100.0]]).log()
    mask = _t([[1, 1, 1, 1, 1, 0]])
    w, frac = mis_weights(old, torch.zeros(1, 6), mask, lo=0.45, hi=2.2)
    _close(w, [[0, 1, 1, 1, 0, 0]])
    _close(frac, 2 / 5)
    # the band is inclusive: rho exactly 1 is kept with lo = 1
    w, frac = mis_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), lo=1.0, hi=2.0)
    _close(w, [[1.0]])
    _close(frac, 0.0)


@pytest.mark.parametrize("lo, hi", [(0.0, 2.0), (-1.0, 2.0), (2.0, 2.0), (3.0, 2.0)])
def test_mis_weights_validate_band(lo: float, hi: float) -> None:
    with pytest.raises(ValueError, match="lo="):
        mis_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), lo=lo, hi=hi)


# --- KL, entropy, means, drift -----------------------------------------------------------------

def test_k3_kl_hand_computed() -> None:
    # d = ref - logp = [ln 2, -ln 2]: (2 - ln2 - 1) = 0.3068528, (0.5 + ln2 - 1) = 0.1931472
    # mean = 0.25; d/dlogp = (1 - e^d) / 2 = [-0.5, 0.25]; third token masked (garbage)
    logp = torch.zeros(1, 3, requires_grad=True)
    ref = torch.tensor([[math.log(2), -math.log(2), NAN]])
    kl = k3_kl(logp, ref, _t([[1, 1, 0]]))
    _close(kl, 0.25)
    kl.backward()
    assert logp.grad is not None
    _close(logp.grad, [[-0.5, 0.25, 0.0]])
    _close(k3_kl(torch.randn(2, 5), torch.zeros(2, 5), torch.zeros(2, 5)), 0.0)
    same = torch.randn(2, 5)
    _close(k3_kl(same, same, torch.ones(2, 5)), 0.0)


def test_entropy_hand_computed() -> None:
    # uniform over 4: ln 4; p = [0.5, 0.25, 0.25]: 0.5 ln 2 + 0.5 ln 4 = 1.5 ln 2
    _close(entropy(torch.zeros(4)), math.log(4))
    _close(entropy(torch.tensor([0.5, 0.25, 0.25]).log()), 1.5 * math.log(2))
    # -inf logits are banned tokens (no NaN); huge logits stay finite
    _close(entropy(torch.tensor([[0.0, -INF, 0.0, -INF], [1e4, 1e4, -1e4, -1e4]])),
           [math.log(2), math.log(2)])
    h = entropy(torch.zeros(2, 3, 8, dtype=torch.bfloat16))
    assert h.shape == (2, 3) and h.dtype == torch.float32
    _close(h, [[math.log(8)] * 3] * 2)


def test_masked_mean() -> None:
    x = _t([[1, 2, 3], [4, NAN, 6]])
    mask = _t([[1, 1, 0], [1, 0, 1]])
    _close(masked_mean(x, mask), 3.25)                      # (1 + 2 + 4 + 6) / 4
    _close(masked_mean(x, mask.bool(), dim=1), [1.5, 5.0])
    _close(masked_mean(x, torch.zeros(2, 3)), 0.0)
    _close(masked_mean(x, _t([[0, 0, 0], [1, 0, 1]]), dim=-1), [0.0, 5.0])
    with pytest.raises(ValueError, match="shapes must match"):
        masked_mean(x, torch.ones(3))


def test_logprob_abs_diff_matches_miles_metric() -> None:
    # |a - b| per sample: [0.1, 0.3 | 9 masked] -> 0.2; [-0.2 | 7 masked] -> 0.2; no tokens -> 0
    # metric = (0.2 + 0.2 + 0) / 3 (samples without tokens count in B); max = 0.3
    train = _t([[0.1, -0.3, 9.0], [-1.2, 7.0, 0.0], [5.0, 5.0, 5.0]])
    rollout = _t([[0.0, 0.0, 0.0], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = _t([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    metric, worst = logprob_abs_diff(train.requires_grad_(), rollout, mask)
    _close(metric, 0.4 / 3)
    _close(worst, 0.3)
    assert not metric.requires_grad and not worst.requires_grad
    metric, worst = logprob_abs_diff(train, rollout, torch.zeros(3, 3))
    _close(metric, 0.0)
    _close(worst, 0.0)


def test_drift_tokens_counts_and_locates_the_worst_token() -> None:
    # rows with responses starting at columns 1 and 0: diffs [-, 0, 0.5 | masked 9] and
    # [0.25, 0, -]; two tokens differ, the worst (0.5) is the second token of its response
    train = _t([[0.0, 1.0, 1.5, 9.0], [0.25, 2.0, 0.0, 0.0]])
    rollout = _t([[0.0, 1.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
    mask = _t([[0, 1, 1, 0], [1, 1, 0, 0]])
    count, at = drift_tokens(train, rollout, mask)
    assert (int(count), int(at)) == (2, 1)
    count, at = drift_tokens(rollout, rollout, mask)          # exact: nothing to locate
    assert (int(count), int(at)) == (0, -1)
