"""Verified RL: rollouts from the engine, replay, GRPO/DAPO.

config: the frozen run config (`RLConfig`) and its resume rules.
rewards: the task registry (prompts and verifiable rewards) and `parse_levels`.
rollout: samples from the in-process engine with sampling log-probs and recorded routing.
batch: samples packed into [B, L-1] tensors with replay arrays; GRPO advantages, DAPO filters.
algorithms: GRPO advantages, DAPO shaping, the clipped policy loss, TIS / MIS weights, metrics.
trainer: the loop (rollout, one policy step, weight sync, evaluation, resume) and `rl_loss`.
fsdp: data-parallel trainer ranks over FSDP2 with global normalisers (equal to one process).
placement: where the loop runs: in this process, or as Ray actors (colocated, disaggregated).
workers: the Ray actors' halves of the trainer; bucket_sync: bucketed weight broadcast.
plot, export: the run's curves; the policy as a servable checkpoint.
"""
