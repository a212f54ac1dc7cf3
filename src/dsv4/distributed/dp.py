"""Data-parallel attention (SGLang's `--enable-dp-attention`) over torch.distributed (issue 22).

Each of `size` ranks serves its own requests: its own KV pools, prefix cache and scheduler, and
runs attention, mHC, norms, embedding and LM head on its own tokens only (none of them mixes
tokens of different requests). The MoE layers are shared: `enable_dp_attention(model, dp)` swaps
every `MoE` (the MTP blocks' too) for a `DPMoE`, which

1. all-gathers the step's hidden states and token ids from every rank (`all_gather_varlen`: the
   per-rank token counts first, then the rows padded to the largest count, then unpadded), in
   rank order;
2. runs the MoE on all gathered tokens: experts replicated, or with `expert_parallel` split by id
   (`tp.LocalExperts`, `tp.LocalQuantExperts` for checkpoint-format experts; the shared expert's
   intermediate dim split, its FP8 linears cut as tensor parallelism cuts them) and the
   fp32 output all-reduced, exactly as `tp.shard_model` does for expert parallelism (the cuts:
   `dp_owned_slices`, which `loading.load_dp_shard` reads from the checkpoint per rank);
3. keeps its own rows.

Invariant: every MoE layer is a collective, so every rank runs exactly one forward per engine
step, an idle rank a 1-token forward on a padding row (`LLMEngine.step_or_idle`). Each row's
result depends only on that row (routing and experts are per token), so outputs equal one
process's up to the summation order of the batched matmuls (fp32: ~1e-6).

One host sync per forward: the token counts (`.tolist()`), gathered by the forward's first MoE
layer (the decoder's first, or an MTP block's own) into a `CountCache` the model's other MoE
layers read (every rank runs the same layers in the same order, so the gathers match). The sync
makes a DP forward not capturable in a CUDA graph; `check_dp_attention` refuses CUDA graphs,
speculative decoding and overlap scheduling for now.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dsv4.config.engine import EngineConfig
from dsv4.config.model import ModelConfig
from dsv4.distributed.tp import (
    AllReduce,
    Cut,
    LocalExperts,
    LocalQuantExperts,
    TPGroup,
    _moe_cuts,
    cut_modules_,
    log_dequantized,
)
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.model.forward_context import ForwardContext
from dsv4.model.forward_mode import ForwardMode
from dsv4.model.moe import MoE
from dsv4.model.quant_experts import QuantExperts
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)


DPGroup = TPGroup
"""This rank's place in a data-parallel-attention group: the same (rank, size, group) record as
tensor parallelism's, which the expert-parallel split and its all-reduce take as they are."""


def gather_counts(n: int, dp: DPGroup, device: torch.device) -> list[int]:
    """Every rank's row count, in rank order (a named host sync: `.tolist()`)."""
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    counts = [torch.empty_like(mine) for _ in range(dp.size)]
    dist.all_gather(counts, mine, group=dp.group)
    return torch.cat(counts).tolist()   # host sync: the shapes below depend on it


def all_gather_varlen(t: torch.Tensor, counts: list[int], dp: DPGroup) -> torch.Tensor:
    """t [counts[dp.rank], ...] -> [sum(counts), ...]: every rank's rows in rank order. Each rank
    pads its rows to max(counts) (all_gather wants equal shapes) and the padding is dropped."""
    assert t.shape[0] == counts[dp.rank], f"{t.shape[0]} rows, but rank {dp.rank} counted " \
        f"{counts[dp.rank]}"
    most = max(counts)
    padded = F.pad(t, (0, 0) * (t.dim() - 1) + (0, most - t.shape[0])).contiguous()
    parts = [torch.empty_like(padded) for _ in range(dp.size)]
    dist.all_gather(parts, padded, group=dp.group)
    return torch.cat([p[:c] for p, c in zip(parts, counts, strict=True)])


@dataclass
class CountCache:
    """Every rank's row count in the forward under way: written by the forward's first `DPMoE`
    (`gathers`), read by the others."""

    counts: list[int] | None = None


class DPMoE(MoE):
    """An `MoE` over every rank's tokens (module docstring), built from a loaded (and, with
    expert parallelism, already split) `MoE` whose submodules it takes over: parameter names are
    unchanged. `gathers`: this layer runs first in its forward and gathers the counts into
    `cache`; the others reuse them."""

    def __init__(self, moe: MoE, dp: DPGroup, cache: CountCache, gathers: bool) -> None:
        nn.Module.__init__(self)
        self.dp, self.replay_index = dp, moe.replay_index
        self.gate, self.experts, self.shared_experts = moe.gate, moe.experts, moe.shared_experts
        self.reduce = moe.reduce
        self.cache, self.gathers = cache, gathers

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, ctx: ForwardContext | None = None,
                *, mode: ForwardMode | None = None) -> torch.Tensor:
        """x: [..., d], input_ids: [...] (this rank's n tokens) -> [..., d]."""
        assert mode is None or mode.replay is None, "routing replay under DP attention"
        u, ids = x.reshape(-1, x.shape[-1]), input_ids.reshape(-1)
        if self.gathers:
            self.cache.counts = gather_counts(u.shape[0], self.dp, u.device)
        counts = self.cache.counts
        assert counts is not None and counts[self.dp.rank] == u.shape[0], \
            "a DPMoE ran before its forward's first MoE layer gathered the counts"
        y = super().forward(all_gather_varlen(u, counts, self.dp),
                            all_gather_varlen(ids, counts, self.dp), ctx, mode=mode)
        start = sum(counts[:self.dp.rank])
        mine = slice(start, start + u.shape[0])
        if ctx is not None and ctx.captured is not None:    # routing capture: this rank's rows
            ctx.captured["experts"][-1] = ctx.captured["experts"][-1][mine]
        return y[mine].view_as(x)


