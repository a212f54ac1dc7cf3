"""`dsv4 serve`: the OpenAI-compatible server (flag names follow SGLang / vLLM where they have one).

Resolves every "auto" value here, at the edge, before building the frozen ServerConfig: the model
(the embedded default when `--model` is absent), its served name, device (cuda when available),
dtype (bfloat16 on cuda, float32 on cpu) and, on CPU, a small page size and KV budget and one
engine thread per core minus one for the API process. `--enable-return-routing` lets requests ask
for their routing (RL replay; the prefix cache is then off). `--speculative-num-steps N` turns on
MTP speculative decoding (the checkpoint must have an MTP block: checked here). `--enable-hisparse`
keeps the C4 attention entries in host memory (`EngineConfig.enable_hisparse`). Exits with the
server's status: 0 after SIGTERM / SIGINT, non-zero when the engine fails; 2 for an invalid flag.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any

from dsv4.config.engine import MAX_SPECULATIVE_STEPS, WARMUP_MODES, WEIGHT_FORMATS
from dsv4.config.engine_defaults import resolve_index_cache_dtype, resolve_kernel_backend
from dsv4.config.server import DTYPES, LOAD_FORMATS, ServerConfig
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)

CPU_KV_CACHE_GB = 0.5
CPU_MIN_PAGE_SIZE = 16


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a checkpoint over the OpenAI HTTP API")
    p.add_argument("--model", default=None,
                   help="checkpoint directory, or in-memory:PRESET (random weights of a preset's "
                        "geometry built in memory: micro, tiny, flash-4l, flash-43l-e16, flash; "
                        "default: the embedded model in dsv4/assets)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: from the path)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--device", default=None,
                   help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=list(DTYPES),
                   help="default: bfloat16 on cuda, float32 on cpu")
    _add_engine_args(p)
    _add_limit_args(p)
    p.set_defaults(func=run)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--max-running-requests", type=int, default=None,
                   help="decode batch limit (default 64)")
    g.add_argument("--context-length", type=int, default=None,
                   help="default: the model's max_position_embeddings")
    g.add_argument("--chunked-prefill-size", type=int, default=None,
                   help="token budget of one step (default 2048)")
    g.add_argument("--page-size", type=int, default=None,
                   help="KV page size (default: 256 on cuda, 16+ on cpu)")
    g.add_argument("--max-total-tokens", type=int, default=None, help="KV cache size in tokens")
    g.add_argument("--kv-cache-memory-gb", type=float, default=None,
                   help="KV budget when --max-total-tokens is unset")
    g.add_argument("--mem-fraction-static", type=float, default=None,
                   help="on cuda, the share of the GPU's memory for weights + KV pools when "
                        "--kv-cache-memory-gb and --max-total-tokens are unset (default 0.88)")
    g.add_argument("--swa-memory-fraction", type=float, default=None,
                   help="with the prefix cache on, the least share of the KV budget for "
                        "sliding-window pages (default: 0.25 on cuda, 0 on cpu)")
    g.add_argument("--kernel-backend", default=None,
                   help="kernel implementation (default: triton on cuda, ref on cpu)")
    g.add_argument("--weight-format", default=None, choices=WEIGHT_FORMATS,
                   help="bf16: dequantise FP4/FP8 weights at load (default); "
                        "checkpoint: keep routed experts in FP4 and the FP8 linears in FP8")
    g.add_argument("--load-format", default=None, choices=LOAD_FORMATS,
                   help="auto: read the checkpoint's weights (default); dummy: only its "
                        "config.json, random weights in memory (benchmarks; --seed seeds them)")
    g.add_argument("--disable-radix-cache", "--disable-prefix-cache", dest="disable_prefix_cache",
                   action="store_true", default=None, help="turn the radix prefix cache off")
    g.add_argument("--enable-return-routing", action="store_true", default=None,
                   help="let requests ask for their routing (return_routed_experts, "
                        "return_indexer_topk; RL replay): the engine captures routing and runs "
                        "without the prefix cache")
    g.add_argument("--batch-invariant", "--enable-deterministic-inference",
                   dest="batch_invariant", action="store_true", default=None,
                   help="a token's log-probs do not depend on its batch: batch-invariant GEMMs "
                        "and reductions (true on-policy RL rollouts; EngineConfig."
                        "batch_invariant; with --kernel-backend triton also --invariant-plans)")
    g.add_argument("--invariant-plans", action="store_true", default=None,
                   help="kernel launch plans that do not depend on the token count (the RL "
                        "trainer's kernel values; EngineConfig.invariant_plans)")
    g.add_argument("--disable-cuda-graph", action="store_true", default=None,
                   help="decode eagerly "
                        "(default: CUDA graphs on cuda with --kernel-backend triton)")
    g.add_argument("--cuda-graph-max-bs", type=int, default=None,
                   help="largest decode batch run as a CUDA graph (default 256)")
    g.add_argument("--disable-fused-projections", dest="fuse_projections", action="store_false",
                   default=None,
                   help="run each projection as its own GEMM (default: the projections that "
                        "read one input run as one GEMM per group)")
    g.add_argument("--disable-decode-gemv", dest="decode_gemv", action="store_false",
                   default=None,
                   help="run the decode projections through cuBLAS (default: one-launch "
                        "split-K GEMVs on the triton backend)")
    g.add_argument("--pdl-early-max-batch", type=int, default=None,
                   help="capture the decode graphs of batch buckets up to this size with PDL's "
                        "EARLY mode (default: 8 with FP8 linears, else 0; "
                        "EngineConfig.pdl_early_max_batch)")
    g.add_argument("--shared-expert-beside-max-tokens", type=int, default=None,
                   help="with multi-stream, run the shared expert beside the routed experts in "
                        "forwards of up to this many tokens, else beside the gate (default: 8 "
                        "with checkpoint-format experts, else 0; "
                        "EngineConfig.shared_expert_beside_max_tokens)")
    g.add_argument("--index-cache-dtype", choices=["model", "fp8"], default=None,
                   help="the CSA indexer-key pools: the model dtype, or FP8 codes with a scale "
                        "per key and FP8 index scores (half the indexer's bytes at long "
                        "context); default: fp8 on CUDA with the triton backend, else model "
                        "(EngineConfig.index_cache_dtype)")
    add_speculative_arg(g, default=None)
    add_overlap_arg(g)
    add_warmup_arg(g)
    add_hisparse_args(g)
    g.add_argument("--random-seed", "--seed", dest="seed", type=int, default=None,
                   help="engine sampling seed")
    g.add_argument("--tp-size", "--tp", dest="tp_size", type=int, default=None,
                   help="tensor-parallel ranks, one process each (default 1; GPU rank r: cuda:r)")
    g.add_argument("--ep-size", "--ep", dest="ep_size", type=int, default=None,
                   help="1, or the number of ranks: split the routed experts by id across them")
    g.add_argument("--dp-size", "--dp", dest="dp_size", type=int, default=None,
                   help="data-parallel attention ranks (default 1): each serves its own "
                        "requests with its own KV cache, the MoE runs over all ranks' tokens "
                        "(eager: with --disable-cuda-graph on cuda)")
    g.add_argument("--load-balance-method", default=None, choices=["shortest_queue",
                                                                   "cache_aware"],
                   help="which data-parallel rank takes a request: the one with the fewest "
                        "unfinished requests (default) or the one whose prefix cache likely "
                        "holds the most of its prompt")
    g.add_argument("--nnodes", type=int, default=None,
                   help="machines the ranks are spread over (default 1; ranks per node: "
                        "tp or dp size / nnodes)")
    g.add_argument("--node-rank", type=int, default=None,
                   help="this machine's index (default 0); node 0 serves HTTP and runs rank 0, "
                        "the others only run their ranks")
    g.add_argument("--dist-init-addr", default=None,
                   help="host:port of the rendezvous, the same on every node (with --nnodes)")
    g.add_argument("--dry-run", action="store_true",
                   help="print the per-rank memory plan (weights, KV pools, request state) and "
                        "exit, without loading weights")
    g.add_argument("--torch-threads", type=int, default=None,
                   help="intra-op threads of the engine process (default on cpu: one per core, "
                        "minus one for the API process; on cuda: torch's default)")


def _add_limit_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("admission and shutdown")
    g.add_argument("--max-waiting-requests", "--max-queued-requests", dest="max_waiting_requests",
                   type=int, default=None,
                   help="requests queued beyond --max-running-requests before 503 (default 1024)")
    g.add_argument("--max-request-bytes", type=int, default=None,
                   help="larger bodies get 413 (default 16 MiB)")
    g.add_argument("--shutdown-timeout", dest="shutdown_timeout_s", type=float, default=None,
                   help="seconds in-flight requests may finish after SIGTERM (default 10)")
    g.add_argument("--access-log", action="store_true", help="log every HTTP request")


def build_config(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig of the parsed flags, with every "auto" value resolved."""
    from dsv4.assets import default_model_path, is_random_weights
    from dsv4.checkpoint.source import is_in_memory, resolve_model_source

    model = Path(args.model) if args.model else default_model_path()
    if args.model and is_in_memory(args.model):
        model, args.load_format = resolve_model_source(args.model, args.load_format or "auto")
    if not (model / "config.json").is_file() or not (model / "tokenizer.json").is_file():
        raise ValueError(f"--model={str(model)!r} is invalid; allowed: a checkpoint directory "
                         "with config.json and tokenizer.json")
    device = args.device or ("cuda" if _has_cuda() else "cpu")
    dtype = args.dtype or ("float32" if device == "cpu" else "bfloat16")
    given = {name: getattr(args, name) for name in (
        "max_running_requests", "context_length", "chunked_prefill_size", "page_size",
        "max_total_tokens", "kv_cache_memory_gb", "mem_fraction_static", "swa_memory_fraction",
        "kernel_backend", "seed",
        "max_waiting_requests",
        "max_request_bytes", "shutdown_timeout_s", "torch_threads", "disable_prefix_cache",
        "weight_format", "load_format", "disable_cuda_graph", "cuda_graph_max_bs",
        "enable_return_routing", "batch_invariant", "invariant_plans",
        "speculative_num_steps", "overlap_schedule", "multi_stream", "warmup", "tp_size",
        "ep_size", "dp_size", "load_balance_method", "nnodes", "node_rank", "dist_init_addr",
        "enable_hisparse",
        "hisparse_device_entries", "fuse_projections", "decode_gemv", "pdl_early_max_batch",
        "shared_expert_beside_max_tokens", "index_cache_dtype")}
    engine_args: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    check_speculative(model, engine_args.get("speculative_num_steps", 0))
    engine_args["kernel_backend"] = resolve_kernel_backend(engine_args.get("kernel_backend"),
                                                           device)
    engine_args["index_cache_dtype"] = resolve_index_cache_dtype(
        engine_args.get("index_cache_dtype"), device, engine_args["kernel_backend"])
    if device == "cpu":
        engine_args.setdefault("page_size", _cpu_page_size(model))
        engine_args.setdefault("kv_cache_memory_gb", CPU_KV_CACHE_GB)
        # NOTE: the API process (HTTP, tokenizer, SSE) needs a core too; torch threads that
        # oversubscribe the cores stall each other at every parallel region (see
        # benchmarks/results/serving_cpu_202611.md)
        engine_args.setdefault("torch_threads", max(1, (os.cpu_count() or 2) - 1))
    name = args.served_model_name or _default_name(model, is_random_weights(model))
    return ServerConfig(model=str(model), served_model_name=name, dtype=dtype, device=device,
                        host=args.host, port=args.port, api_key=args.api_key,
                        access_log=args.access_log, **engine_args)


