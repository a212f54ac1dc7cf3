"""Data-parallel RL steps over FSDP2: every rank holds a shard of the policy and a slice of the
samples, and the step's loss, statistics and gradients equal the single-process step's
(`RLTrainer._optimize`) up to summation order (so do the updated weights, except that AdamW's
first step, lr * g / (|g| + eps), magnifies that rounding where |g| is near eps).

`shard_policy` applies `torch.distributed.fsdp.fully_shard` to every decoder block and MTP block
(one unit each) and then to the root (embedding, mHC head, norm, LM head): each unit's
parameters are all-gathered for its forward and backward and its gradients reduce-scattered,
so a rank keeps 1/world of the weights, gradients and AdamW state. The MTP blocks are units of
their own so that the RL forward, which does not run them, never gathers them (they get no
gradient). Parameters stay fp32 by default; an optional `MixedPrecisionPolicy` computes in its
`param_dtype` (the sharded master weights stay fp32), casting every parameter, the `keeps_fp32`
set included (unlike `DeepSeekV4ForCausalLM.cast_`): a bf16 policy is not the engine's bf16
numerics.

`fsdp_rl_step` runs one optimizer step on this rank's slice (`split_batch`). What makes it equal
to one process on the whole batch:

* normalisation: the sample and token counts are all-reduced first and `rl_loss` divides every
  mean by these GLOBAL counts (`algorithms.Denominators`), so each rank's objective is its share
  of the single-process objective and the shares sum to it (averaging per-rank means instead is
  wrong as soon as ranks hold different token counts ("token") or sample counts ("sample"));
* gradient reduction: FSDP averages over ranks by default; `shard_policy` sets a divide factor
  of 1 with sum-only collectives (a custom factor otherwise reduces with PREMUL_SUM, which gloo
  lacks), so the reduce-scatter sums the shares' gradients into the single-process gradient;
* clipping: `clip_grad_norm_` on the sharded (DTensor) gradients reduces the per-shard norms
  over the mesh, so every rank clips with the global norm and reports it;
* statistics: every `rl_loss` stat is a share and is summed over the ranks, except the largest
  drift (max) and its position (taken from the rank holding that maximum, the lowest such rank
  on a tie: the single process's first occurrence, since ranks hold consecutive slices);
* replay: `split_batch` slices the routing and indexer replay arrays with their samples.

Splits: `split_batch` gives rank r the r-th of `world` consecutive slices whose sizes differ by at
most one (`torch.tensor_split`); uneven splits are exact too (global normalisers). A batch with
fewer samples than ranks is refused: every rank must run the forward and backward, whose
collectives all ranks join.

Tests: `pytest tests/rl/test_fsdp.py` (gloo, 2 CPU processes against one).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.model.forward_mode import ForwardMode, Replay
from dsv4.rl.algorithms import Denominators
from dsv4.rl.batch import TrainBatch
from dsv4.rl.config import RLConfig
from dsv4.rl.objective import (
    DRIFT_AT,
    DRIFT_MAX,
    formulation_mode,
    numerics,
    rl_loss,
    sequence_logprobs,
)
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)


def shard_policy(model: DeepSeekV4ForCausalLM, mesh: DeviceMesh | None = None,
                 mp_policy: MixedPrecisionPolicy | None = None) -> DeepSeekV4ForCausalLM:
    """Shard `model` in place over `mesh` (None: the default process group, on the device of
    the model's parameters): one FSDP unit per decoder / MTP block, then the root. Gradients are
    summed over the ranks (divide factor 1): the loss must already be a share of the global
    loss, as `rl_loss` with global `Denominators` gives. Returns the model (now an FSDPModule:
    parameters are DTensors; `full_tensor()` gathers one)."""
    mp = mp_policy or MixedPrecisionPolicy()
    blocks = [*model.layers, *model.mtp]
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)
    logger.info("FSDP2: %d block units + root, param dtype %s", len(blocks),
                mp.param_dtype or "unchanged")
    return model


def split_batch(batch: TrainBatch, rank: int, world: int) -> TrainBatch:
    """Rank `rank`'s slice of `batch`: consecutive samples, slice sizes differing by at most one
    (the first B % world ranks take one more), replay arrays sliced alike. The padded width is
    kept. Raises ValueError when a rank would get no sample."""
    B = batch.inputs.shape[0]
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} is invalid for world={world}; allowed: 0..{world - 1}")
    if B < world:
        raise ValueError(f"a batch of {B} samples cannot be split over {world} ranks: every "
                         "rank needs at least one sample (its forward and backward join the "
                         "collectives)")

    def part(t: torch.Tensor) -> torch.Tensor:
        return torch.tensor_split(t, world)[rank]

    replay = None if batch.replay is None else Replay(
        experts=None if batch.replay.experts is None else part(batch.replay.experts),
        indexer=None if batch.replay.indexer is None else part(batch.replay.indexer))
    return TrainBatch(part(batch.inputs), part(batch.targets), part(batch.mask),
                      part(batch.rollout_logp), part(batch.advantages), replay)


def global_denominators(batch: TrainBatch,
                        group: dist.ProcessGroup | None = None) -> Denominators:
    """The sample and token counts of the whole batch: this slice's, summed over the group."""
    local = Denominators.of(batch.mask)
    counts = torch.stack([local.samples, local.tokens]).to(torch.int64)
    dist.all_reduce(counts, group=group)
    return Denominators(samples=counts[0], tokens=counts[1])


def fsdp_rl_step(policy: DeepSeekV4ForCausalLM, optimizer: torch.optim.Optimizer,
                 batch: TrainBatch, config: RLConfig, mode: ForwardMode | None = None,
                 reference: DeepSeekV4ForCausalLM | None = None,
                 group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """One RL optimizer step of `policy` (sharded by `shard_policy`) on this rank's `batch`
    (`split_batch`); every rank of `group` calls it with its own slice. `mode`: the forward's
    formulation (default: `config.formulation`, no kernel values); the slice's replay is added
    here. `reference` (any module: sharded or a full copy) is the frozen policy of the k3 KL term
    when `config.kl_coef` > 0. Runs under `numerics(config)` like the single-process trainer.

    Returns the GLOBAL statistics, identical on every rank (see the module docstring)."""
    c = config
    denom = global_denominators(batch, group)
    fwd = (mode or formulation_mode(c)).with_replay(batch.replay, c.fixed_widths)
    with numerics(c):
        logp, logits = sequence_logprobs(policy, batch.inputs, batch.targets, fwd,
                                         c.temperature)
    ref_logp = None
    if reference is not None and c.kl_coef > 0:
        with torch.no_grad(), numerics(c):
            ref_logp, _ = sequence_logprobs(reference, batch.inputs, batch.targets, fwd,
                                            c.temperature)
    total, stats = rl_loss(c, logp, logits, batch, ref_logp, denom)
    optimizer.zero_grad(set_to_none=True)
    total.backward()
    norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), c.grad_clip)
    optimizer.step()
    record = reduce_stats(stats, group)
    record["grad_norm"] = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    return record


def reduce_stats(stats: dict[str, torch.Tensor],
                 group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """`rl_loss`'s per-rank stats (computed with global `Denominators`) -> the global values:
    shares summed (in fp64), `DRIFT_MAX` the maximum over ranks and `DRIFT_AT` the position of
    that maximum on the lowest rank holding it."""
    names = [k for k in stats if k not in (DRIFT_MAX, DRIFT_AT)]
    summed = torch.stack([stats[k].detach().double() for k in names])
    dist.all_reduce(summed, group=group)
    record = dict(zip(names, summed.tolist(), strict=True))
    worst = torch.stack([stats[DRIFT_MAX].double(), stats[DRIFT_AT].double()])
    table = [torch.empty_like(worst) for _ in range(dist.get_world_size(group))]
    dist.all_gather(table, worst, group=group)
    rows = torch.stack(table)
    first = int(rows[:, 0].argmax())                # argmax: the first (lowest) rank on a tie
    record[DRIFT_MAX], record[DRIFT_AT] = float(rows[first, 0]), float(rows[first, 1])
    return record
