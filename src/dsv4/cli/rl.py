"""`dsv4 rl`: verified RL on the engine's own rollouts (GRPO / DAPO), its plot and its export.

    dsv4 rl run    --model PATH --task arithmetic --algo grpo|dapo --group-size G
                   --prompts-per-step P --steps N [--tis C] [--mis lo,hi]
                   [--replay routing,indexer|routing|none] [--[no-]true-on-policy] --out runs/rl
                   [--resume] [--time-limit-s S]
                   [--placement local|colocated|disaggregated|servers] [--sync-bucket-mb MB]
                   [--rollout-url URL ...]
    dsv4 rl plot   --run runs/rl [--out rl.png]
    dsv4 rl export --run runs/rl --out MODEL [--quant fp8+fp4]   # then: dsv4 serve --model MODEL
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from dsv4.rl.config import RLConfig
from dsv4.utils.logging import init_logger
from dsv4.utils.threads import use_cpu_threads

logger = init_logger(__name__)

# RLConfig fields exposed as plain flags (name -> type); levels, mis, replay are parsed below.
_RUN_FLAGS: dict[str, type] = {
    "task": str, "algo": str, "group_size": int, "prompts_per_step": int, "steps": int,
    "lr": float, "temperature": float, "max_tokens": int, "eps_low": float, "eps_high": float,
    "tis": float, "kl_coef": float, "entropy_coef": float, "overlong_buffer": int,
    "eval_every": int, "save_every": int, "eval_per_level": int, "seed": int, "dtype": str,
    "device": str, "kernel_backend": str, "weight_format": str, "formulation": str,
    "time_limit_s": float, "max_steps_this_call": int, "sync_bucket_mb": float,
    "index_cache_dtype": str}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rl", help="RL-train a model on verifiable tasks with the engine's "
                                  "rollouts (GRPO / DAPO, routing replay)")
    rsub = p.add_subparsers(dest="rl_command", required=True)
    r = rsub.add_parser("run", help="run (or resume) an RL run")
    r.add_argument("--model", type=Path, default=None,
                   help="checkpoint directory (default: the embedded dsv4-tiny)")
    r.add_argument("--out", required=True, type=Path, help="run directory")
    r.add_argument("--resume", action="store_true", help="continue the run in --out")
    r.add_argument("--levels", default=None, help="curriculum, e.g. 3-6 or 3,4 (task levels)")
    r.add_argument("--mis", default=None, help="lo,hi: mask tokens whose ratio leaves [lo, hi]")
    r.add_argument("--replay", default="routing,indexer",
                   help="recorded selections to replay: routing,indexer | routing | none")
    r.add_argument("--true-on-policy", action=argparse.BooleanOptionalAction, default=None,
                   help="batch-invariant engine and trainer: bit-identical log-probs (default: "
                        "on with a fused kernel backend and kernel values, off on ref)")
    r.add_argument("--no-kernel-values", action="store_true",
                   help="the trainer's forward values from its formulation, not from the "
                        "engine's kernels (see RLConfig.kernel_values)")
    r.add_argument("--placement", default="local",
                   help="where trainer and engine run: local (this process, the default) | "
                        "colocated (one Ray actor) | disaggregated (a trainer actor and a "
                        "rollout actor; bucketed weight broadcast): needs dsv4[rl] (Ray) | "
                        "servers (rollouts on running `dsv4 serve --enable-return-routing` "
                        "instances: --rollout-url)")
    r.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block's activations in the trainer's backward (less "
                        "memory, a second forward; the same values)")
    r.add_argument("--rollout-colocated", action="store_true",
                   help="--placement servers on the trainer's devices: the servers release "
                        "their KV pools while the trainer steps")
    r.add_argument("--rollout-url", dest="rollout_urls", action="append", default=[],
                   metavar="URL", help="a rollout server of --placement servers (repeat for "
                                       "several; whole groups are dealt over them)")
    defaults = {f.name: f.default for f in dataclasses.fields(RLConfig)}
    for name, kind in _RUN_FLAGS.items():
        r.add_argument("--" + name.replace("_", "-"), type=kind, default=defaults[name])
    r.set_defaults(func=run_rl)

    pl = rsub.add_parser("plot", help="draw reward, held-out accuracy and drift curves")
    pl.add_argument("--run", required=True, type=Path)
    pl.add_argument("--out", type=Path, default=None, help="PNG path (default: RUN/rl.png)")
    pl.set_defaults(func=run_plot)

    e = rsub.add_parser("export", help="write the trained policy as a servable checkpoint")
    e.add_argument("--run", required=True, type=Path)
    e.add_argument("--out", required=True, type=Path)
    e.add_argument("--quant", default="fp8+fp4", choices=["none", "fp8", "fp8+fp4"])
    e.set_defaults(func=run_export)


def _mis(text: str | None) -> tuple[float, float] | None:
    if text is None:
        return None
    parts = text.split(",")
    try:
        lo, hi = (float(x) for x in parts)
    except ValueError:
        raise ValueError(f"--mis={text!r} is invalid; allowed: 'lo,hi', e.g. 0.5,2") from None
    return lo, hi


def config_from_args(args: argparse.Namespace) -> RLConfig:
    from dsv4.assets import default_model_path
    from dsv4.rl.rewards import parse_levels

    fields = {name: getattr(args, name) for name in _RUN_FLAGS}
    if args.levels is not None:
        fields["levels"] = parse_levels(args.levels)
    model = args.model if args.model is not None else default_model_path()
    return RLConfig(model=str(model), out_dir=str(args.out), mis=_mis(args.mis),
                    replay=args.replay, true_on_policy=args.true_on_policy,
                    kernel_values=not args.no_kernel_values, placement=args.placement,
                    rollout_urls=tuple(args.rollout_urls),
                    rollout_colocated=args.rollout_colocated,
                    activation_checkpointing=args.activation_checkpointing, **fields)


def run_rl(args: argparse.Namespace) -> int:
    from dsv4.rl.placement import run_placed

    config = config_from_args(args)
    if config.device == "cpu":
        use_cpu_threads()
    step, last = run_placed(config, resume=args.resume)
    logger.info("stopped at step %d/%d: %s", step, config.steps, last)
    _plot(args.out, args.out / "rl.png")
    return 0


def _plot(run: Path, out: Path) -> None:
    from dsv4.rl.plot import plot_run

    try:
        plot_run(run / "metrics.jsonl", out)
    except RuntimeError as err:
        logger.warning("no plot: %s", err)


def run_plot(args: argparse.Namespace) -> int:
    _plot(args.run, args.out or args.run / "rl.png")
    return 0


def run_export(args: argparse.Namespace) -> int:
    from dsv4.rl.export import export_policy

    export_policy(args.run, args.out, weight_quant=args.quant)
    return 0