def run(args: argparse.Namespace) -> int:
    try:
        from dsv4.server.launch import serve
    except ImportError as e:
        logger.error("%s; install the server dependencies: pip install -e '.[server]'", e)
        return 2
    try:
        config = build_config(args)
        if args.dry_run:
            sys.stdout.write(dry_run(config) + "\n")
            return 0
        if config.node_rank > 0:
            from dsv4.engine.parallel_ranks import serve_node
            from dsv4.server.engine_process import rank_spec
            spec = rank_spec(config)        # validated before any rank starts
    except ValueError as e:
        logger.error("%s", e)
        return 2
    if config.node_rank > 0:           # no HTTP here: this node only runs its ranks
        return serve_node(spec)
    return serve(config)


def dry_run(config: ServerConfig) -> str:
    """The per-rank memory plan of `config` (`distributed/memory.py`), without loading weights.
    An unset KV size resolves as the engine would on this machine: on CUDA
    `mem_fraction_static` of the first GPU's memory less the planned weights."""
    import dataclasses

    import torch

    from dsv4.config.engine import EngineConfig
    from dsv4.config.engine_defaults import kv_budget_gb, resolve_swa_fraction
    from dsv4.config.model import ModelConfig
    from dsv4.distributed.memory import RankMemory, format_plan, plan_memory
    from dsv4.model.loader import resolve_dtype

    model, dtype, engine = (ModelConfig.from_hf(config.model), resolve_dtype(config.dtype),
                            config.engine_config)
    engine = dataclasses.replace(engine, swa_memory_fraction=resolve_swa_fraction(
        engine.swa_memory_fraction, config.device.split(":")[0]))

    def plan(e: EngineConfig) -> list[RankMemory]:
        return plan_memory(model, e, dtype, config.tp_size, config.ep_size > 1,
                           config.weight_format, config.dp_size)
    if engine.max_total_tokens is None and engine.kv_cache_memory_gb is None:
        if not torch.cuda.is_available():
            raise ValueError("--dry-run on cuda sizes the KV budget from the GPU's memory and no "
                             "GPU is visible; allowed: --kv-cache-memory-gb or "
                             "--max-total-tokens")
        one_page = dataclasses.replace(engine, max_total_tokens=engine.page_size)
        weights = plan(one_page)[0].weights
        total = torch.cuda.get_device_properties(0).total_memory
        engine = dataclasses.replace(engine, kv_cache_memory_gb=kv_budget_gb(
            engine, "cuda", total, weights))
    head = (f"{config.model}: tp_size {config.tp_size}, dp_size {config.dp_size}, ep_size "
            f"{config.ep_size}, {config.dtype}, "
            f"weights {config.weight_format}, page {engine.page_size}; activations, CUDA graphs "
            "and the CUDA context not included")
    return head + "\n" + format_plan(plan(engine))


