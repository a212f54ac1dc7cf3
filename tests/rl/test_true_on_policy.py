"""Train / rollout log-prob drift on CPU fp32 with dsv4-tiny (issue 18's first Done-when line).

`--true-on-policy`: engine and trainer compute batch-invariantly with one formulation, so
`train_rollout_logprob_abs_diff` and its max are exactly 0.0 at step 0 and after an optimizer step
and its weight sync, whatever the replay setting. The default mode (TRAINING formulation against
the serving kernels) is reported for each replay setting and bounded by fp32 rounding."""

from __future__ import annotations

import pytest
import torch

from dsv4.assets import default_model_path
from dsv4.kernels.ref.batch_invariant import batch_invariant, check_row_invariance, is_active
from dsv4.rl.config import RLConfig
from dsv4.rl.trainer import RLTrainer

pytestmark = pytest.mark.slow


def _run(tmp_path, steps: int, **kw) -> tuple[RLTrainer, list[dict]]:
    config = RLConfig(model=str(default_model_path()), out_dir=str(tmp_path), group_size=4,
                      prompts_per_step=4, steps=steps, lr=1e-4, eval_per_level=2, **kw)
    trainer = RLTrainer(config)
    return trainer, [trainer.train_step() for _ in range(steps)]


def test_cpu_ops_are_batch_invariant() -> None:
    assert check_row_invariance() == []
    assert not is_active()
    threads = torch.get_num_threads()
    with batch_invariant():
        assert is_active()
    assert not is_active() and torch.get_num_threads() == threads


@pytest.mark.parametrize("replay", ["routing,indexer", "routing", "none"])
def test_true_on_policy_drift_is_exactly_zero(tmp_path, replay: str) -> None:
    # 2 steps: the second step's rollouts come from the synced weights of the first update
    trainer, records = _run(tmp_path, 2, replay=replay, true_on_policy=True)
    for r in records:
        assert r["train_rollout_logprob_abs_diff"] == 0.0, r
        assert r["train_rollout_logprob_abs_diff_max"] == 0.0, r
    assert records[0]["grad_norm"] > 0, "no update: the sync was vacuous"
    assert trainer.engine.weight_version == 3          # the initial sync and two more


@pytest.mark.parametrize("replay", ["routing,indexer", "none"])
def test_default_mode_drift_is_rounding(tmp_path, replay: str) -> None:
    _, records = _run(tmp_path, 1, replay=replay)
    r = records[0]
    assert 0.0 <= r["train_rollout_logprob_abs_diff"] < 1e-4, r
    assert r["train_rollout_logprob_abs_diff_max"] < 1e-3, r


def test_leaving_the_context_restores_the_aten_kernels() -> None:
    """Outside `batch_invariant()` a 1-row GEMM takes torch's own path again (the override is
    gone), inside it equals the same row of a 64-row call."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(64, 256, generator=gen), torch.randn(512, 256, generator=gen)
    before = torch.nn.functional.linear(x[:1], w)
    with batch_invariant():
        assert torch.equal(torch.nn.functional.linear(x[:1], w),
                           torch.nn.functional.linear(x, w)[:1])
    assert torch.equal(torch.nn.functional.linear(x[:1], w), before)
