"""The trainer's numerics for one rollout batch: the policy's log-probs in the engine's formula
(`sequence_logprobs`), the forward mode and context of `RLConfig.formulation` /
`true_on_policy` (`formulation_mode`, `numerics`), and the step's objective with its statistics
(`rl_loss`), which the local trainer (`rl/trainer.py`) and the FSDP2 data-parallel step
(`rl/fsdp.py`) share.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from dsv4.engine.sampler import token_logprobs
from dsv4.kernels.ref.batch_invariant import batch_invariant
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.model.forward_mode import INFERENCE, TRAINING, ForwardMode
from dsv4.rl import algorithms as alg
from dsv4.rl.batch import TrainBatch
from dsv4.rl.config import RLConfig


def sequence_logprobs(model: DeepSeekV4ForCausalLM, inputs: torch.Tensor, targets: torch.Tensor,
                      mode: ForwardMode, temperature: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi(target) [B, S], temperature-scaled logits [B, S, V]) of a forward in `mode`, with
    the engine's formula (`engine.sampler.token_logprobs`, the temperature as an fp32 tensor)."""
    logits = model(inputs, mode)                                          # [B, S, V] fp32
    B, S, V = logits.shape
    temp = torch.full((B * S,), temperature, dtype=torch.float32, device=logits.device)
    logp = token_logprobs(logits.reshape(B * S, V), targets.reshape(-1), temp)
    return logp.view(B, S), logits / temperature


def formulation_mode(config: RLConfig) -> ForwardMode:
    """The trainer's full-sequence mode for `config.formulation` (activation checkpointing per
    block with `activation_checkpointing`), without kernel values."""
    mode = INFERENCE if config.formulation == "serving" else TRAINING
    return mode.with_checkpointing(config.activation_checkpointing)


@contextlib.contextmanager
def numerics(config: RLConfig) -> Iterator[None]:
    """The trainer's forward context: batch-invariant ops (true on-policy), else none."""
    if config.true_on_policy:
        with batch_invariant():
            yield
    else:
        yield


# rl_loss's stats that are not shares of a global mean: a data-parallel step reduces them with
# max (the largest drift) and with the position of that maximum, where every other stat is summed.
DRIFT_MAX = "train_rollout_logprob_abs_diff_max"
DRIFT_AT = "drift_worst_position"


def rl_loss(config: RLConfig, logp: torch.Tensor, logits: torch.Tensor, batch: TrainBatch,
            ref_logp: torch.Tensor | None = None, denom: alg.Denominators | None = None
            ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The step's objective and statistics from the policy's forward on `batch`.

    `logp` [B, T] (differentiable) and the temperature-scaled `logits` [B, T, V] come from
    `sequence_logprobs`; pi_old = `logp` detached (one optimizer step per rollout). The objective
    is the PPO clip(-higher) loss (sample mean for GRPO, token mean for DAPO) with the TIS / MIS
    weights the config asks for, minus `entropy_coef` x the token-mean entropy, plus `kl_coef` x
    the k3 KL to `ref_logp` (the frozen reference's log-probs; without them `kl_k3` is measured
    against the rollout and not trained on).

    `denom` (default: the batch's own counts) are the sample and token counts every mean divides
    by. A data-parallel rank passes the global counts: the objective, its gradient and every
    stat except `DRIFT_MAX` / `DRIFT_AT` are then this rank's shares, which sum over the ranks
    to the single-process values.

    Returns (objective 0-dim, stats: "loss" (the objective, detached), "entropy", the drift
    metrics, "clip_frac", "ratio_mean", "kl_k3" and, when on, "tis_clip_frac" /
    "mis_mask_frac"; all 0-dim tensors).
    """
    c = config
    old = logp.detach()
    mask = batch.mask
    drift, drift_max = alg.logprob_abs_diff(old, batch.rollout_logp, mask, denom)
    drift_count, drift_at = alg.drift_tokens(old, batch.rollout_logp, mask)
    weights, stats = None, {}
    if c.tis is not None:
        weights, stats["tis_clip_frac"] = alg.tis_weights(old, batch.rollout_logp, mask, c.tis,
                                                          denom)
    if c.mis is not None:
        keep, stats["mis_mask_frac"] = alg.mis_weights(old, batch.rollout_logp, mask, *c.mis,
                                                       denom)
        weights = keep if weights is None else weights * keep
    aggregation: alg.Aggregation = "token" if c.algo == "dapo" else "sample"
    loss, pstats = alg.policy_loss(logp, old, batch.advantages, mask, c.eps_low,
                                   c.eps_high if c.algo == "dapo" else c.eps_low,
                                   aggregation, weights, denom)
    count = None if denom is None else denom.tokens
    ent = alg.masked_mean(alg.entropy(logits), mask, count=count)
    total = loss - c.entropy_coef * ent
    if ref_logp is not None:
        stats["kl_k3"] = alg.k3_kl(logp, ref_logp, mask, denom)
        total = total + c.kl_coef * stats["kl_k3"]
    else:
        stats["kl_k3"] = alg.k3_kl(old, batch.rollout_logp, mask, denom)
    out = {"loss": total.detach(), "entropy": ent.detach(),
           "train_rollout_logprob_abs_diff": drift, DRIFT_MAX: drift_max,
           "drift_tokens": drift_count, DRIFT_AT: drift_at, **pstats,
           **{k: v.detach() for k, v in stats.items()}}
    return total, out