def add_speculative_arg(g: argparse._ActionsContainer, default: int | None) -> None:
    """`--speculative-num-steps N` (shared by `dsv4 serve` and `dsv4 generate`)."""
    g.add_argument("--speculative-num-steps", type=speculative_steps, default=default,
                   metavar="N",
                   help="MTP speculative decoding: the checkpoint's MTP block drafts N tokens per "
                        "decode step and the model verifies them in one forward; greedy output "
                        f"is unchanged. 0..{MAX_SPECULATIVE_STEPS}; default 0 (off)")


def add_overlap_arg(g: argparse._ActionsContainer) -> None:
    """`--overlap-schedule` / `--no-overlap-schedule` (SGLang: `--disable-overlap-schedule`) and
    `--multi-stream` / `--no-multi-stream`; shared by `dsv4 serve` and `dsv4 generate`. Unset:
    the engine's default."""
    g.add_argument("--overlap-schedule", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule and launch step N + 1 while the device runs step N "
                        "(EngineConfig.overlap_schedule; default: on with CUDA and no "
                        "speculative decoding, off elsewhere)")
    g.add_argument("--disable-overlap-schedule", dest="overlap_schedule", action="store_false",
                   default=None, help="SGLang's name for --no-overlap-schedule")
    g.add_argument("--multi-stream", action=argparse.BooleanOptionalAction, default=None,
                   help="run a layer's independent branches (compressors and indexer, the shared "
                        "expert) on a second CUDA stream (EngineConfig.multi_stream; default: on "
                        "with CUDA unless --enable-hisparse)")


