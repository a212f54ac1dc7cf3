"""Kernel backends: the set of compute ops the serving path uses, chosen once at start-up.

`create_kernels(name)` returns a frozen `KernelOps`; the runner puts it in every `ForwardContext`,
so hot code never branches on a backend name or an environment variable. Every backend has the
same signatures as `ref` (the PyTorch specification) and is tested against it. An unknown name
raises with the valid names; nothing falls back silently.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsv4.config.engine import KERNEL_BACKENDS, KernelBackend
from dsv4.kernels.ops import (
    ArgmaxOp,
    CompressOp,
    CompressPairOp,
    HotPlanOp,
    HotWriteOp,
    IndexScoresOp,
    KvNormRopeStoreOp,
    LinearOp,
    MhcHeadOp,
    MhcPostOp,
    MhcPostPreOp,
    MhcPreOp,
    MoeGateLogitsOp,
    MoeGateSelectOp,
    PickSlotsOp,
    ProjectOp,
    QkvNormRopeOp,
    QNormRopeOp,
    QuantLinearOp,
    RmsNormOp,
    RopeFp8Op,
    RopeOp,
    RopeRowsOp,
    RoutedExpertsOp,
    RoutedExpertsQuantOp,
    SparseAttentionOp,
    StepMetadataOp,
    SwapInOp,
    SwigluLinearOp,
    SwigluOp,
    TopKOp,
    WriteRowsOp,
)
from dsv4.kernels.ref.argmax import argmax
from dsv4.kernels.ref.attention import sparse_attention_multi
from dsv4.kernels.ref.compressor import compress_cached, compress_cached_pair, project
from dsv4.kernels.ref.fp8_linear import dense_linear, fp8_linear
from dsv4.kernels.ref.hisparse import swap_in_ref, write_rows_ref
from dsv4.kernels.ref.hot_plan import hot_plan_ref, hot_write_ref
from dsv4.kernels.ref.indexer import paged_index_scores, pick_slots
from dsv4.kernels.ref.metadata import step_metadata
from dsv4.kernels.ref.mhc import mhc_head, mhc_post, mhc_post_pre, mhc_pre
from dsv4.kernels.ref.moe import (
    moe_gate_logits,
    moe_gate_select,
    routed_experts,
    routed_experts_quant,
    swiglu,
    swiglu_linear,
)
from dsv4.kernels.ref.rope_norm import (
    kv_norm_rope_store,
    q_norm_rope,
    qkv_norm_rope,
    rms_norm,
    rope,
    rope_fp8,
)
from dsv4.kernels.ref.rope_rows import rope_rows
from dsv4.kernels.ref.topk import topk_ragged
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True)
class KernelOps:
    """One backend's ops; each field's Protocol in `kernels/ops.py` gives its signature and ref."""

    name: KernelBackend
    sparse_attention: SparseAttentionOp
    compress: CompressOp
    compress_pair: CompressPairOp
    index_scores: IndexScoresOp
    topk: TopKOp
    routed_experts: RoutedExpertsOp
    mhc_pre: MhcPreOp
    mhc_post: MhcPostOp
    mhc_head: MhcHeadOp
    routed_experts_quant: RoutedExpertsQuantOp
    q_norm_rope: QNormRopeOp
    kv_norm_rope_store: KvNormRopeStoreOp
    rms_norm: RmsNormOp
    project: ProjectOp
    step_metadata: StepMetadataOp
    pick_slots: PickSlotsOp
    rope: RopeOp
    argmax: ArgmaxOp
    moe_gate_select: MoeGateSelectOp
    swiglu: SwigluOp
    quant_linear: QuantLinearOp
    moe_gate_logits: MoeGateLogitsOp
    linear: LinearOp
    swiglu_linear: SwigluLinearOp
    rope_rows: RopeRowsOp
    mhc_post_pre: MhcPostPreOp
    swap_in: SwapInOp
    write_rows: WriteRowsOp
    hot_plan: HotPlanOp
    hot_write: HotWriteOp
    qkv_norm_rope: QkvNormRopeOp
    rope_fp8: RopeFp8Op


def _ref() -> KernelOps:
    return KernelOps("ref", sparse_attention_multi, compress_cached, compress_cached_pair,
                     paged_index_scores, topk_ragged, routed_experts, mhc_pre, mhc_post, mhc_head,
                     routed_experts_quant, q_norm_rope, kv_norm_rope_store, rms_norm,
                     project, step_metadata, pick_slots, rope, argmax, moe_gate_select,
                     swiglu, fp8_linear, moe_gate_logits, dense_linear, swiglu_linear,
                     rope_rows, mhc_post_pre, swap_in_ref, write_rows_ref, hot_plan_ref,
                     hot_write_ref, qkv_norm_rope, rope_fp8)


def _triton(invariant_plans: bool = False) -> KernelOps:
    """Every op as its Triton kernel.

    The kernels: compressor, a CSA layer's two compressors in one launch, indexer scores, top-k,
    hybrid sparse attention, grouped routed experts on float or checkpoint-format (FP4 / FP8)
    weights, fused mHC pre / post / head (and at a few tokens a post fused with the next pre's
    projection, `mhc_post_pre`), fused RMSNorm + RoPE (+ SWA cache write) of the q and kv
    paths (both in one launch, `qkv_norm_rope`), RMSNorm, and bit-equal to `ref`: a step's
    index metadata,
    the indexer picks' ids and slots, RoPE alone (the indexer's queries; for FP8 keys with
    each head quantised in the same launch, `rope_fp8`), the compressors'
    gate-score position embedding and the greedy sampler's row argmax; the MoE gate's logits
    (at decode, with the call site's counters: the decode GEMV on the bf16 operands as they are,
    fp32 sums; the reference otherwise and under `invariant_plans`), its selection and weights
    after them (ids equal to `ref`'s; weights within ~1 ulp: torch's k-sum order depends on the
    row count), the shared expert's SwiGLU (bit-equal to `ref` on a GPU; at decode with w2's
    counters computed inside w2's GEMV, `swiglu_linear`: the bits of the `swiglu` op then the
    `linear` op; under `invariant_plans` the `swiglu` op then F.linear) and
    the checkpoint-format FP8 linears (`quant_linear`: codes decoded in registers, fp32 sums),
    and a step's RoPE-row gathers of every table in one launch (`rope_rows`, bit-equal), and
    HiSparse's copies between the pinned host mirror and the device (`swap_in`, `write_rows`:
    bit copies, or one cast; the mirror read and written in place, no host sync) and its plan of
    a decode step's picks in one launch per C4 layer (`hot_plan`: the same maps and rows as the
    reference), with a decode step's new entries stored by the same launch (`hot_write`).
    Top-k runs through a `TopKRunner` owned by this `KernelOps` (its held coop workspace: the
    engine's forward calls it from one stream at a time). Imported lazily: a machine without a
    GPU never compiles them (tests use `TRITON_INTERPRET=1`).

    NOTE: not bit-equal to `ref` in bf16: the references round where the kernels do (one cast
    after the fused norm + RoPE, fp32 expert GEMMs with only h rounded, fp32 softmax weights in
    P.V), but the summation orders differ (online softmax, fused reductions, split-K), about
    1e-7 relative before each bf16 rounding; in bf16 that alone moves RL log-probs by ~0.002 -
    0.01 nats (benchmarks/results/rl_h200_202612.md). fp32 models agree to rounding
    (`tests/kernels/test_engine_triton_backend.py`); the bf16 agreement is measured by
    `benchmarks/engine_backend_check.py`.

    `invariant_plans`: every op computes a token's row with a launch plan chosen from that row's
    shapes only, never from the token count: sparse attention without split-KV, mHC pre / head
    (and the post + pre op, unfused)
    with the T-invariant split-K plan, the quantised routed experts in their own loop at every T
    (without the prefill path through decoded bf16 chunks), the compressor projections as
    fixed-tile GEMMs, a CSA
    layer's compressor pair as two single launches at every T (the default fuses them up to 512
    tokens, and the fused entries differ from the singles' in rounding), the dense projections and
    the gate's logits as their references. The other ops already are;
    `benchmarks/kernel_invariance.py` checks the token-wise ops on the GPU,
    `benchmarks/drift_events.py` the whole forward. A token then gets the same bits in a decode
    step of any batch size and in one full-sequence call, so an RL trainer that takes its forward
    values from these ops (`ForwardMode.values`) reproduces the engine's log-probs. Costs
    parallelism at small batches.
    """
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("kernel_backend='triton' needs a CUDA GPU (tests on CPU set "
                         "TRITON_INTERPRET=1); allowed on this machine: 'ref'")
    from dsv4.kernels.triton.argmax import triton_argmax
    from dsv4.kernels.triton.compressor import triton_compress_cached
    from dsv4.kernels.triton.compressor_pair import triton_compress_pair
    from dsv4.kernels.triton.fp8_linear import triton_fp8_linear
    from dsv4.kernels.triton.gemv import triton_decode_linear
    from dsv4.kernels.triton.hisparse import triton_swap_in, triton_write_rows
    from dsv4.kernels.triton.hot_plan import triton_hot_plan, triton_hot_write
    from dsv4.kernels.triton.index_scores import triton_index_scores
    from dsv4.kernels.triton.metadata import triton_step_metadata
    from dsv4.kernels.triton.mhc import triton_mhc_head, triton_mhc_pre
    from dsv4.kernels.triton.mhc_post import triton_mhc_post
    from dsv4.kernels.triton.mhc_post_pre import triton_mhc_post_pre
    from dsv4.kernels.triton.moe import (
        triton_routed_experts,
        triton_routed_experts_quant_deterministic,
    )
    from dsv4.kernels.triton.moe_gate import triton_moe_gate_select
    from dsv4.kernels.triton.moe_gate_logits import triton_moe_gate_logits
    from dsv4.kernels.triton.pick_slots import triton_pick_slots
    from dsv4.kernels.triton.project import HeldProject, triton_project_invariant
    from dsv4.kernels.triton.rope_fp8 import triton_rope_fp8
    from dsv4.kernels.triton.rope_norm import (
        triton_kv_norm_rope_store,
        triton_q_norm_rope,
        triton_qkv_norm_rope,
        triton_rms_norm,
        triton_rope,
    )
    from dsv4.kernels.triton.rope_rows import triton_rope_rows
    from dsv4.kernels.triton.sparse_attention import triton_sparse_attention
    from dsv4.kernels.triton.swiglu import triton_swiglu
    from dsv4.kernels.triton.swiglu_linear import (
        triton_swiglu_linear,
        triton_swiglu_linear_invariant,
    )
    from dsv4.kernels.triton.topk import TopKRunner

    attention, pre, head = triton_sparse_attention, triton_mhc_pre, triton_mhc_head
    experts_quant: RoutedExpertsQuantOp = triton_routed_experts_quant_deterministic
    project: ProjectOp = HeldProject()
    pair = triton_compress_pair
    post_pre: MhcPostPreOp = triton_mhc_post_pre
    if invariant_plans:
        project = triton_project_invariant
        pair = functools.partial(triton_compress_pair, invariant=True)
        attention = functools.partial(triton_sparse_attention, num_splits=1)
        pre = functools.partial(triton_mhc_pre, invariant=True)
        head = functools.partial(triton_mhc_head, invariant=True)
        post_pre = functools.partial(triton_mhc_post_pre, invariant=True)
        experts_quant = functools.partial(triton_routed_experts_quant_deterministic,
                                          dequant_chunk=0)
    return KernelOps("triton", attention, triton_compress_cached,
                     pair, triton_index_scores, TopKRunner(),
                     triton_routed_experts, pre, triton_mhc_post, head,
                     experts_quant, triton_q_norm_rope,
                     triton_kv_norm_rope_store, triton_rms_norm, project,
                     triton_step_metadata, triton_pick_slots, triton_rope,
                     triton_argmax, triton_moe_gate_select, triton_swiglu,
                     triton_fp8_linear,
                     moe_gate_logits if invariant_plans else triton_moe_gate_logits,
                     dense_linear if invariant_plans else triton_decode_linear,
                     triton_swiglu_linear_invariant if invariant_plans else triton_swiglu_linear,
                     triton_rope_rows, post_pre, triton_swap_in, triton_write_rows,
                     triton_hot_plan, triton_hot_write, triton_qkv_norm_rope, triton_rope_fp8)


_BACKENDS: dict[KernelBackend, Callable[[bool], KernelOps]] = {
    "ref": lambda invariant_plans: _ref(), "triton": _triton}
assert tuple(_BACKENDS) == KERNEL_BACKENDS, "every KernelBackend name has a builder"
REF = _ref()


def create_kernels(name: KernelBackend, invariant_plans: bool = False) -> KernelOps:
    """The ops of backend `name`, logged once; an unknown name raises with the allowed names.

    `invariant_plans`: launch plans that do not depend on the token count (`_triton`); the `ref`
    ops take no plans (the flag changes nothing there)."""
    if name not in _BACKENDS:
        raise ValueError(f"kernel_backend={name!r} is not registered; "
                         f"allowed: {list(KERNEL_BACKENDS)}")
    ops = _BACKENDS[name](invariant_plans)
    logger.info("kernel backend: %s%s", ops.name,
                " (token-count-invariant plans)" if invariant_plans and name != "ref" else "")
    return ops
