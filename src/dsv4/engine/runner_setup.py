"""What a `ModelRunner` settles before it allocates anything: the `EngineConfig` resolved for its
device (`resolve`: kernel backend, KV budget, warmup, SWA share, overlap, multi-stream), HiSparse's
hot entries and host-memory check, and the serving model's projection fusion and decode GEMV
counters (`fuse_for_serving`: `model/fused_projections.py`, `model/decode_gemv.py`,
`EngineConfig.fuse_projections` / `decode_gemv`; neither in the invariant modes).
"""

from __future__ import annotations

import dataclasses

import torch

from dsv4.cache.hisparse import HiSparseLayout
from dsv4.config.engine import EngineConfig
from dsv4.config.engine_defaults import (
    kv_budget_gb,
    resolve_hisparse_entries,
    resolve_index_cache_dtype,
    resolve_kernel_backend,
    resolve_multi_stream,
    resolve_overlap,
    resolve_pdl_early_max_batch,
    resolve_shared_expert_beside_max_tokens,
    resolve_swa_fraction,
    resolve_warmup,
)
from dsv4.config.model import ModelConfig
from dsv4.model.decode_gemv import attach_decode_gemv
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.model.fused_projections import fuse_projections, unfuse_projections
from dsv4.model.quant_experts import QuantExperts
from dsv4.model.quant_linear import QuantLinear
from dsv4.utils.host_memory import available_host_bytes
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)


def resolve(config: EngineConfig, device: torch.device, model: DeepSeekV4ForCausalLM
            ) -> EngineConfig:
    """`config` with its device- and model-dependent defaults resolved (logged): the kernel
    backend and, unless `max_total_tokens` fixes the pools, the KV budget; the warmup mode,
    overlap scheduling, multi-stream, PDL's EARLY graph buckets (by whether `model` holds FP8
    linears), what the shared expert runs beside (by its routed experts' format) and the
    indexer keys' format (`config/engine_defaults.py`)."""
    backend = resolve_kernel_backend(config.kernel_backend, device.type)
    budget = config.kv_cache_memory_gb
    if config.max_total_tokens is None:
        total = used = 0
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            used = torch.cuda.memory_allocated(device)
        budget = kv_budget_gb(config, device.type, total, used)
        logger.info("KV budget %.2f GB (%s)", budget,
                    "kv_cache_memory_gb" if config.kv_cache_memory_gb is not None else
                    f"mem_fraction_static {config.mem_fraction_static} of {total / 2**30:.1f} GB,"
                    f" {used / 2**30:.1f} GB in use" if device.type == "cuda" else "CPU default")
    warmup = resolve_warmup(config.warmup, device.type, backend)
    overlap = resolve_overlap(config.overlap_schedule, device.type, config.speculative_num_steps)
    fp8 = any(isinstance(m, QuantLinear) for m in model.modules())
    early = resolve_pdl_early_max_batch(config.pdl_early_max_batch, fp8)
    if device.type == "cuda":
        logger.info("PDL EARLY mode: decode graphs of up to %d requests (%s)", early,
                    "pdl_early_max_batch" if config.pdl_early_max_batch is not None else
                    "FP8 linears" if fp8 else "float linears")
    multi_stream = resolve_multi_stream(config.multi_stream, device.type)
    quant = any(isinstance(m, QuantExperts) for m in model.modules())
    beside = resolve_shared_expert_beside_max_tokens(config.shared_expert_beside_max_tokens, quant)
    if multi_stream:
        logger.info("shared expert beside the routed experts in forwards of up to %d tokens (%s)",
                    beside, "shared_expert_beside_max_tokens"
                    if config.shared_expert_beside_max_tokens is not None else
                    "checkpoint-format routed experts" if quant else "float routed experts")
    index = resolve_index_cache_dtype(config.index_cache_dtype, device.type, backend)
    logger.info("indexer keys: %s (%s)", index, "index_cache_dtype"
                if config.index_cache_dtype is not None else f"{device.type}, {backend} backend")
    return dataclasses.replace(config, kernel_backend=backend, kv_cache_memory_gb=budget,
                               index_cache_dtype=index,
                               warmup=warmup, swa_memory_fraction=resolve_swa_fraction(
                                   config.swa_memory_fraction, device.type),
                               overlap_schedule=overlap, multi_stream=multi_stream,
                               pdl_early_max_batch=early,
                               shared_expert_beside_max_tokens=beside)


def hot_entries(config: EngineConfig, model: ModelConfig) -> int | None:
    """HiSparse's hot entries per request and C4 layer (None: HiSparse off); raises naming the
    flag for a model without C4 layers or too few entries."""
    if not config.enable_hisparse:
        return None
    if "csa" not in model.attn_types:
        raise ValueError("enable_hisparse=True needs a model with C4 (csa) attention layers; "
                         "this one has none (allowed: enable_hisparse=False)")
    return resolve_hisparse_entries(config, model.index_topk)


def check_host_memory(layout: HiSparseLayout, dtype: torch.dtype) -> None:
    """Raise naming the knobs when the host mirror would not fit the host's available memory."""
    need, free = layout.pool_bytes(dtype)[1], available_host_bytes()
    if need > free:
        raise ValueError(f"enable_hisparse=True: the host mirror needs {need / 2**30:.2f} GB and "
                         f"the host has {free / 2**30:.2f} GB available; allowed: a smaller KV "
                         "cache (max_total_tokens / kv_cache_memory_gb / context_length)")


def fuse_for_serving(model: DeepSeekV4ForCausalLM, config: EngineConfig) -> int:
    """Fuse the model's projection groups for serving (`model/fused_projections.py`), or undo a
    fusion when this engine runs unfused: off by `fuse_projections`, or in an invariant mode,
    where a token's bits must equal those of the trainer's unfused full-sequence forward. Logged;
    returns the number of fused groups."""
    why_not = ("fuse_projections=False" if not config.fuse_projections else
               "invariant_plans: a token's bits match the unfused full-sequence forward"
               if config.invariant_plans else
               "batch_invariant: a token's bits match the unfused full-sequence forward"
               if config.batch_invariant else None)
    invariant = config.invariant_plans or config.batch_invariant
    sites = attach_decode_gemv(model, config.decode_gemv and not invariant)
    logger.info("decode GEMV (one-launch split-K projections): %s", f"{sites} call sites"
                if sites else "off (decode_gemv=False)" if not config.decode_gemv else
                "off (an invariant mode)" if invariant else "off (no 16-bit projections)")
    if why_not is not None:
        unfuse_projections(model)
        logger.info("fused projections: off (%s)", why_not)
        return 0
    # with multi-stream branches the indexer's query projection runs beside wq_b (side stream)
    device = next(model.parameters()).device
    multi = resolve_multi_stream(config.multi_stream, device.type)
    groups = fuse_projections(model, query_group=not multi)
    attach_decode_gemv(model, config.decode_gemv)           # the new groups' counters
    logger.info("fused projections: %d groups of projections that read one input run as one GEMM "
                "each%s", groups, " (wq_b and the indexer's wq_b apart: multi-stream)" if multi
                else "")
    return groups