def add_warmup_arg(g: argparse._ActionsContainer) -> None:
    """`--warmup none|fast|full` (shared by `dsv4 serve` and `dsv4 generate`)."""
    g.add_argument("--warmup", default=None, choices=WARMUP_MODES,
                   help="compile kernels and capture decode graphs before serving: fast (a few "
                        "batch sizes) or full (every graph bucket); default fast on cuda with "
                        "triton, none elsewhere (EngineConfig.warmup)")


def add_hisparse_args(g: argparse._ActionsContainer) -> None:
    """`--enable-hisparse` and `--hisparse-device-entries N` (shared by `dsv4 serve` and
    `dsv4 generate`)."""
    g.add_argument("--enable-hisparse", action="store_true", default=None,
                   help="HiSparse: C4 attention entries in host memory, a hot set of them per "
                        "request on the device; greedy output is unchanged "
                        "(EngineConfig.enable_hisparse)")
    g.add_argument("--hisparse-device-entries", type=int, default=None, metavar="N",
                   help="hot entries per request and C4 layer, at least the model's index_topk "
                        "(default: 2 x index_topk, at least (speculative steps + 1) x)")


def speculative_steps(text: str) -> int:
    """argparse type of --speculative-num-steps: an integer in [0, MAX_SPECULATIVE_STEPS]."""
    try:
        steps = int(text)
    except ValueError:
        steps = -1
    if not 0 <= steps <= MAX_SPECULATIVE_STEPS:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; allowed: an integer in "
                                         f"[0, {MAX_SPECULATIVE_STEPS}] (0 = off)")
    return steps


