"""The RL loop of `dsv4 rl run`: rollout -> rewards -> advantages -> one policy step -> sync.

One process, one device, trainer and engine colocated (the embedded default). The trainer owns an
fp32 policy (AdamW master weights) and, when the engine serves in bf16, a bf16 compute copy cast
exactly as the engine casts (`cast_`: the fp32-kept parameters stay fp32), so the trainer's
forward runs in the engine's dtype: gradients are taken on the copy, moved to the master weights
for the optimizer step, and the copy is re-cast after it. The engine owns its own copy in its
serving dtype / weight format and receives the policy at start and after every optimizer step
(`LLMEngine.update_weights`: in place, re-quantised where the engine keeps FP4 experts, prefix
cache flushed). A step:

1. rollout: `prompts_per_step` prompts x `group_size` samples from the engine, with the sampling
   log-probs and the recorded routing / indexer picks (`rl/rollout.py`); DAPO over-samples and
   drops groups whose rewards do not differ (at most `max_resample_rounds` rounds);
2. the trainer's forward on the same tokens (replaying the recorded selections: `ForwardMode
   .replay`) gives log pi_theta; pi_old = pi_theta before the update (one optimizer step per
   rollout, so the two are equal in value); drift = |log pi_old - log pi_rollout|
   (`train_rollout_logprob_abs_diff`, rl-reference.md §4.3), and where it sits (`drift_tokens`:
   how many tokens differ; `drift_worst_position`: the largest one's index in its response);
3. PPO clip(-higher) loss with optional TIS / MIS weights, k3 KL to the initial policy, entropy
   bonus; one AdamW step; weight sync. The engine's KV pools and CUDA graphs are released while
   the trainer steps (`LLMEngine.release_memory`, logged as `kv_released_mb`) and allocated
   again before the sync. The objective and its statistics are `objective.rl_loss`, which the
   FSDP2 data-parallel step (`rl/fsdp.py`) shares, passing the batch's global sample / token
   counts.

Formulations (`RLConfig.formulation`): "serving" runs the INFERENCE mode (gathered attention
with fp32 scores, per-expert MoE: the engine's `ref` formulation), "training" the TRAINING mode
(dense attention and experts: a much cheaper backward on the GPU, scores rounded to the
activation dtype). With a fused kernel backend (`triton`) and `kernel_values` (the default), the
forward's values come from the engine's own kernels under token-count-invariant launch plans
(`ForwardMode.values`, `model/kernel_values.py`) and only the gradients from the formulation.
With `true_on_policy` (the default there; on the `ref` ops only when asked) both sides also run
their GEMMs and reductions batch-invariantly (`batch_invariant()`; on the `ref` ops also with
fixed-width index rows): the trainer's log-probs equal the engine's bit for bit at step 0 and
after every sync, on CPU (tests/rl/test_true_on_policy.py) and on CUDA with CUDA graphs on (bf16
on an H200, every step of a 232-step run: benchmarks/results/rl_h200_202612.md).
Without it the linears stay cuBLAS, whose kernel depends on the row count.

Run directory: `rl_config.json`, `state.pt` (policy, optimizer, step; atomic), `metrics.jsonl`,
`rl.png`. Rollouts depend only on (seed, step), so a resumed run continues exactly.
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
import time
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from dsv4.config.engine import EngineConfig, check_weight_format
from dsv4.engine.engine import LLMEngine
from dsv4.model.forward_mode import ForwardMode
from dsv4.model.loader import load_model
from dsv4.rl.batch import (
    TrainBatch,
    advantages_of,
    group_rewards,
    keep_informative,
    pack,
    shape_overlong,
)
from dsv4.rl.config import RLConfig
from dsv4.rl.objective import formulation_mode, numerics, rl_loss, sequence_logprobs
from dsv4.rl.rewards import Prompt, Task, make_task
from dsv4.rl.rollout import Sample, generate_samples, greedy_answers
from dsv4.utils.logging import init_logger
from dsv4.utils.run_dir import append_metrics, save_state, truncate_metrics

logger = init_logger(__name__)


class RLTrainer:
    """The local run: trainer and engine in this process. Where the rollouts run is behind four
    methods (`_generate`, `_greedy`, `_release`, `_resume`) and `sync`, which the other
    placements' trainers override (`rl/workers.py`, `rl/server_trainer.py`)."""

    def __init__(self, config: RLConfig) -> None:
        self._init_policy(config)
        c = self.config
        served = load_model(Path(c.model), dtype=c.dtype, device=self.device,
                            weight_format=check_weight_format(c.weight_format))
        self.engine = LLMEngine(served, self.engine_config())
        self.sync()                       # the engine serves the trainer's weights from step 0

    def _init_policy(self, config: RLConfig) -> None:
        """The trainer's half: the task and tokenizer, the fp32 policy, its compute copy, the KL
        reference, AdamW; step 0."""
        self.config = c = config
        self.run_dir = Path(c.out_dir)
        self.device = torch.device(c.device)
        torch.manual_seed(c.seed)
        self.task: Task = make_task(c.task, c.levels)
        model_dir = Path(c.model)
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.policy = load_model(model_dir, dtype="float32", device=self.device).train()
        assert c.index_cache_dtype is not None, "RLConfig resolves it"
        self.policy.set_index_cache_dtype(c.index_cache_dtype)   # the copies below inherit it
        self.compute = (self.policy if c.dtype == "float32"
                        else copy.deepcopy(self.policy).cast_(torch.bfloat16))
        self.reference = copy.deepcopy(self.policy).eval() if c.kl_coef > 0 else None
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=c.lr,
                                           weight_decay=c.weight_decay, betas=(0.9, 0.999))
        self.step = 0
        self.elapsed_s = 0.0

    def engine_config(self) -> EngineConfig:
        c = self.config
        batch = c.group_size * c.prompts_per_step
        page = 128 if self.device.type == "cpu" else 256
        return EngineConfig(page_size=page, max_running_requests=max(batch, 16),
                            max_total_tokens=max(batch, 16) * 2 * page, chunked_prefill_size=4096,
                            kernel_backend=c.kernel_backend,  # type: ignore[arg-type]
                            capture_routing=True, disable_prefix_cache=True,
                            batch_invariant=bool(c.true_on_policy),
                            invariant_plans=c.values_from_kernels, seed=c.seed,
                            index_cache_dtype=c.index_cache_dtype,  # type: ignore[arg-type]
                            # RL steps rollouts synchronously: weight updates and memory release
                            # between phases find nothing in flight
                            overlap_schedule=False)

    # --- numerics ----------------------------------------------------------------------------
    def mode(self) -> ForwardMode:
        """The trainer's full-sequence mode: the formulation, with forward values from the
        engine's kernels when `values_from_kernels` (the engine's own `KernelOps`: colocated)."""
        return formulation_mode(self.config).with_values(
            self.engine.runner.ops if self.config.values_from_kernels else None)

    def numerics(self) -> contextlib.AbstractContextManager[None]:
        """The trainer's forward context (`numerics`): batch-invariant ops when true on-policy."""
        return numerics(self.config)

    def policy_logprobs(self, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        mode = self.mode().with_replay(batch.replay, fixed_widths=self.config.fixed_widths)
        with self.numerics():
            return sequence_logprobs(self.compute, batch.inputs, batch.targets, mode,
                                     self.config.temperature)

    # --- rollout -----------------------------------------------------------------------------
    def rollout(self) -> tuple[list[Sample], dict[str, float]]:
        """The step's samples (grouped) and rollout statistics."""
        c = self.config
        kept: dict[int, list[Sample]] = {}
        drawn: list[Sample] = []
        for round_ in range(c.max_resample_rounds if c.algo == "dapo" else 1):
            rng = random.Random(f"dsv4-rl-{c.seed}-{self.step}-{round_}")
            prompts = self.task.train_prompts(rng, c.prompts_per_step)
            samples = self._generate(prompts, seed=hash((c.seed, self.step, round_)) % 2**31,
                                     first_group=round_ * c.prompts_per_step)
            for s, prompt in zip(samples, (p for p in prompts for _ in range(c.group_size)),
                                 strict=True):
                s.reward = self.task.reward(prompt, s.text)
            drawn += samples
            if c.algo == "grpo":
                kept = group_rewards(samples)
                break
            shape_overlong(samples, c.max_tokens, c.overlong_buffer)
            kept.update(keep_informative(group_rewards(samples)))
            if len(kept) >= c.prompts_per_step:
                break
        groups = dict(list(kept.items())[:c.prompts_per_step])
        chosen = [s for g in groups.values() for s in g]
        correct = [float(s.reward >= 1.0) for s in drawn]
        stats = {"reward_mean": sum(s.reward for s in drawn) / len(drawn),
                 "reward_std": float(torch.tensor([s.reward for s in drawn]).std()),
                 "accuracy": sum(correct) / len(correct),
                 "response_len": sum(s.response_len for s in drawn) / len(drawn),
                 "groups_kept": len(groups), "samples_drawn": len(drawn)}
        return chosen, stats

    # --- one step ----------------------------------------------------------------------------
    def train_step(self) -> dict[str, Any]:
        c = self.config
        t0 = time.perf_counter()
        samples, record = self.rollout()
        t1 = time.perf_counter()
        released = self._release()          # the trainer steps without the KV pools
        if samples:
            groups = group_rewards(samples)
            batch = pack(samples, advantages_of(groups), c.replay_routing,
                         c.replay_indexer).to(self.device)
            record.update(self._optimize(batch))
        else:
            record["skipped"] = True            # DAPO found no informative group
        t2 = time.perf_counter()
        self._resume()
        record["kv_released_mb"] = round(released / 1e6, 1)
        self.sync()
        t3 = time.perf_counter()
        self.step += 1
        record.update(step=self.step, rollout_s=round(t1 - t0, 4), train_s=round(t2 - t1, 4),
                      sync_s=round(t3 - t2, 4))
        return record

    def _optimize(self, batch: TrainBatch) -> dict[str, float]:
        c = self.config
        logp, logits = self.policy_logprobs(batch)
        ref_logp = None
        if self.reference is not None:
            mode = self.mode().with_replay(batch.replay, c.fixed_widths)
            with torch.no_grad(), self.numerics():
                ref_logp, _ = sequence_logprobs(self.reference, batch.inputs, batch.targets,
                                                mode, c.temperature)
        total, out = rl_loss(c, logp, logits, batch, ref_logp)
        self.optimizer.zero_grad(set_to_none=True)
        self.compute.zero_grad(set_to_none=True)
        total.backward()
        self._grads_to_master()
        out["grad_norm"] = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), c.grad_clip)
        self.optimizer.step()
        self._master_to_compute()
        # the step's sync point
        return {k: float(v.detach()) for k, v in out.items()}

    def _grads_to_master(self) -> None:
        if self.compute is self.policy:
            return
        for master, replica in zip(self.policy.parameters(), self.compute.parameters(),
                                strict=True):
            master.grad = None if replica.grad is None else replica.grad.float()

    @torch.no_grad()
    def _master_to_compute(self) -> None:
        if self.compute is self.policy:
            return
        for master, replica in zip(self.policy.parameters(), self.compute.parameters(),
                                strict=True):
            replica.copy_(master)

    # --- the engine --------------------------------------------------------------------------
    def _generate(self, prompts: list[Prompt], seed: int, first_group: int) -> list[Sample]:
        """`group_size` samples of each prompt (`rollout.generate_samples`)."""
        c = self.config
        return generate_samples(self.engine, self.tokenizer, prompts, c.group_size,
                                c.temperature, c.max_tokens, seed=seed, first_group=first_group)

    def _greedy(self, prompts: list[Prompt]) -> list[str]:
        return greedy_answers(self.engine, self.tokenizer, prompts, self.config.max_tokens)

    def _release(self) -> int:
        """Free the engine's KV pools while the trainer steps; returns the bytes freed."""
        return self.engine.release_memory()

    def _resume(self) -> None:
        self.engine.resume_memory()

    def sync(self) -> int:
        """Push the policy into the engine (in place; flushes the engine's prefix cache)."""
        with torch.no_grad():
            return self.engine.update_weights(dict(self.policy.state_dict()))

    def close(self) -> None:
        """Let go of what the run holds outside this process (nothing here)."""

    # --- evaluation --------------------------------------------------------------------------
    def evaluate(self) -> dict[str, Any]:
        """Greedy held-out accuracy per level (the task's held-out split only)."""
        prompts = self.task.heldout_prompts(self.config.eval_per_level, seed=self.config.seed)
        answers = self._greedy(prompts)
        hits: dict[int, list[float]] = {}
        for p, a in zip(prompts, answers, strict=True):
            hits.setdefault(p.level, []).append(self.task.reward(p, a))
        by_level = {str(k): sum(v) / len(v) for k, v in sorted(hits.items())}
        return {"heldout_accuracy": sum(by_level.values()) / len(by_level),
                "heldout_by_level": by_level}

    # --- the loop ----------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        c = self.config
        stop_at = c.steps if c.max_steps_this_call is None else min(
            c.steps, self.step + c.max_steps_this_call)
        last: dict[str, Any] = {}
        if self.step == 0:
            last = self._log({"step": 0, **self.evaluate()})
        base, start = self.elapsed_s, time.perf_counter()
        with tqdm(total=c.steps, initial=self.step, desc="rl", unit="step", disable=None) as bar:
            while self.step < stop_at:
                record = self.train_step()
                self.elapsed_s = base + time.perf_counter() - start
                out_of_time = c.time_limit_s is not None and self.elapsed_s > c.time_limit_s
                # evaluated every eval_every steps, at the last step, and where the time runs out
                if self.step % c.eval_every == 0 or self.step == c.steps or out_of_time:
                    record.update(self.evaluate())
                last = self._log(record)
                bar.update(1)
                bar.set_postfix(reward=f"{record['reward_mean']:.2f}")
                if out_of_time:
                    logger.info("time limit reached at step %d; saving for resume", self.step)
                    break
                if self.step % c.save_every == 0 and self.step < stop_at:
                    self.save()              # a killed run resumes from here (state.pt: atomic)
        self.elapsed_s = base + time.perf_counter() - start
        self.save()
        return last

    def _log(self, record: dict[str, Any]) -> dict[str, Any]:
        append_metrics(self.run_dir, record)
        logger.info("%s", record)
        return record

    # --- persistence -------------------------------------------------------------------------
    def save(self) -> None:
        """state.pt atomically (temporary file + rename), and the run's config."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.config.save(self.run_dir / "rl_config.json")
        state = {"policy": self.policy.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "step": self.step, "elapsed_s": self.elapsed_s}
        save_state(self.run_dir, state)

    def load(self) -> None:
        """Restore state.pt, push it into the engine, drop metrics logged after it."""
        state = torch.load(self.run_dir / "state.pt", map_location=self.device,
                           weights_only=True)
        self.policy.load_state_dict(state["policy"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.elapsed_s = int(state["step"]), float(state["elapsed_s"])
        self._master_to_compute()
        self.sync()
        truncate_metrics(self.run_dir, self.step)


def open_run(config: RLConfig, resume: bool,
             trainer_cls: type[RLTrainer] = RLTrainer) -> RLTrainer:
    """A `trainer_cls` for `config.out_dir`: fresh (refusing to overwrite a run) or resumed."""
    run_dir = Path(config.out_dir)
    if resume:
        if not (run_dir / "state.pt").exists():
            raise FileNotFoundError(f"--resume: no state.pt in {run_dir}")
        saved = RLConfig.from_dict(json.loads((run_dir / "rl_config.json").read_text()))
        changed = saved.changed_fields(config)
        if changed:
            raise ValueError(f"--resume: {changed} differ from the run's rl_config.json; "
                             f"only {sorted(RLConfig.INVOCATION_FIELDS)} may change")
        trainer = trainer_cls(config)
        trainer.load()
        return trainer
    if (run_dir / "state.pt").exists():
        raise FileExistsError(f"{run_dir} already holds a run; "
                              "pass --resume or choose another --out")
    return trainer_cls(config)
