"""The engine's device- and model-dependent defaults: what an `EngineConfig` field left None (or
a budget left unset) resolves to on a given device, backend or model. The runner applies them at
start (`engine/runner_setup.py::resolve`); the CLI and the benchmarks call them to report or plan
with the same values."""

from __future__ import annotations

from dsv4.config.engine import EngineConfig, IndexCacheDtype, KernelBackend, WarmupMode

HISPARSE_ENTRIES_PER_TOPK = 2
"""`hisparse_device_entries` when not given, in units of the model's `index_topk`: the picks of
one decode step plus as many again, so entries picked in recent steps stay hot."""


def resolve_hisparse_entries(config: EngineConfig, index_topk: int) -> int:
    """The hot entries per request and C4 layer of an engine with `enable_hisparse`: the given
    `hisparse_device_entries`, else `HISPARSE_ENTRIES_PER_TOPK * index_topk`, at least
    (speculative_num_steps + 1) * index_topk (a verify pass's picks then fit the hot set, so it
    attends through `select` like a decode step). Raises naming the field when fewer than
    `index_topk` (a query's picks could not all be hot at once)."""
    entries = config.hisparse_device_entries
    if entries is None:
        per_topk = max(HISPARSE_ENTRIES_PER_TOPK, config.speculative_num_steps + 1)
        return per_topk * index_topk
    if entries < index_topk:
        raise ValueError(f"hisparse_device_entries={entries} is invalid; allowed: an integer >= "
                         f"the model's index_topk={index_topk} (every pick of one query must be "
                         "hot at once)")
    return entries


CPU_KV_CACHE_GB = 4.0
"""The KV budget off CUDA when neither `kv_cache_memory_gb` nor `max_total_tokens` is given."""


def resolve_kernel_backend(requested: KernelBackend | None, device_type: str) -> KernelBackend:
    """The kernel backend an engine on `device_type` runs: the requested one, else `triton` on
    CUDA (fused kernels, CUDA graphs) and `ref` elsewhere (the PyTorch reference)."""
    if requested is not None:
        return requested
    return "triton" if device_type == "cuda" else "ref"


def resolve_index_cache_dtype(requested: IndexCacheDtype | None, device_type: str,
                              backend: KernelBackend) -> IndexCacheDtype:
    """The indexer-key format an engine runs: the requested one, else "fp8" on CUDA with the
    `triton` backend (half the indexer's bytes, FP8 tensor-core scores; measured in
    benchmarks/results/serving_h200_202612.md) and "model" elsewhere (the reference's float
    keys)."""
    if requested is not None:
        return requested
    return "fp8" if device_type == "cuda" and backend == "triton" else "model"


CUDA_SWA_MEMORY_FRACTION = 0.25
"""`swa_memory_fraction` on CUDA when not given: a quarter of the KV budget lets a 60 GB budget
keep the window state of about 6,000 cached prefixes at V4-Flash geometry (2.5 MB per SWA page
of 256 tokens with its rings), while the full pool keeps the rest for long contexts."""


def resolve_swa_fraction(requested: float | None, device_type: str) -> float:
    """The `swa_memory_fraction` an engine on `device_type` plans with (EngineConfig)."""
    if requested is not None:
        return requested
    return CUDA_SWA_MEMORY_FRACTION if device_type == "cuda" else 0.0


def resolve_overlap(requested: bool | None, device_type: str, speculative_num_steps: int) -> bool:
    """Whether an engine schedules with overlap (EngineConfig.overlap_schedule): as requested, else
    on CUDA without speculative decoding (the host's scheduling then hides behind the device's
    work) and off elsewhere (on the CPU the host is the device: nothing to hide)."""
    if requested is not None:
        return requested
    return device_type == "cuda" and speculative_num_steps == 0


PDL_EARLY_MAX_BATCH_FP8 = 8    # `resolve_pdl_early_max_batch`'s bound with FP8 linears
SHARED_BESIDE_MAX_TOKENS_QUANT = 8  # `resolve_shared_expert_beside_max_tokens`'s, quantized experts


def resolve_pdl_early_max_batch(requested: int | None, fp8_linears: bool) -> int:
    """The largest decode-graph batch captured in PDL's EARLY mode
    (EngineConfig.pdl_early_max_batch): as requested, else `PDL_EARLY_MAX_BATCH_FP8` for a model
    with FP8 linears (checkpoint precision) and 0 for float linears: EARLY speeds up the small
    decode steps of FP8 linears and slows those of bf16 ones on the H200 (the A/B:
    `benchmarks/results/quant_moe_h200_202612.md`, "Thirty-second session")."""
    if requested is not None:
        return requested
    return PDL_EARLY_MAX_BATCH_FP8 if fp8_linears else 0


def resolve_shared_expert_beside_max_tokens(requested: int | None, quant_experts: bool) -> int:
    """The largest forward (in tokens) whose shared expert runs beside the routed experts
    (EngineConfig.shared_expert_beside_max_tokens): as requested, else
    `SHARED_BESIDE_MAX_TOKENS_QUANT` for checkpoint-format routed experts, whose small-batch decode
    loops leave the memory system idle part of the time, and 0 for float ones, whose loops run
    near their byte floor, so a concurrent shared expert only contends (the A/B at batch 1 and
    32: `benchmarks/results/quant_moe_h200_202612.md`, "Thirty-third session")."""
    if requested is not None:
        return requested
    return SHARED_BESIDE_MAX_TOKENS_QUANT if quant_experts else 0


def resolve_multi_stream(requested: bool | None, device_type: str) -> bool:
    """Whether serving steps run their independent branches on a second CUDA stream
    (EngineConfig.multi_stream): as requested (True needs CUDA), else on CUDA."""
    if requested and device_type != "cuda":
        raise ValueError(f"multi_stream=True needs a CUDA device; this engine runs on "
                         f"{device_type!r} (allowed: multi_stream=False or None)")
    if requested is not None:
        return requested
    return device_type == "cuda"


def resolve_warmup(requested: WarmupMode | None, device_type: str,
                   backend: KernelBackend) -> WarmupMode:
    """The warmup an engine runs: the requested one, else "fast" on CUDA with the `triton`
    backend (Triton compiles and graph captures would otherwise stall the first requests) and
    "none" elsewhere (the `ref` backend compiles nothing and captures no graphs)."""
    if requested is not None:
        return requested
    return "fast" if device_type == "cuda" and backend == "triton" else "none"


def kv_budget_gb(config: EngineConfig, device_type: str, total_bytes: int,
                 used_bytes: int) -> float:
    """The KV budget in GB: `kv_cache_memory_gb` when given; on CUDA
    `mem_fraction_static * total - used` (total: the GPU's memory, used: what is allocated when
    the engine starts, i.e. the weights); elsewhere `CPU_KV_CACHE_GB`. Raises naming
    mem_fraction_static when the weights leave nothing."""
    if config.kv_cache_memory_gb is not None:
        return config.kv_cache_memory_gb
    if device_type != "cuda":
        return CPU_KV_CACHE_GB
    budget = config.mem_fraction_static * total_bytes - used_bytes
    if budget <= 0:
        raise ValueError(f"mem_fraction_static={config.mem_fraction_static} leaves no KV memory: "
                         f"{used_bytes / 2**30:.1f} GB are in use of {total_bytes / 2**30:.1f} "
                         "GB; allowed: a larger fraction, or kv_cache_memory_gb / "
                         "max_total_tokens")
    return budget / 2**30