def check_speculative(model: Path, steps: int) -> None:
    """Raise naming the flag when `steps` > 0 and the checkpoint has no MTP block (none in its
    config, or no `mtp.*` tensor: transformers drops the MTP layer when it saves)."""
    from dsv4.config.model import ModelConfig
    from dsv4.model.weights import checkpoint_keys, shard_files

    if steps == 0:
        return
    try:
        keys = checkpoint_keys(shard_files(model))
    except FileNotFoundError as e:
        raise ValueError(f"--model={str(model)!r} is invalid ({e}); allowed: a checkpoint "
                         "directory with its safetensors shards") from e
    has_mtp = (ModelConfig.from_hf(model).num_mtp_layers > 0
               and any(k.startswith("mtp.") for k in keys))
    if not has_mtp:
        raise ValueError(f"--speculative-num-steps={steps} needs a checkpoint with an MTP block; "
                         f"{str(model)!r} has none (allowed: 0, speculation off)")


def _default_name(model: Path, random_weights: bool) -> str:
    from dsv4.assets import ASSETS_DIR

    if random_weights:
        return f"dsv4-{model.name}-random"
    return f"dsv4-{model.name}" if model.parent == ASSETS_DIR else model.resolve().name


def _cpu_page_size(model: Path) -> int:
    """The smallest page (>= 16 tokens) that is a multiple of both compress ratios."""
    from dsv4.config.model import ModelConfig

    mc = ModelConfig.from_hf(model)
    step = math.lcm(mc.csa_ratio, mc.hca_ratio)
    return step * math.ceil(CPU_MIN_PAGE_SIZE / step)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
