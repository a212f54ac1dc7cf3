"""TrainConfig: the frozen knobs of one training run (`dsv4 train run`).

Built once at the edge (CLI flags or a run directory's `train_config.json`) and passed down. A run
directory stores the config it was started with; resuming reads it back, so a resumed run cannot
silently change its schedule. Only the `INVOCATION_FIELDS` (time limit, device, paths, `compile`
and its backend) may differ on resume: they say where, how long and how fast this invocation
runs, not what is trained.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv4.checkpoint.presets import PRESETS, get_preset
from dsv4.config.model import ModelConfig
from dsv4.utils.run_dir import RunConfig

# Fields that describe the invocation, not the run: free to change between resumed invocations.
INVOCATION_FIELDS = ("time_limit_s", "device", "max_steps_this_call", "data_dir", "out_dir",
                     "compile", "compile_backend")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


@dataclass(frozen=True)
class TrainConfig(RunConfig):
    """`preset`: model architecture (checkpoint/presets.py). `steps`: optimizer steps of the whole
    run (the cosine schedule spans them). `batch_size` x `seq_len` tokens per step. `mtp_weight`:
    weight of the MTP loss (spec §9). `indexer_weight`: weight of the indexer distillation KL
    (train/indexer_loss.py; trains only the indexer). `bias_update_rate`: aux-loss-free balancing
    step for routed gates (DeepSeek-V3: bias += rate * sign(mean - load)). `qat_start`: fraction
    of `steps` after which linears/experts run through FP8/FP4 fake quantisation (straight-through)
    so the shipped quantised checkpoint matches the trained weights; 1.0 disables. `init_from`: a
    checkpoint directory (e.g. an earlier stage's export) whose weights replace the initial ones.
    `time_limit_s`: stop this invocation (after saving) once its wall time exceeds it; resume
    continues. `compile`: torch.compile each decoder / MTP block (same math, fewer launches;
    evaluation stays eager). `compile_backend`: torch.compile's backend for it: "inductor" (the
    generated kernels), or "aot_eager" / "eager" (the captured graphs run by eager ops: graph
    capture and autograd without code generation, e.g. to check a step on a CPU quickly)."""

    INVOCATION_FIELDS = INVOCATION_FIELDS       # (a class attribute, not a field)

    data_dir: str
    out_dir: str
    preset: str = "tiny"
    init_from: str | None = None
    seed: int = 0
    steps: int = 2000
    batch_size: int = 16
    seq_len: int = 2048
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    mtp_weight: float = 0.3
    indexer_weight: float = 1.0
    bias_update_rate: float = 1e-3
    qat_start: float = 0.8
    log_every: int = 10
    eval_every: int = 500
    eval_tokens: int = 65536
    ckpt_every: int = 500
    device: str = "cpu"
    time_limit_s: float | None = None
    max_steps_this_call: int | None = None
    compile: bool = False
    compile_backend: str = "inductor"

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"preset={self.preset!r} is invalid; allowed: {sorted(PRESETS)}")
        for name in ("steps", "batch_size", "seq_len", "log_every", "eval_every", "eval_tokens",
                     "ckpt_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid; allowed: an integer >= 1")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} is invalid; "
                             "allowed: 0 <= warmup_steps < steps")
        for name in ("lr", "grad_clip"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} is invalid; allowed: > 0")
        for name in ("min_lr_ratio", "qat_start", "beta1", "beta2"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}={getattr(self, name)} is invalid; "
                                 "allowed: a value in [0, 1]")
        for name in ("weight_decay", "mtp_weight", "indexer_weight", "bias_update_rate"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} is invalid; allowed: >= 0")
        if self.compile_backend not in COMPILE_BACKENDS:
            raise ValueError(f"compile_backend={self.compile_backend!r} is invalid; "
                             f"allowed: {list(COMPILE_BACKENDS)}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device={self.device!r} is invalid; "
                             "allowed: 'cpu', 'cuda', 'cuda:N'")

    def model_config(self) -> ModelConfig:
        """The preset's architecture, its position limit raised to the training length if
        shorter."""
        preset = get_preset(self.preset)
        return preset.replace(max_position_embeddings=max(preset.max_position_embeddings,
                                                          self.seq_len))

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len
