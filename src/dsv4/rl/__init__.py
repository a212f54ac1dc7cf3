"""Verified RL: rollouts from the engine, replay, GRPO/DAPO.

algorithms: GRPO advantages, DAPO shaping, the clipped policy loss, TIS / MIS weights, metrics.
rewards: the task registry (prompts and verifiable rewards) and `parse_levels`.
"""
