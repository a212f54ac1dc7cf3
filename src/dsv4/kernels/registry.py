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
from dsv4.kernels.ref.compressor import compress_cached
from dsv4.kernels.ref.indexer import paged_index_scores
from dsv4.kernels.ref.moe import routed_experts
from dsv4.kernels.ref.topk import topk_ragged
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True)
class KernelOps:
    name: str
    sparse_attention: Callable[..., torch.Tensor]     # sparse_attention_multi(q, sources, sink, scale)
    compress: Callable[..., None]                     # compress_cached(kv, score, ring_kv, ring_score, index,
                                                      #   norm_weight, eps, cos, sin, out): in place
    index_scores: Callable[..., torch.Tensor]         # paged_index_scores(q, weights, keys, candidates)
    topk: Callable[..., torch.Tensor]                 # topk_ragged(scores, lengths, k) -> entry ids, -1 = none
    routed_experts: Callable[..., torch.Tensor]       # routed_experts(x, w1, w2, w3, indices, weights, limit)


def _ref() -> KernelOps:
    return KernelOps("ref", sparse_attention_multi, compress_cached, paged_index_scores, topk_ragged, routed_experts)


def _triton() -> KernelOps:
    """Triton kernels where they exist (compressor, indexer scores, top-k); the other ops are still the references.
    Imported lazily: a machine without a GPU never compiles them (tests use TRITON_INTERPRET=1)."""
    import os

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("kernel_backend='triton' needs a CUDA GPU (tests on CPU set TRITON_INTERPRET=1); "
                         "allowed on this machine: 'ref'")
    from dsv4.kernels.triton.compressor import triton_compress_cached
    from dsv4.kernels.triton.index_scores import triton_index_scores
    from dsv4.kernels.triton.topk import lightning_topk

    # NOTE: routed experts stay the reference loop here: `ref.moe.routed_experts_grouped` (bf16 grouped GEMMs) is
    # faster but not bit-equal, and this backend promises the reference's greedy tokens (measured on flash-4l:
    # 76/128 identical with it). It belongs with the quantised-MoE kernel and its looser agreement bound.
    return KernelOps("triton", sparse_attention_multi, triton_compress_cached, triton_index_scores, lightning_topk,
                     routed_experts)


_BACKENDS: dict[str, Callable[[], KernelOps]] = {"ref": _ref, "triton": _triton}
KERNEL_BACKENDS: tuple[str, ...] = tuple(_BACKENDS)
REF = _ref()


def create_kernels(name: str) -> KernelOps:
    if name not in _BACKENDS:
        raise ValueError(f"kernel_backend={name!r} is not registered; allowed: {sorted(_BACKENDS)}")
    ops = _BACKENDS[name]()
    logger.info("kernel backend: %s", ops.name)
    return ops
