"""Verifiable tasks: problem generators with a train / held-out split and an answer checker.

Pure Python at the base layer, so pre-training data (`dsv4.train`), evaluation and RL rewards
(`dsv4.rl`) share one definition of each task. `arithmetic` is the first (`tasks/arithmetic.py`).
"""
