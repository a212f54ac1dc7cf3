"""RLConfig: the frozen knobs of one RL run (`dsv4 rl run`).

Built once at the edge (CLI flags, or a run directory's `rl_config.json` on resume) and passed
down. A resumed run must keep every field except the `INVOCATION_FIELDS` (where and how long this
invocation runs), so a run cannot silently change what it trains.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from dsv4.config.engine import INDEX_CACHE_DTYPES
from dsv4.config.engine_defaults import resolve_index_cache_dtype
from dsv4.rl.rewards import TASKS
from dsv4.utils.run_dir import RunConfig

Algo = Literal["grpo", "dapo"]
ALGOS: tuple[str, ...] = ("grpo", "dapo")
REPLAYS: tuple[str, ...] = ("none", "routing", "routing,indexer")
PLACEMENTS: tuple[str, ...] = ("local", "colocated", "disaggregated", "servers")
INVOCATION_FIELDS = ("out_dir", "device", "time_limit_s", "max_steps_this_call", "placement",
                     "sync_bucket_mb", "save_every", "rollout_urls", "rollout_colocated",
                     "activation_checkpointing")


@dataclass(frozen=True)
class RLConfig(RunConfig):
    """`model`: checkpoint directory (official layout + tokenizer). `task` / `levels`: the
    reward task and its curriculum (`rl/rewards.py`). `algo`: "grpo" (group-normalised advantages,
    symmetric clip `eps_low`, sample-mean loss) or "dapo" (clip-higher `eps_high`, dynamic
    sampling, token-mean loss, overlong shaping over the last `overlong_buffer` tokens).
    `group_size` samples of each of `prompts_per_step` prompts per step, `steps` optimizer steps.
    `tis`: truncate the importance weight pi_old / pi_rollout at this C (None: off). `mis`:
    (lo, hi), mask tokens whose ratio leaves it (None: off). `replay`: which recorded selections
    the trainer reuses. `true_on_policy`: engine and trainer compute batch-invariantly
    (`kernels/ref/batch_invariant.py`: GEMMs and reductions) with one set of ops (the triton
    kernels under `kernel_values`, else the `ref` formulation), so the trainer's log-probs equal
    the sampling log-probs bit for bit (on the `ref` ops it needs `formulation` "serving").
    None (the default) resolves to `values_from_kernels`: exact on a fused backend, where the
    kernels already pay for invariant launch plans and the batch-invariant GEMMs add little
    (flash-4l on an H200: rollout +7%; without them the cuBLAS linears leave a drift of 0.0061),
    and off on the `ref` ops, whose batch-invariant mode runs single-threaded.
    `formulation`: the trainer's forward, "serving" (the engine's formulation: gathered attention
    with fp32 scores, per-expert MoE; lowest drift) or "training" (dense attention and experts: a
    cheaper backward, scores rounded to the activation dtype). `kernel_values`: with a fused
    kernel backend (not `ref`), the trainer's forward takes its values from the engine's kernels
    and its gradients from `formulation` (`model/kernel_values.py`); both sides run launch plans
    that do not depend on the token count (`EngineConfig.invariant_plans`). False: the
    formulation's own values, which agree with the kernels only to summation order.
    `kl_coef`: k3 KL to the frozen initial policy. `activation_checkpointing`: the trainer's
    forward keeps only each block's input and recomputes the block in the backward
    (`ForwardMode.checkpoint_blocks`): less activation memory for a second forward, the same
    values and gradients.
    `eval_every` steps, held-out greedy accuracy on `eval_per_level` problems per level.
    `save_every` steps (and at the end, and where the time limit stops the run), `state.pt` is
    written atomically: a trainer killed at any point resumes (`--resume`) from the last one and,
    rollouts depending only on (seed, step) and the saved state, continues as the run would have.
    `placement` (`rl/placement.py`): "local" (trainer and engine in this process, no Ray),
    "colocated" (both in one Ray actor on one bundle) or "disaggregated" (a trainer actor and a
    rollout actor on two bundles; weights broadcast after every step in buckets of
    `sync_bucket_mb` MiB), or "servers" (the trainer in this process, the rollouts and
    evaluations on running `dsv4 serve --enable-return-routing` instances at `rollout_urls`,
    whole groups dealt over them, the weights pushed to them over a weight-update group after
    every step: `rl/server_trainer.py`; `rollout_colocated`: the servers share the trainer's
    devices, so their KV pools and CUDA graphs are released while the trainer steps, as in Miles'
    colocated mode). Where the run executes does not change what it computes, so these may change
    on resume.
    `index_cache_dtype`: the rollout engine's indexer keys (`EngineConfig.index_cache_dtype`),
    and the trainer's models' indexers round theirs the same way
    (`DeepSeekV4ForCausalLM.set_index_cache_dtype`): its own selections (replay without
    "indexer") and the indexer's scores are those of the rollouts. None: the engine's default
    for `device` and `kernel_backend` (`resolve_index_cache_dtype`), resolved once, so
    rl_config.json records the value (and rollout servers on their defaults agree with it)."""

    INVOCATION_FIELDS = INVOCATION_FIELDS       # (a class attribute, not a field)

    model: str
    out_dir: str
    task: str = "arithmetic"
    levels: tuple[int, ...] = (3, 4, 5, 6)
    algo: str = "grpo"
    group_size: int = 8
    prompts_per_step: int = 8
    steps: int = 50
    lr: float = 1e-5
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    temperature: float = 1.0
    max_tokens: int = 8
    eps_low: float = 0.2
    eps_high: float = 0.28
    tis: float | None = None
    mis: tuple[float, float] | None = None
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    overlong_buffer: int = 2
    max_resample_rounds: int = 4
    replay: str = "routing,indexer"
    true_on_policy: bool | None = None
    formulation: str = "serving"
    kernel_values: bool = True
    eval_every: int = 10
    save_every: int = 10
    eval_per_level: int = 50
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    kernel_backend: str = "ref"
    weight_format: str = "bf16"
    time_limit_s: float | None = None
    max_steps_this_call: int | None = None
    placement: str = "local"
    sync_bucket_mb: float = 256.0
    rollout_urls: tuple[str, ...] = ()
    rollout_colocated: bool = False
    activation_checkpointing: bool = False
    index_cache_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.true_on_policy is None:     # resolved once, so rl_config.json records the value
            object.__setattr__(self, "true_on_policy", self.values_from_kernels)
        if self.index_cache_dtype is None:  # the same
            object.__setattr__(self, "index_cache_dtype", resolve_index_cache_dtype(
                None, self.device.split(":")[0], self.kernel_backend))  # type: ignore[arg-type]
        if self.task not in TASKS:
            raise ValueError(f"task={self.task!r} is unknown; allowed: {sorted(TASKS)}")
        if self.algo not in ALGOS:
            raise ValueError(f"algo={self.algo!r} is unknown; allowed: {list(ALGOS)}")
        if self.replay not in REPLAYS:
            raise ValueError(f"replay={self.replay!r} is invalid; allowed: {list(REPLAYS)}")
        if self.index_cache_dtype not in INDEX_CACHE_DTYPES:
            raise ValueError(f"index_cache_dtype={self.index_cache_dtype!r} is invalid; allowed: "
                             f"{list(INDEX_CACHE_DTYPES)}")
        for name in ("group_size", "prompts_per_step", "steps", "max_tokens", "eval_every",
                     "save_every", "eval_per_level", "max_resample_rounds"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid; allowed: an integer >= 1")
        if self.group_size < 2:
            raise ValueError(f"group_size={self.group_size} is invalid for {self.algo}: "
                             "group-normalised advantages need >= 2 samples per prompt")
        for name in ("lr", "grad_clip", "temperature"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} is invalid; allowed: > 0")
        if not 0 < self.eps_low < 1 or self.eps_high < self.eps_low:
            raise ValueError(f"eps_low={self.eps_low}, eps_high={self.eps_high} are invalid; "
                             "allowed: 0 < eps_low < 1, eps_high >= eps_low")
        if self.tis is not None and self.tis <= 0:
            raise ValueError(f"tis={self.tis} is invalid; allowed: None or a clip C > 0")
        if self.mis is not None and not 0 < self.mis[0] < self.mis[1]:
            raise ValueError(f"mis={self.mis} is invalid; allowed: None or (lo, hi), 0 < lo < hi")
        if not 0 < self.overlong_buffer <= self.max_tokens:
            raise ValueError(f"overlong_buffer={self.overlong_buffer} is invalid; "
                             f"allowed: 1..max_tokens ({self.max_tokens})")
        for name in ("kl_coef", "entropy_coef", "weight_decay"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} is invalid; allowed: >= 0")
        if self.formulation not in ("serving", "training"):
            raise ValueError(f"formulation={self.formulation!r} is invalid; "
                             "allowed: 'serving', 'training'")
        if self.true_on_policy and self.formulation != "serving" and not self.values_from_kernels:
            raise ValueError("formulation='training' is invalid with true_on_policy on the ref "
                             "ops; allowed: 'serving' (the engine's formulation), or a fused "
                             "kernel backend with kernel_values (values from the kernels)")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype={self.dtype!r} is invalid; allowed: 'float32', 'bfloat16'")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement={self.placement!r} is unknown; "
                             f"allowed: {list(PLACEMENTS)}")
        if (self.placement == "servers") != bool(self.rollout_urls):
            raise ValueError(f"rollout_urls={list(self.rollout_urls)} with placement="
                             f"{self.placement!r} is invalid; allowed: placement 'servers' with "
                             "one server URL or more, no URLs with the other placements")
        if self.rollout_colocated and self.placement != "servers":
            raise ValueError(f"rollout_colocated=True with placement={self.placement!r} is "
                             "invalid; allowed: placement 'servers' (the 'local' and "
                             "'colocated' placements release their own engine's memory)")
        if not self.sync_bucket_mb > 0:
            raise ValueError(f"sync_bucket_mb={self.sync_bucket_mb} is invalid; allowed: > 0")

    @property
    def values_from_kernels(self) -> bool:
        """Whether the trainer takes its forward values from the engine's kernels."""
        return self.kernel_values and self.kernel_backend != "ref"

    @property
    def fixed_widths(self) -> bool:
        """Index rows of one width per layer: true on-policy on the `ref` ops, whose softmax depends
        on the row width (the triton kernels' does not)."""
        return bool(self.true_on_policy) and not self.values_from_kernels

    @property
    def sync_bucket_bytes(self) -> int:
        """The weight-sync bucket size in bytes (`sync_bucket_mb` MiB, at least one byte)."""
        return max(1, int(self.sync_bucket_mb * 2**20))

    @property
    def replay_routing(self) -> bool:
        return self.replay != "none"

    @property
    def replay_indexer(self) -> bool:
        return self.replay == "routing,indexer"

    @classmethod
    def _from_json(cls, d: dict[str, Any]) -> dict[str, Any]:
        d["levels"] = tuple(d.get("levels", ()))
        d["rollout_urls"] = tuple(d.get("rollout_urls", ()))
        if d.get("mis") is not None:
            d["mis"] = tuple(d["mis"])
        return d
