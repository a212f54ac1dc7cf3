"""EngineConfig: the frozen knobs of the serving engine (pages, batch limits, budgets, backend).

Built once at the edge (`LLM(...)` keyword arguments or CLI flags) and passed down. Sizes that
depend on the model are resolved by `cache/layout.py`, never by mutating this object; the fields
left None resolve by device, backend and model in `config/engine_defaults.py` (the `resolve_*`
functions named below).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

KernelBackend = Literal["ref", "triton"]
"""Kernel backends (`kernels/registry.py`): `ref` is the PyTorch spec, `triton` the fast kernels."""
KERNEL_BACKENDS: tuple[KernelBackend, ...] = get_args(KernelBackend)

WeightFormat = Literal["bf16", "checkpoint"]
"""How routed experts are held once loaded: "bf16" dequantises them to the model dtype,
"checkpoint" keeps their FP4 codes and scales (`model/quant_experts.py`)."""
WEIGHT_FORMATS: tuple[WeightFormat, ...] = get_args(WeightFormat)


def check_weight_format(weight_format: str) -> WeightFormat:
    """`weight_format` as a `WeightFormat`; raises naming the allowed values otherwise."""
    for name in WEIGHT_FORMATS:
        if weight_format == name:
            return name
    raise ValueError(f"weight_format={weight_format!r} is invalid; "
                     f"allowed: {list(WEIGHT_FORMATS)}")


IndexCacheDtype = Literal["model", "fp8"]
INDEX_CACHE_DTYPES: tuple[IndexCacheDtype, ...] = get_args(IndexCacheDtype)
WarmupMode = Literal["none", "fast", "full"]
"""What `warm_up` (`engine/warmup.py`) runs before the engine serves (`warmup_plan`)."""
WARMUP_MODES: tuple[WarmupMode, ...] = get_args(WarmupMode)


def check_warmup(warmup: str) -> WarmupMode:
    """`warmup` as a `WarmupMode`; raises naming the field and the allowed values otherwise."""
    for name in WARMUP_MODES:
        if warmup == name:
            return name
    raise ValueError(f"warmup={warmup!r} is invalid; allowed: {list(WARMUP_MODES)}")


MAX_SPECULATIVE_STEPS = 8
"""Draft tokens per step at most: with rings of 2x, a verify step of N + 1 <= 9 tokens never
overwrites a compressor ring row that a later token still reads (C4: ring 16, window 8)."""


@dataclass(frozen=True)
class EngineConfig:
    """The serving engine's knobs.

    `page_size`: tokens per page, a multiple of every compress ratio (256 for real models).
    `max_running_requests`: decode batch limit. `chunked_prefill_size`: token budget of one step.
    `max_total_tokens`: full-token slots in the cache (None: from the KV budget).
    `kv_cache_memory_gb`: the KV budget; None: on CUDA `mem_fraction_static` of the GPU's memory
    less what is allocated when the engine starts (the weights), elsewhere `CPU_KV_CACHE_GB`
    (`kv_budget_gb`). `mem_fraction_static`: SGLang's meaning: the share of the GPU's memory for
    the static allocations, weights and KV pools; the rest is left to activations and graphs.
    `kernel_backend`: None picks `triton` on CUDA and `ref` elsewhere
    (`resolve_kernel_backend`).
    `swa_tokens`: sliding-window slots (None: planned from the KV budget, `cache/layout.py`).
    `swa_memory_fraction`: with the prefix cache on, the least share of the KV budget that goes to
    sliding-window pages (cached prefixes keep the window and compressor state at their ends
    there; running requests' own needs come first either way), and with a share > 0 the budget
    the full pool cannot use goes there too (`cache/layout.py`). None: 0.25 on CUDA, where the
    budget is the GPU's memory; 0 elsewhere, where it is a nominal cap and pools are allocated
    up front (`resolve_swa_fraction`). Ignored with `swa_tokens`.
    `context_length`: longest prompt + output (None: the model's `max_position_embeddings`).
    `capture_routing`: record routed expert ids and indexer top-k per token (RL replay).
    `batch_invariant`: compute every token as it would be computed alone and as the full-sequence
    forward computes it (matmuls and reductions under `kernels/ref/batch_invariant.py`): what true
    on-policy RL needs. CPU and CUDA (CUDA: the GEMMs, sums, means, softmax and logsumexp run as
    the fixed-tile Triton kernels of `kernels/triton/batch_invariant.py`). With the `ref` kernel
    backend, attention index rows have one width per layer (its softmax depends on the width) and
    steps run eagerly; with `triton` it needs `invariant_plans`, and CUDA graphs stay on.
    `invariant_plans`: kernels whose launch plans never depend on the token count of a step
    (`kernels/registry.py::create_kernels`), so a token's values do not depend on the batch it ran
    in: the RL default mode, where the trainer takes its forward values from the same kernels
    (`ForwardMode.values`). CUDA graphs stay on.
    `speculative_num_steps`: N draft tokens per decode step from the model's MTP block (0: off;
    at most `MAX_SPECULATIVE_STEPS`): the target verifies them in one forward of N + 1 tokens
    per request (`engine/spec_decode.py`).
    `ring_multiplier`: compressor ring sizes are (2*m, m') times this; None picks 2 under
    speculative decoding (draft tokens write compressor rings ahead of verification), else 1.
    `disable_prefix_cache`: turn off the radix prefix cache (`ShadowRadix`).
    `disable_cuda_graph`: run decode steps eagerly. Otherwise, on a CUDA device with the `triton`
    kernel backend, decode steps of up to `cuda_graph_max_bs` requests replay CUDA graphs
    (`engine/cuda_graph.py`); the `ref` backend syncs inside its MoE and is never captured (the
    runner logs which mode it runs).
    `overlap_schedule`: the host schedules and launches step N + 1 while the device runs step N,
    then resolves N (`LLMEngine.step`): decode inputs of N + 1 are gathered on the device from N's
    sampled tokens, so the host's scheduling hides behind the device's work. Greedy and seeded
    outputs are the same as without it. A step whose requests need N's tokens on the host first
    (a grammar mask, prompt log-probs) is scheduled after N resolves. Not with speculative
    decoding (its drafts and accepted counts come from the host). None: on with CUDA and no
    speculative decoding, where the host's share of a step is worth hiding (about 0.2 ms a step
    at batch 1 and 0.6-1.4 ms at batch 32 on flash-4l, H200), off elsewhere
    (`resolve_overlap`).
    `multi_stream`: a serving step runs the branches of a layer that do not depend on each other
    on a second CUDA stream, concurrently with the main one (`model/streams.py`): a CSA / HCA
    layer's compressors and indexer beside its query and window-KV path, the shared expert beside
    the gate and the routed experts. Inside CUDA graphs too (the fork and join are captured).
    Same kernels on the same inputs: outputs are bit-identical with it on and off. With HiSparse
    a CSA layer's HotSet work (mirror writes, plans, swap-ins) is part of the side branch, so it
    stays in program order on that stream. None: on with CUDA (`resolve_multi_stream`); True needs
    CUDA.
    `warmup`: what runs before the engine serves (`LLM(...)` returns, the server reports ready),
    so the first requests do not pay for Triton compiles and CUDA-graph captures: "none",
    "fast" (the prefill shapes and a few decode batch sizes) or "full" (every decode graph
    bucket, and the context buckets); `engine/warmup.py` lists the shapes. None picks "fast" on
    CUDA with the `triton` backend and "none" elsewhere (`resolve_warmup`).
    `enable_hisparse`: HiSparse (`cache/hisparse.py`): the C4 attention entries of every request
    live in a host mirror (pinned CPU memory on CUDA) instead of the device's entry pools, and
    each request keeps `hisparse_device_entries` of them per C4 layer hot on the device. The
    indexer keys stay on the device, so the selection is unchanged and greedy outputs equal
    those with it off. A step whose longest request feeds at most
    `hisparse_device_entries // index_topk` tokens (decode) attends through the hot sets (LRU;
    the picks that miss are copied in); a longer prefill chunk attends through its picks staged
    from the host mirror. The KV budget then holds no C4 entries; the hot sets are reserved from
    it (`cache/layout.py`). Supported with the prefix cache, chunked prefill, preemption, overlap
    scheduling, routing capture, batch-invariant mode, speculative decoding (a verify pass of
    N + 1 tokens attends through the hot sets when (N + 1) * index_topk fit) and the decode CUDA
    graphs (the `triton` backend reads and writes the pinned mirror in place, no host sync; with
    speculative decoding the hot sets must hold a verify pass's picks), on one device. Not
    supported (startup errors): tensor parallelism and data-parallel attention (`ServerConfig`).
    `hisparse_device_entries`: hot entries per request and C4 layer, at least the model's
    `index_topk` (every pick of one query is hot at once; checked when the engine starts).
    None: `HISPARSE_ENTRIES_PER_TOPK` times `index_topk`, at least (speculative_num_steps + 1)
    times. Only with `enable_hisparse`.
    `fuse_projections`: the serving path runs the projections that read one input as one GEMM
    (attention's wq_a | wkv | indexer weights_proj, wq_b | indexer wq_b, the fp32 compressor
    projections, the shared expert's w1 | w3: `model/fused_projections.py`), the parameters
    becoming views of the stacked weights (no extra memory; names and weight updates unchanged).
    Fewer launches per decode step; outputs equal to GEMM rounding. Not applied with
    `invariant_plans` or `batch_invariant` (a token's bits must match the unfused full-sequence
    forward; the runner logs it).
    `decode_gemv`: the serving path's 16-bit projections (attention, indexer, shared expert; the
    fused groups too) run, at up to 4 token rows, as one-launch skinny GEMMs with in-launch
    deterministic split-K on the triton backend (`model/decode_gemv.py`,
    `kernels/triton/gemv.py::triton_decode_linear`) instead of cuBLAS's split-K kernel plus its
    reduce. Outputs equal to GEMM rounding. Not applied in the invariant modes (as above).
    `pdl_early_max_batch`: decode graphs of batch buckets up to this size are captured with
    PDL's EARLY mode (`kernels/triton/pdl.py`: a kernel's dependents are scheduled while it runs),
    the larger ones in `DSV4_PDL`'s mode (WAIT by default); 0: every graph in DSV4_PDL's mode.
    None (default): `resolve_pdl_early_max_batch`, 8 for a model with FP8 linears, else 0. Same
    outputs either way (PDL changes when a kernel starts, not what it reads); each mode compiles
    its own kernel variants.
    `shared_expert_beside_max_tokens`: with `multi_stream`, the MoE layers of a forward of up to
    this many tokens run the shared expert on the side stream beside the routed experts (forked
    after the gate, joined before the combine: it fills the memory system that the routed
    experts' small-batch decode loops leave idle); larger forwards run it beside the gate (joined
    before the routed GEMMs). 0: always beside the gate. None (default):
    `resolve_shared_expert_beside_max_tokens`, 8 for checkpoint-format (FP4 / FP8) routed
    experts, else 0. Same kernels on the same inputs: the same outputs either way.
    `index_cache_dtype`: the CSA layers' indexer-key pools. "model": the model dtype. "fp8": e4m3
    codes with a power-of-two fp32 scale per key (128 + 4 bytes a key against 256 in bf16, as
    SGLang and vLLM store them; `kernels/ref/index_keys.py`), and the indexer's queries rounded
    to FP8 per head, so the scores run on FP8 tensor cores: at long context the indexer reads
    half the bytes. It changes the index scores (each key and query within half an e4m3 step),
    so the model's full-sequence indexer rounds the same way (`DeepSeekV4ForCausalLM.
    set_index_cache_dtype`): the engine and the full-sequence forward stay equivalent. None
    (default): `resolve_index_cache_dtype`, "fp8" on CUDA with the `triton` backend, else
    "model".
    """

    page_size: int = 256
    max_running_requests: int = 64
    chunked_prefill_size: int = 2048
    max_total_tokens: int | None = None
    swa_tokens: int | None = None
    swa_memory_fraction: float | None = None
    kv_cache_memory_gb: float | None = None
    mem_fraction_static: float = 0.88
    context_length: int | None = None
    kernel_backend: KernelBackend | None = None
    capture_routing: bool = False
    batch_invariant: bool = False
    invariant_plans: bool = False
    speculative_num_steps: int = 0
    ring_multiplier: int | None = None
    disable_prefix_cache: bool = False
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 256
    overlap_schedule: bool | None = None
    multi_stream: bool | None = None
    warmup: WarmupMode | None = None
    seed: int = 0
    enable_hisparse: bool = False
    hisparse_device_entries: int | None = None
    fuse_projections: bool = True
    decode_gemv: bool = True
    pdl_early_max_batch: int | None = None
    shared_expert_beside_max_tokens: int | None = None
    index_cache_dtype: IndexCacheDtype | None = None

    def __post_init__(self) -> None:
        for name in ("page_size", "max_running_requests", "chunked_prefill_size",
                     "cuda_graph_max_bs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid; allowed: an integer >= 1")
        for name in ("max_total_tokens", "swa_tokens", "context_length"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} is invalid; allowed: None or an integer >= 1")
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb={self.kv_cache_memory_gb} is invalid; "
                             "allowed: None or > 0")
        if self.swa_memory_fraction is not None and not 0 <= self.swa_memory_fraction < 1:
            raise ValueError(f"swa_memory_fraction={self.swa_memory_fraction} is invalid; "
                             "allowed: 0 <= swa_memory_fraction < 1")
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static={self.mem_fraction_static} is invalid; "
                             "allowed: 0 < mem_fraction_static < 1")
        spec = self.speculative_num_steps
        if (not isinstance(spec, int) or isinstance(spec, bool)
                or not 0 <= spec <= MAX_SPECULATIVE_STEPS):
            raise ValueError(f"speculative_num_steps={spec!r} is invalid; allowed: an integer in "
                             f"[0, {MAX_SPECULATIVE_STEPS}] (0 = off)")
        for name in ("pdl_early_max_batch", "shared_expert_beside_max_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 0):
                raise ValueError(f"{name}={value!r} is invalid; allowed: None (by the weights' "
                                 "format) or an integer >= 0 (0: never)")
        for name in ("fuse_projections", "decode_gemv"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid; "
                                 "allowed: True or False")
        if self.overlap_schedule is not None and not isinstance(self.overlap_schedule, bool):
            raise ValueError(f"overlap_schedule={self.overlap_schedule!r} is invalid; "
                             "allowed: None, True or False")
        if self.multi_stream is not None and not isinstance(self.multi_stream, bool):
            raise ValueError(f"multi_stream={self.multi_stream!r} is invalid; "
                             "allowed: None, True or False")
        if self.overlap_schedule and spec:
            raise ValueError(f"overlap_schedule=True with speculative_num_steps={spec} is not "
                             "supported (the next step's drafts come from the host); allowed: "
                             "overlap_schedule=False, or speculative_num_steps=0")
        allowed = (2,) if spec else (1, 2)
        if self.ring_multiplier is not None and self.ring_multiplier not in allowed:
            raise ValueError(f"ring_multiplier={self.ring_multiplier} is invalid; allowed: None "
                             f"or {' / '.join(map(str, allowed))} (2 under speculative decoding: "
                             "draft tokens write compressor rings ahead of verification)")
        if self.batch_invariant and self.kernel_backend == "triton" and not self.invariant_plans:
            raise ValueError("batch_invariant=True with kernel_backend='triton' needs "
                             "invariant_plans=True (otherwise a kernel's launch plan, and a "
                             "token's bits, depend on the batch)")
        if self.warmup is not None:
            check_warmup(self.warmup)
        if self.index_cache_dtype not in (None, *INDEX_CACHE_DTYPES):
            raise ValueError(f"index_cache_dtype={self.index_cache_dtype!r} is invalid; "
                             f"allowed: {list(INDEX_CACHE_DTYPES)}")
        if self.kernel_backend is not None and self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel_backend={self.kernel_backend!r} is invalid; "
                             f"allowed: {list(KERNEL_BACKENDS)}")
        self._check_hisparse()

    def _check_hisparse(self) -> None:
        """The HiSparse knobs alone and with the others (the model's `index_topk` is checked by
        `resolve_hisparse_entries` when the engine starts)."""
        if not isinstance(self.enable_hisparse, bool):
            raise ValueError(f"enable_hisparse={self.enable_hisparse!r} is invalid; "
                             "allowed: True or False")
        entries = self.hisparse_device_entries
        if entries is not None and (not isinstance(entries, int) or isinstance(entries, bool)
                                    or entries < 1):
            raise ValueError(f"hisparse_device_entries={entries!r} is invalid; allowed: None or "
                             "an integer >= the model's index_topk")
        if entries is not None and not self.enable_hisparse:
            raise ValueError(f"hisparse_device_entries={entries} needs enable_hisparse=True "
                             "(--enable-hisparse); allowed: None with HiSparse off")

    @property
    def rings(self) -> int:
        """The compressor ring multiplier in effect (`ring_multiplier`, or its automatic value)."""
        if self.ring_multiplier is not None:
            return self.ring_multiplier
        return 2 if self.speculative_num_steps else 1
