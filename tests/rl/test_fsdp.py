"""FSDP2 data-parallel RL step on CPU (gloo, 2 processes) against one process (issue 24).

One rollout of dsv4-tiny (fp32, routing and indexer replay) through the trainer's own engine;
fixed advantages; RLConfig's optimizer defaults (AdamW, lr 1e-5, grad clip 1.0). The
single-process step is `RLTrainer._optimize` (`_one_process` rebuilds it from the same public
pieces and is checked equal to it bit for bit). Two gloo ranks shard a fresh policy
(`shard_policy`), each steps on its slice (`split_batch`, `fsdp_rl_step`), and the loss, the
statistics and every updated parameter (`full_tensor()`) equal the single process's to 1e-6, for
GRPO ("sample" aggregation, TIS, entropy bonus, an even 2/2 split), DAPO ("token" aggregation,
MIS, k3 KL to a reference, 2/2), GRPO on an uneven 2/1 split, and GRPO with activation
checkpointing per block (which changes no bit of the single-process step).

Why those cases run the true on-policy numerics (a batch-invariant forward): the first AdamW
step moves each weight by lr * g / (|g| + 1e-8), so where a gradient element is near 1e-8 its
fp32 rounding decides a sizeable part of the step. Two ranks and one process reduce the
gradient in different orders (per rank, then across ranks), and with the default forward each
sample's activations also round differently in a batch of 2 than in one of 4. The gradients
agree to ~1e-7 relative either way; the updated weights to well under 1e-6 with the invariant
forward, but only to a few 1e-6 with the default one ("grpo-default", held to half a step).
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import MixedPrecisionPolicy

from dsv4.assets import default_model_path
from dsv4.distributed.group import join_default_group
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.model.forward_mode import Replay
from dsv4.model.loader import load_model
from dsv4.rl.algorithms import Denominators
from dsv4.rl.batch import TrainBatch, pack
from dsv4.rl.config import RLConfig
from dsv4.rl.fsdp import fsdp_rl_step, reduce_stats, shard_policy, split_batch
from dsv4.rl.objective import (
    DRIFT_AT,
    DRIFT_MAX,
    formulation_mode,
    numerics,
    rl_loss,
    sequence_logprobs,
)
from dsv4.rl.trainer import RLTrainer

WORLD = 2
ADVANTAGES = torch.tensor([1.0, -1.0, 0.5, -0.75])
# name: (RLConfig fields, samples). GRPO with TIS and an entropy bonus; DAPO with MIS and a k3 KL
# term (a reference model); 4 samples split 2 / 2, or 3 split 2 / 1. True on-policy numerics
# (batch-invariant forward) except "grpo-default", the CPU trainer's default numerics.
CASES: dict[str, tuple[dict[str, Any], int]] = {
    "grpo": ({"algo": "grpo", "tis": 2.0, "entropy_coef": 0.01, "true_on_policy": True}, 4),
    "dapo": ({"algo": "dapo", "mis": (0.5, 2.0), "kl_coef": 0.05, "true_on_policy": True}, 4),
    "grpo-uneven": ({"algo": "grpo", "tis": 2.0, "entropy_coef": 0.01,
                     "true_on_policy": True}, 3),
    "grpo-default": ({"algo": "grpo", "tis": 2.0, "entropy_coef": 0.01}, 4),
    "grpo-ac": ({"algo": "grpo", "tis": 2.0, "entropy_coef": 0.01, "true_on_policy": True,
                 "activation_checkpointing": True}, 4),
}
# max |updated parameter difference|: 1e-6 with the batch-invariant forward, half of an Adam
# step (lr / 2) with the default one (see the module docstring).
PARAM_TOL = {"grpo-default": 5e-6}
# The default forward's log-probs depend on the batch's size at fp32 rounding (the GEMM library
# picks its kernel by shape; measured on an AVX-512 CPU: a few 1e-6), and the drift statistics
# are differences of that size: each side's drift is itself a few 1e-6.
STAT_TOL = {("grpo-default", k): 2e-5 for k in ("train_rollout_logprob_abs_diff", DRIFT_MAX)}


def _config(out_dir: Path, **kw: Any) -> RLConfig:
    return RLConfig(model=str(default_model_path()), out_dir=str(out_dir), group_size=2,
                    prompts_per_step=2, max_tokens=8, eval_per_level=1, **kw)


def _one_process(base: DeepSeekV4ForCausalLM, config: RLConfig, batch: TrainBatch
                 ) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """`RLTrainer._optimize` at fp32 (the compute copy is the policy) on a copy of `base`:
    (its record, the updated parameters)."""
    policy = copy.deepcopy(base).train()
    reference = copy.deepcopy(base).eval() if config.kl_coef > 0 else None
    optimizer = torch.optim.AdamW(policy.parameters(), lr=config.lr,
                                  weight_decay=config.weight_decay, betas=(0.9, 0.999))
    mode = formulation_mode(config).with_replay(batch.replay, config.fixed_widths)
    with numerics(config):
        logp, logits = sequence_logprobs(policy, batch.inputs, batch.targets, mode,
                                         config.temperature)
    ref_logp = None
    if reference is not None:
        with torch.no_grad(), numerics(config):
            ref_logp, _ = sequence_logprobs(reference, batch.inputs, batch.targets, mode,
                                            config.temperature)
    total, out = rl_loss(config, logp, logits, batch, ref_logp)
    optimizer.zero_grad(set_to_none=True)
    total.backward()
    out["grad_norm"] = torch.nn.utils.clip_grad_norm_(policy.parameters(), config.grad_clip)
    optimizer.step()
    return ({k: float(v) for k, v in out.items()},
            {n: p.detach().clone() for n, p in policy.named_parameters()})


def _worker(rank: int, world: int, store: str, cases_path: str, out_path: str) -> None:
    """One rank: for every case, shard a fresh policy, step on this rank's slice, gather."""
    torch.set_num_threads(1)
    join_default_group("gloo", f"file://{store}", rank, world)
    try:
        cases = torch.load(cases_path, weights_only=False)
        base = load_model(default_model_path(), dtype="float32", device="cpu", progress=False)
        results = {}
        for name, (config, batch) in cases.items():
            policy = shard_policy(copy.deepcopy(base).train())
            reference = copy.deepcopy(base).eval() if config.kl_coef > 0 else None
            optimizer = torch.optim.AdamW(policy.parameters(), lr=config.lr,
                                          weight_decay=config.weight_decay, betas=(0.9, 0.999))
            record = fsdp_rl_step(policy, optimizer, split_batch(batch, rank, world), config,
                                  reference=reference)
            params = {n: p.full_tensor() for n, p in policy.named_parameters()}  # collective
            results[name] = (record, params)
        config, batch = cases["grpo"]                 # bf16 compute, fp32 master weights
        policy = shard_policy(copy.deepcopy(base).train(),
                              mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                             reduce_dtype=torch.float32))
        optimizer = torch.optim.AdamW(policy.parameters(), lr=config.lr)
        record = fsdp_rl_step(policy, optimizer, split_batch(batch, rank, world), config)
        results["bf16"] = (record, {p.dtype for p in policy.parameters()})
        # reduce_stats alone: shares summed; the largest drift and its position from the rank
        # holding it, rank 0 on a tie
        for name, maxima in (("tie", (0.5, 0.5)), ("rank1", (0.25, 0.75))):
            stats = {"share": torch.tensor(rank + 1.0), DRIFT_MAX: torch.tensor(maxima[rank]),
                     DRIFT_AT: torch.tensor(10 * rank + 3)}
            results[name] = reduce_stats(stats)
        if rank == 0:
            torch.save(results, out_path)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The rollout, the single-process steps (and the trainer's own), and the 2-rank steps."""
    tmp = tmp_path_factory.mktemp("fsdp")
    trainer = RLTrainer(_config(tmp / "run", **CASES["grpo"][0]))
    base = copy.deepcopy(trainer.policy)
    samples, _ = trainer.rollout()
    assert len(samples) == len(ADVANTAGES)
    batch = pack(samples, ADVANTAGES, routing=True, indexer=True)
    assert batch.replay is not None and batch.replay.indexer is not None
    cases = {name: (_config(tmp / name, **kw), pack(samples[:n], ADVANTAGES[:n], True, True))
             for name, (kw, n) in CASES.items()}
    production = trainer._optimize(batch)
    one = {name: _one_process(base, config, b) for name, (config, b) in cases.items()}
    torch.save(cases, tmp / "cases.pt")
    mp.spawn(_worker, args=(WORLD, str(tmp / "store"), str(tmp / "cases.pt"),
                            str(tmp / "two.pt")), nprocs=WORLD, join=True)
    two = torch.load(tmp / "two.pt", weights_only=False)
    return {"base": base, "trainer": trainer, "production": production, "cases": cases,
            "one": one, "two": two}


@pytest.mark.slow
def test_reference_step_is_the_trainers_step(runs: dict[str, Any]) -> None:
    record, params = runs["one"]["grpo"]
    assert record == runs["production"]
    for name, p in runs["trainer"].policy.named_parameters():
        assert torch.equal(p, params[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_equal_one_process(runs: dict[str, Any], case: str) -> None:
    (one, one_params), (two, two_params) = runs["one"][case], runs["two"][case]
    assert set(two) == set(one)
    loss_diff = abs(two["loss"] - one["loss"])
    param_diff = max((two_params[n] - p).abs().max().item() for n, p in one_params.items())
    step = max((p - runs["base"].get_parameter(n)).abs().max().item()
               for n, p in one_params.items())
    print(f"\n{case}: loss {one['loss']:.6g} |diff| {loss_diff:.3g}; params max |diff| "
          f"{param_diff:.3g} (largest update {step:.3g}); grad_norm {one['grad_norm']:.7g} "
          f"vs {two['grad_norm']:.7g}; drift tokens {one['drift_tokens']:g} / "
          f"{two['drift_tokens']:g} at {one[DRIFT_AT]:g} / {two[DRIFT_AT]:g}")
    assert loss_diff <= 1e-6
    assert param_diff <= PARAM_TOL.get(case, 1e-6)
    assert step >= 5e-6, "the step barely moved the weights: the comparison is vacuous"
    # fp32 norms of 27.7M elements: each side within ~1.2e-5 (relative) of the fp64 norm
    assert abs(two["grad_norm"] - one["grad_norm"]) <= 3e-5 * one["grad_norm"]
    for k in one.keys() - {"loss", "grad_norm", "drift_tokens", DRIFT_AT}:
        assert abs(two[k] - one[k]) <= STAT_TOL.get((case, k), 1e-6), (k, one[k], two[k])
    if runs["cases"][case][0].true_on_policy:       # the trainer's log-probs are the engine's
        assert one["drift_tokens"] == two["drift_tokens"] == 0
        assert one[DRIFT_AT] == two[DRIFT_AT] == -1


@pytest.mark.slow
def test_activation_checkpointing_changes_no_bit(runs: dict[str, Any]) -> None:
    """Blocks recomputed in the backward: the single-process step's record and updated weights
    are those without activation checkpointing, bit for bit (the two-rank run of "grpo-ac"
    equals it as the other cases do)."""
    (ac, ac_params), (plain, plain_params) = runs["one"]["grpo-ac"], runs["one"]["grpo"]
    assert ac == plain
    assert all(torch.equal(ac_params[n], p) for n, p in plain_params.items())


@pytest.mark.slow
def test_reduce_stats_sums_shares_and_locates_the_largest_drift(runs: dict[str, Any]) -> None:
    assert runs["two"]["tie"] == {"share": 3.0, DRIFT_MAX: 0.5, DRIFT_AT: 3.0}
    assert runs["two"]["rank1"] == {"share": 3.0, DRIFT_MAX: 0.75, DRIFT_AT: 13.0}


@pytest.mark.slow
def test_bf16_mixed_precision_runs_on_fp32_master_weights(runs: dict[str, Any]) -> None:
    record, dtypes = runs["two"]["bf16"]
    assert dtypes == {torch.float32}
    assert abs(record["loss"] - runs["one"]["grpo"][0]["loss"]) <= 1e-2
    assert record["grad_norm"] > 0


def _synthetic(B: int = 4, T: int = 5, V: int = 7) -> tuple[torch.Tensor, torch.Tensor,
                                                          TrainBatch, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, V, generator=gen).requires_grad_()
    lengths = [5, 2, 0, 3, 4][:B]
    mask = torch.tensor([[float(t < n) for t in range(T)] for n in lengths])
    targets = torch.randint(V, (B, T), generator=gen)
    rollout = torch.randn(B, T, generator=gen) * 0.1 - 2.0
    replay = Replay(experts=torch.arange(B * T).view(B, T, 1, 1).int())
    batch = TrainBatch(torch.zeros(B, T, dtype=torch.long), targets, mask, rollout,
                       torch.randn(B, generator=gen), replay)
    return logits, targets, batch, torch.randn(B, T, generator=gen) * 0.1 - 2.0


@pytest.mark.parametrize("algo", ["grpo", "dapo"])
def test_shares_with_global_denominators_sum_to_the_whole(tmp_path: Path, algo: str) -> None:
    """rl_loss on slices with the global counts: objectives, gradients and stats add up to the
    whole batch's (what the gradient and stat reductions of `fsdp_rl_step` rely on)."""
    config = replace(_config(tmp_path, **CASES[algo][0]), tis=2.0, mis=(0.5, 2.0),
                     kl_coef=0.05)
    logits, targets, batch, ref = _synthetic()

    def objective(rows: slice, denom: Denominators | None) -> tuple[torch.Tensor, dict]:
        part = logits[rows]
        logp = torch.log_softmax(part, -1).gather(-1, targets[rows, :, None])[..., 0]
        sub = TrainBatch(batch.inputs[rows], targets[rows], batch.mask[rows],
                         batch.rollout_logp[rows], batch.advantages[rows], None)
        return rl_loss(config, logp, part, sub, ref[rows], denom)

    whole, stats = objective(slice(0, 4), None)
    (grad,) = torch.autograd.grad(whole, logits)
    denom = Denominators.of(batch.mask)
    parts = [objective(rows, denom) for rows in (slice(0, 3), slice(3, 4))]   # uneven: 3 / 1
    total = sum(p[0] for p in parts)
    (grad_parts,) = torch.autograd.grad(total, logits)
    torch.testing.assert_close(total, whole, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad_parts, grad, rtol=0, atol=1e-7)
    for k in stats.keys() - {DRIFT_MAX, DRIFT_AT}:
        torch.testing.assert_close(sum(p[1][k] for p in parts).float(), stats[k].float(),
                                   rtol=0, atol=1e-6, msg=k)


def test_split_batch_slices_samples_and_replay() -> None:
    _, _, batch, _ = _synthetic(B=5)
    parts = [split_batch(batch, r, 2) for r in range(2)]
    assert [p.inputs.shape[0] for p in parts] == [3, 2]
    assert parts[0].inputs.shape[1] == batch.inputs.shape[1]          # padded width kept
    for field in ("inputs", "targets", "mask", "rollout_logp", "advantages"):
        assert torch.equal(torch.cat([getattr(p, field) for p in parts]), getattr(batch, field))
    experts = [p.replay.experts for p in parts if p.replay is not None]
    assert batch.replay is not None and len(experts) == 2
    assert torch.equal(torch.cat(experts), batch.replay.experts)
    with pytest.raises(ValueError, match="cannot be split over 3 ranks"):
        split_batch(split_batch(batch, 1, 2), 0, 3)
    with pytest.raises(ValueError, match="rank=2 is invalid"):
        split_batch(batch, 2, 2)

