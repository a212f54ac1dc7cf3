"""Kernel backends: the set of compute ops the serving path uses, chosen once at start-up.

`create_kernels(name)` returns a frozen `KernelOps`; the runner puts it in every ForwardContext, so
hot code never branches on a backend name or an environment variable. Every backend has the same
signatures as `ref` (the PyTorch specification) and is tested against it. An unknown name raises
with the valid names; nothing falls back silently.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsv4.kernels.ref.attention import sparse_attention_multi
from dsv4.kernels.ref.compressor import pool_sources
from dsv4.kernels.ref.indexer import paged_index_scores
from dsv4.kernels.ref.moe import routed_experts, routed_experts_grouped
from dsv4.kernels.ref.topk import topk_ragged
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True)
class KernelOps:
    name: str
    sparse_attention: Callable[..., torch.Tensor]     # sparse_attention_multi(q, sources, sink, scale)
    pool_sources: Callable[..., torch.Tensor]         # pool_sources(kv, score, valid, ratio, overlap)
    index_scores: Callable[..., torch.Tensor]         # paged_index_scores(q, weights, keys, candidates)
    topk: Callable[..., torch.Tensor]                 # topk_ragged(scores, lengths, k) -> entry ids, -1 = none
    routed_experts: Callable[..., torch.Tensor]       # routed_experts(x, w1, w2, w3, indices, weights, limit)


def _ref() -> KernelOps:
    return KernelOps("ref", sparse_attention_multi, pool_sources, paged_index_scores, topk_ragged, routed_experts)


def _triton() -> KernelOps:
    """Triton kernels where they exist (indexer scores, top-k); the other ops are still the references.
    Imported lazily: a machine without a GPU never compiles them (tests use TRITON_INTERPRET=1)."""
    import os

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("kernel_backend='triton' needs a CUDA GPU (tests on CPU set TRITON_INTERPRET=1); "
                         "allowed on this machine: 'ref'")
    from dsv4.kernels.triton.index_scores import triton_index_scores
    from dsv4.kernels.triton.topk import lightning_topk

    return KernelOps("triton", sparse_attention_multi, pool_sources, triton_index_scores, lightning_topk,
                     _grouped_moe_if_supported)


def _grouped_moe_if_supported(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                              indices: torch.Tensor, weights: torch.Tensor, limit: float) -> torch.Tensor:
    """Grouped-GEMM MoE for bf16 on Hopper; the reference loop elsewhere (fp32 models, CPU). Decided from dtypes
    and the device, never from data."""
    if x.is_cuda and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 9:
        return routed_experts_grouped(x, w1, w2, w3, indices, weights, limit)
    return routed_experts(x, w1, w2, w3, indices, weights, limit)


_BACKENDS: dict[str, Callable[[], KernelOps]] = {"ref": _ref, "triton": _triton}
KERNEL_BACKENDS: tuple[str, ...] = tuple(_BACKENDS)
REF = _ref()


def create_kernels(name: str) -> KernelOps:
    if name not in _BACKENDS:
        raise ValueError(f"kernel_backend={name!r} is not registered; allowed: {sorted(_BACKENDS)}")
    ops = _BACKENDS[name]()
    logger.info("kernel backend: %s", ops.name)
    return ops
