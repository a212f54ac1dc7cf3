"""The pre-training loop of `dsv4 train run`: next-token + MTP loss, AdamW, warmup + cosine,
resume.

Owns `Trainer` (model, optimizer, balancer, QAT shadow, data stream, run directory) and
`lm_losses`. A run directory holds `train_config.json` (the run's frozen config), `state.pt`
(model, optimizer and step, written atomically), `metrics.jsonl` (one JSON object per logged step
/ evaluation) and `loss.png`. Batches depend only on (seed, step) (`TokenStream.batch`), and the
state holds everything else the next step reads, so an invocation stopped by its time limit and
resumed continues exactly where it stopped: on CPU the resumed losses equal the uninterrupted
run's bit for bit (tests/train/).

Named sync points: the loss/grad-norm read at `log_every` steps and the expert-load read of the
balancer (the training forward runs the dense MoE, which has none; evaluation runs the reference
MoE and its per-expert token counts). `compile` compiles each decoder / MTP block in place
(`_compile_blocks`); the embedding, head and losses stay eager, and evaluation runs every block
eagerly.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.model.forward_mode import INFERENCE, TRAINING, ForwardMode
from dsv4.train.balance import ExpertBalancer
from dsv4.train.config import INVOCATION_FIELDS, TrainConfig
from dsv4.train.data import TokenStream
from dsv4.train.indexer_loss import IndexerDistiller
from dsv4.train.init import init_weights
from dsv4.train.qat import QuantShadow
from dsv4.utils.logging import init_logger
from dsv4.utils.run_dir import append_metrics, save_state, truncate_metrics

logger = init_logger(__name__)

SHIPPED_QUANT = "fp8+fp4"   # the layout the trained model is exported in; QAT rounds to it


def lm_losses(model: DeepSeekV4ForCausalLM, tokens: torch.Tensor,
              mode: ForwardMode) -> dict[str, torch.Tensor]:
    """`tokens`: [B, S+1] -> {"loss": next-token CE, "mtp_loss": CE of token t+2 from position t
    (if MTP), "mtp_correct"/"mtp_count": top-1 hits of the MTP head} (scalars, not synced).
    `mode`: TRAINING for a step, INFERENCE for evaluation (model/forward_mode.py)."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    streams = model.forward_streams(inputs, mode)                              # [B, S, n, d]
    logits = model.logits(model.norm(model.hc_head(streams)))                  # [B, S, V] fp32
    out = {"loss": F.cross_entropy(logits.flatten(0, 1), targets.flatten())}
    if len(model.mtp) > 0:
        # position k: main streams at k + embedding of token k+1 -> predicts token k+2
        mtp = model.mtp_logits(streams[:, :-1], targets[:, :-1], mode=mode)    # [B, S-1, V]
        mtp_targets = tokens[:, 2:]
        out["mtp_loss"] = F.cross_entropy(mtp.flatten(0, 1), mtp_targets.flatten())
        out["mtp_correct"] = (mtp.argmax(-1) == mtp_targets).sum()
        out["mtp_count"] = torch.tensor(mtp_targets.numel(), device=tokens.device)
    return out


