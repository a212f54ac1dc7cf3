"""`dsv4 train`: build the data recipe, train (resumable), and export a servable checkpoint.

    # tokenizer + train.bin / heldout.bin (offline recipe)
    dsv4 train data   --out DATA
    dsv4 train run    --data DATA --out RUN [--steps N --batch-size B ...] [--resume]
                      [--time-limit-s S]
    # official layout, FP8 linears + FP4 experts
    dsv4 train export --run RUN --data DATA --out MODEL
    # the model card's numbers (CPU, float32)
    dsv4 train eval   --model MODEL [--out eval.json]
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from dsv4.utils.logging import init_logger
from dsv4.utils.threads import use_cpu_threads

logger = init_logger(__name__)

# TrainConfig fields exposed as flags (name -> type); the rest keep their defaults.
_RUN_FLAGS: dict[str, type] = {
    "preset": str, "init_from": str, "seed": int, "steps": int, "batch_size": int, "seq_len": int,
    "lr": float, "warmup_steps": int, "weight_decay": float, "mtp_weight": float,
    "indexer_weight": float, "qat_start": float, "log_every": int, "eval_every": int,
    "eval_tokens": int, "ckpt_every": int, "device": str, "time_limit_s": float,
    "max_steps_this_call": int}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="pre-train a model on the offline data recipe (dsv4-tiny)")
    tsub = p.add_subparsers(dest="train_command", required=True)

    d = tsub.add_parser("data", help="build the tokenizer and token files from offline sources")
    d.add_argument("--out", required=True, type=Path)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--vocab-size", type=int, default=4096)
    d.set_defaults(func=run_data)

    r = tsub.add_parser("run", help="train (or resume) a run")
    r.add_argument("--data", required=True, type=Path,
                   help="directory written by `dsv4 train data`")
    r.add_argument("--out", required=True, type=Path,
                   help="run directory (state.pt, metrics.jsonl, loss.png)")
    r.add_argument("--resume", action="store_true",
                   help="continue the run in --out where it stopped")
    from dsv4.train.config import COMPILE_BACKENDS, TrainConfig

    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    for name, kind in _RUN_FLAGS.items():
        r.add_argument("--" + name.replace("_", "-"), type=kind, default=defaults[name])
    r.add_argument("--compile", action="store_true",
                   help="torch.compile each block of the training forward (same math)")
    r.add_argument("--compile-backend", default=defaults["compile_backend"],
                   choices=list(COMPILE_BACKENDS),
                   help="torch.compile backend for --compile (aot_eager / eager: captured graphs "
                        "without code generation)")
    r.set_defaults(func=run_train)

    e = tsub.add_parser("export", help="write a run's weights as a servable checkpoint")
    e.add_argument("--run", required=True, type=Path)
    e.add_argument("--data", required=True, type=Path)
    e.add_argument("--out", required=True, type=Path)
    e.add_argument("--quant", default="fp8+fp4", choices=["none", "fp8", "fp8+fp4"])
    e.set_defaults(func=run_export)

    v = tsub.add_parser("eval", help="measure a checkpoint's model-card numbers "
                                     "(held-out loss, MTP, task accuracy)")
    v.add_argument("--model", required=True, type=Path,
                   help="checkpoint directory with heldout.bin (as exported)")
    v.add_argument("--out", type=Path, default=None,
                   help="write the JSON here (default: print it)")
    v.add_argument("--heldout-tokens", type=int, default=32768,
                   help="held-out tokens scored (windows of 2048)")
    v.add_argument("--per-level", type=int, default=50,
                   help="held-out problems per difficulty level")
    v.add_argument("--device", default="cpu")
    v.set_defaults(func=run_eval)


def run_data(args: argparse.Namespace) -> int:
    from dsv4.train.data import prepare_data

    meta = prepare_data(args.out, seed=args.seed, vocab_size=args.vocab_size)
    logger.info("data ready in %s: %s", args.out, meta)
    return 0


def run_train(args: argparse.Namespace) -> int:
    from dsv4.train.config import TrainConfig
    from dsv4.train.plot import plot_losses
    from dsv4.train.trainer import open_run

    config = TrainConfig(data_dir=str(args.data), out_dir=str(args.out), compile=args.compile,
                         compile_backend=args.compile_backend,
                         **{name: getattr(args, name) for name in _RUN_FLAGS})
    if config.device == "cpu":
        use_cpu_threads()
    trainer = open_run(config, resume=args.resume)
    last = trainer.run()
    logger.info("stopped at step %d/%d: %s", trainer.step, config.steps, last)
    try:
        plot_losses(args.out / "metrics.jsonl", args.out / "loss.png", config.tokens_per_step)
    except RuntimeError as err:
        logger.warning("no loss plot: %s", err)
    return 0


def run_export(args: argparse.Namespace) -> int:
    from dsv4.train.export import export_run

    export_run(args.run, args.data, args.out, weight_quant=args.quant)
    return 0


def run_eval(args: argparse.Namespace) -> int:
    import json
    import sys

    from dsv4.train.evaluate import evaluate_checkpoint

    result = evaluate_checkpoint(args.model, args.model / "heldout.bin",
                                 max_tokens=args.heldout_tokens, per_level=args.per_level,
                                 device=args.device)
    text = json.dumps(result, indent=2)
    if args.out is None:
        sys.stdout.write(text + "\n")
    else:
        args.out.write_text(text + "\n")
        logger.info("wrote %s", args.out)
    return 0