def enable_dp_attention(model: DeepSeekV4ForCausalLM, dp: DPGroup,
                        expert_parallel: bool = False) -> DeepSeekV4ForCausalLM:
    """Swap every MoE of the full loaded `model` for a `DPMoE` (module docstring), in place;
    returns it. `expert_parallel`: keep only rank `dp.rank`'s routed experts and its share of the
    shared expert (`tp.shard_model`'s expert-parallel cut; the output all-reduced). Raises
    ValueError (before changing anything) when `dp.size` does not divide a split dimension.
    Needs no live process group until the first forward."""
    moes = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]
    cuts = {name: _moe_cuts(m, dp, True) for name, m in moes} if expert_parallel else {}
    dtype, dequantized = model.embed.weight.dtype, []
    cache, first = CountCache(), next(name for name, _ in moes if name.startswith("layers."))
    for name, moe in moes:
        if expert_parallel:
            dequantized += _split_experts(moe, cuts[name], dp, dtype)
        owner, _, attr = name.rpartition(".")
        gathers = name == first or name.startswith("mtp.")    # each forward's first MoE
        setattr(model.get_submodule(owner), attr, DPMoE(moe, dp, cache, gathers))
    log_dequantized(dequantized, dtype, "expert parallelism")
    logger.info("DP attention: rank %d of %d, %d MoE layers over all ranks' tokens (%s)",
                dp.rank, dp.size, len(moes),
                "experts split by id" if expert_parallel else "experts replicated")
    return model


def dp_owned_slices(model: DeepSeekV4ForCausalLM, dp: DPGroup,
                    expert_parallel: bool) -> dict[str, Cut]:
    """Parameter name -> rank `dp.rank`'s `Cut` of it under DP attention (a name not in the
    dict is held whole): with `expert_parallel` every MoE's routed experts by id and its shared
    expert by intermediate dim (`tp._moe_cuts`), else nothing. The one statement of the DP
    partition: `enable_dp_attention` applies it, `loading.load_dp_shard` reads it. `model` is the
    full model (any device, meta included); changes nothing."""
    if not expert_parallel:
        return {}
    return {f"{prefix}.{name}": cut for prefix, moe in model.named_modules()
            if isinstance(moe, MoE) for name, cut in _moe_cuts(moe, dp, True).items()}


def _split_experts(moe: MoE, cuts: dict[str, Cut], dp: DPGroup,
                   dtype: torch.dtype) -> list[str]:
    """One MoE's expert-parallel cut (`tp.shard_model`'s): routed experts by id, the shared
    expert by intermediate dim (`tp.cut_modules_`: its FP8 linears cut on scale blocks, or
    dequantised to `dtype` where a cut is not whole blocks), the output all-reduced. Returns the
    dequantised linears' names."""
    dequantized = cut_modules_(moe, cuts, dtype)
    ids = cuts["experts.w1"]
    moe.experts = (LocalQuantExperts(moe.experts, ids) if isinstance(moe.experts, QuantExperts)
                   else LocalExperts(moe.experts, ids))
    moe.reduce = AllReduce(dp)
    return dequantized


def check_dp_attention(model: ModelConfig, config: EngineConfig, size: int,
                       expert_parallel: bool, device: str) -> None:
    """Raise ValueError naming the first engine setting or model dimension that DP attention over
    `size` ranks does not support (yet): speculative decoding, overlap scheduling, CUDA graphs
    (the MoE's count exchange is a host sync), and with `expert_parallel` a size that does not
    divide the routed experts or the (shared) expert's intermediate dim."""
    refused = (("speculative_num_steps", config.speculative_num_steps, 0),
               ("overlap_schedule", bool(config.overlap_schedule), False),
               *((("disable_cuda_graph", config.disable_cuda_graph, True),)
                 if device.startswith("cuda") else ()))
    for name, value, allowed in refused:
        if value != allowed:
            raise ValueError(f"{name}={value!r} with data_parallel_size > 1 is not supported "
                             f"yet; allowed: {allowed!r}")
    if expert_parallel:
        for name, dim in (("n_routed_experts", model.n_routed_experts),
                          ("moe_inter_dim", model.moe_inter_dim)):
            if dim % size:
                raise ValueError(f"data parallel size {size} with expert parallelism does not "
                                 f"divide {name}={dim}; allowed: a divisor of {dim}")