class Trainer:
    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.run_dir = Path(config.out_dir)
        self.device = torch.device(config.device)
        self.model_config = config.model_config()
        torch.manual_seed(config.seed)
        model = DeepSeekV4ForCausalLM(self.model_config)
        model.reset_buffers()
        init_weights(model, config.seed)
        if config.init_from is not None:
            _load_initial(model, Path(config.init_from))
        self.model = model.to(self.device).train()
        self.optimizer = self._optimizer()
        self.balancer = ExpertBalancer(self.model, self.model_config.n_routed_experts,
                                       config.bias_update_rate)
        self.shadow = QuantShadow(self.model, SHIPPED_QUANT)
        self.distiller = IndexerDistiller(self.model)
        if config.compile:
            _compile_blocks(self.model, config.compile_backend)
        self.stream = TokenStream(Path(config.data_dir), seed=config.seed)
        self.step = 0
        self.elapsed_s = 0.0   # training wall time of all invocations so far (excludes evaluation)

    # --- schedule and optimizer -------------------------------------------------------------
    def _optimizer(self) -> torch.optim.Optimizer:
        decay: list[torch.nn.Parameter] = []
        no_decay: list[torch.nn.Parameter] = []
        for name, p in self.model.named_parameters():
            (decay if p.dim() >= 2 and not name.endswith(".fn") else no_decay).append(p)
        groups = [{"params": decay, "weight_decay": self.config.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        fused = self.device.type == "cuda"
        return torch.optim.AdamW(groups, lr=self.config.lr,
                                 betas=(self.config.beta1, self.config.beta2), fused=fused)

    def lr_at(self, step: int) -> float:
        """Linear warmup to `lr`, then cosine to `lr * min_lr_ratio` at the last step."""
        c = self.config
        if step < c.warmup_steps:
            return c.lr * (step + 1) / c.warmup_steps
        progress = (step - c.warmup_steps) / max(1, c.steps - 1 - c.warmup_steps)
        return c.lr * (c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5
                       * (1 + math.cos(math.pi * min(1.0, progress))))

    def qat_active(self, step: int) -> bool:
        return step >= int(self.config.qat_start * self.config.steps)

    def _autocast(self) -> Any:
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast("cpu", enabled=False)

    # --- one step ---------------------------------------------------------------------------
    def train_step(self) -> dict[str, torch.Tensor]:
        """One optimizer step on batch `self.step`; returns unsynced scalars."""
        c = self.config
        tokens = self.stream.batch(self.step, c.batch_size, c.seq_len).to(self.device)
        lr = self.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.balancer.clear()
        with self.shadow.rounded(self.qat_active(self.step)):
            with self._autocast():
                losses = lm_losses(self.model, tokens, TRAINING)
            total = losses["loss"] + c.mtp_weight * losses.get("mtp_loss",
                                                               torch.zeros((), device=self.device))
            indexer_kl = self.distiller.take()
            if indexer_kl is not None:
                losses["indexer_kl"] = indexer_kl
                total = total + c.indexer_weight * indexer_kl
            total.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.balancer.update()
        self.step += 1
        return {**{k: v.detach() for k, v in losses.items()}, "grad_norm": grad_norm}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out next-token and MTP loss, MTP top-1 accuracy, through the weights as they would
        ship."""
        self.model.eval()
        sums = {"loss": 0.0, "mtp_loss": 0.0, "mtp_correct": 0.0, "mtp_count": 0.0}
        batches = self.stream.heldout_batches(self.config.seq_len, self.config.eval_tokens)
        # NOTE: eager even with `compile`: no-grad forwards (the reference MoE loop) would compile
        # graphs of their own
        with (self.shadow.rounded(self.qat_active(self.step)),
              torch.compiler.set_stance("force_eager")):
            for tokens in batches:
                with self._autocast():
                    losses = lm_losses(self.model, tokens.to(self.device), INFERENCE)
                for key in sums:
                    if key in losses:
                        sums[key] += float(losses[key])
        self.balancer.clear()
        self.model.train()
        n = max(1, len(batches))
        out = {"heldout_loss": sums["loss"] / n, "heldout_mtp_loss": sums["mtp_loss"] / n}
        if sums["mtp_count"]:
            out["heldout_mtp_acc"] = sums["mtp_correct"] / sums["mtp_count"]
        return out

    # --- the loop ---------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Train until `steps`, the time limit or `max_steps_this_call`; save; return the last
        metrics."""
        c = self.config
        start = time.perf_counter()
        stop_at = (c.steps if c.max_steps_this_call is None
                   else min(c.steps, self.step + c.max_steps_this_call))
        last: dict[str, Any] = {}
        bar = tqdm(total=c.steps, initial=self.step, desc="train", unit="step", disable=None)
        t0, s0 = time.perf_counter(), self.step
        while self.step < stop_at:
            out = self.train_step()
            bar.update(1)
            if self.step % c.log_every == 0 or self.step == stop_at:
                now = time.perf_counter()
                last = self._log_step(out, (self.step - s0) * c.tokens_per_step
                                      / max(1e-9, now - t0))
                bar.set_postfix(loss=f"{last['loss']:.3f}")
                t0, s0 = now, self.step
            if self.step % c.eval_every == 0 or self.step == c.steps:
                self.elapsed_s += time.perf_counter() - start
                last = self._log({"step": self.step, **self.evaluate()})
                start = time.perf_counter()
            if self.step % c.ckpt_every == 0:
                self.save()
            if (c.time_limit_s is not None
                    and time.perf_counter() - start + self.elapsed_s > c.time_limit_s):
                logger.info("time limit %.0f s reached at step %d; saving for resume",
                            c.time_limit_s, self.step)
                break
        bar.close()
        self.elapsed_s += time.perf_counter() - start
        self.save()
        return last

    def _log_step(self, out: dict[str, torch.Tensor], tok_per_s: float) -> dict[str, Any]:
        record: dict[str, Any] = {"step": self.step, "loss": float(out["loss"]),
                                  "lr": self.lr_at(self.step - 1),
                                  "grad_norm": float(out["grad_norm"]),
                                  "tok_per_s": round(tok_per_s, 1),
                                  "qat": self.qat_active(self.step - 1)}
        if "mtp_loss" in out:
            record["mtp_loss"] = float(out["mtp_loss"])
            record["mtp_acc"] = float(out["mtp_correct"]) / float(out["mtp_count"])
        if "indexer_kl" in out:
            record["indexer_kl"] = float(out["indexer_kl"])
        return self._log(record)

    def _log(self, record: dict[str, Any]) -> dict[str, Any]:
        append_metrics(self.run_dir, record)
        logger.info("%s", record)
        return record

    # --- persistence ------------------------------------------------------------------------
    def save(self) -> None:
        """Write state.pt atomically (temporary file + rename) and the run's config."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.config.save(self.run_dir / "train_config.json")
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "step": self.step, "elapsed_s": self.elapsed_s}
        save_state(self.run_dir, state)

    def load(self) -> None:
        """Restore state.pt and drop metrics logged after it (the resumed run logs them again,
        identically)."""
        state = torch.load(self.run_dir / "state.pt", map_location=self.device, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.elapsed_s = int(state["step"]), float(state["elapsed_s"])
        truncate_metrics(self.run_dir, self.step)


def _compile_blocks(model: DeepSeekV4ForCausalLM, backend: str) -> None:
    """torch.compile every decoder and MTP block in place (regional compilation). Each block's
    training forward is one graph (dense training MoE, fixed-size expert counts in the balancer
    hook, masked-mean indexer loss: no data-dependent shapes); blocks share code, so Inductor's
    cache serves repeated structures and compilation is shorter than for the whole forward as one
    graph (benchmarks/results/train_tiny_h200_202611.md). Parameter names and state_dict are
    unchanged. Static shapes (`dynamic=False`): a step's shapes never change, and the first block's
    input (the embedding expanded over the streams) has other strides than the later blocks',
    which would otherwise make the later graphs' strides symbolic."""
    for block in list(model.layers) + list(model.mtp):
        block.compile(dynamic=False, backend=backend)


def _load_initial(model: DeepSeekV4ForCausalLM, path: Path) -> None:
    """Start from the weights of the checkpoint at `path` (same architecture; dequantised to
    fp32)."""
    from dsv4.model.loader import load_model

    source = load_model(path, dtype="float32", device="cpu")
    if (source.config.replace(max_position_embeddings=1, weight_quant="none")
            != model.config.replace(max_position_embeddings=1, weight_quant="none")):
        raise ValueError(f"init_from={str(path)!r} has another architecture than the run's preset")
    model.load_state_dict(source.state_dict())
    logger.info("initial weights from %s", path)


def open_run(config: TrainConfig, resume: bool) -> Trainer:
    """A Trainer for `config.out_dir`: fresh (refusing to overwrite an existing run) or resumed
    from it."""
    run_dir = Path(config.out_dir)
    saved = run_dir / "train_config.json"
    if resume:
        if not (run_dir / "state.pt").exists():
            raise FileNotFoundError(f"--resume: no state.pt in {run_dir}")
        previous = TrainConfig.from_dict(json.loads(saved.read_text()))
        changed = previous.changed_fields(config)
        if changed:
            raise ValueError(f"--resume: {changed} differ from the run's train_config.json; only "
                             f"{', '.join(INVOCATION_FIELDS)} may change")
        trainer = Trainer(config)
        trainer.load()
        return trainer
    if (run_dir / "state.pt").exists():
        raise FileExistsError(f"{run_dir} already holds a run; "
                              "pass --resume or choose another --out")
    return Trainer(config)
