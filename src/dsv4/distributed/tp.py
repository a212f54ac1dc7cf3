"""Tensor parallelism over torch.distributed: a loaded model sharded in place (issue 22).

`shard_model(model, tp)` turns a full model (every rank loaded the same weights) into rank
`tp.rank`'s shard of a `tp.size`-way tensor-parallel model. What each rank keeps:

- attention: its `num_heads / size` query heads (wq_b rows, attn_sink) and its `o_groups / size`
  output groups (wo_a rows, wo_b columns); wo_b's partial output is all-reduced. The single
  shared KV head (wkv, kv_norm), the compressors and the indexer are replicated: the KV and the
  indexer's top-k are computed whole on every rank (their memory is per rank, not split);
- MoE: every routed expert's and the shared expert's intermediate dimension split (w1 / w3
  rows, w2 columns); or, with `expert_parallel`, whole routed experts split by id (rank r keeps
  experts [r E / size, (r + 1) E / size) and computes only the (token, expert) pairs routed to
  them; the others get weight 0) and the shared expert's intermediate dimension split. The gate
  stays whole (every rank routes every token alike) and the layer's fp32 output (routed +
  shared) is all-reduced once;
- embedding and LM head: vocab-parallel (each rank its `vocab / size` rows; the embedding
  all-reduces the one rank's row that owns each token, the head all-gathers the logits);
- mHC, norms, MTP blocks' non-parallel parts: replicated.

Each rank then runs the same forward (the full-sequence path or the engine's steps) on the same
inputs: SPMD, so every collective is matched. The all-reduces sum fp32 partials (attention's in
the model dtype), so outputs equal one process's to summation order (fp32: ~1e-6).
Checkpoint-format (FP4 / FP8) experts are refused for now.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from dsv4.config.model import ModelConfig
from dsv4.model.attention import Attention
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.model.forward_context import ForwardContext
from dsv4.model.forward_mode import ForwardMode
from dsv4.model.moe import Experts, MoE


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in a tensor-parallel group (`group` None: the default group)."""

    rank: int
    size: int
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank={self.rank} is invalid for size={self.size}; "
                             f"allowed: 0..{self.size - 1}")


class AllReduce(nn.Module):
    """Sum over the group (a functional collective: out of place, usable in graph capture)."""

    def __init__(self, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", _group(self.tp)))


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + V / size) of the embedding; other ids give zeros, then all-reduce."""

    def __init__(self, full: nn.Embedding, tp: TPGroup) -> None:
        super().__init__()
        rows = _split(full.num_embeddings, tp, "vocab_size")
        self.start, self.reduce = tp.rank * rows, AllReduce(tp)
        self.weight = nn.Parameter(full.weight.detach()[self.start:self.start + rows].clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.reduce(x * mine.unsqueeze(-1).to(x.dtype))


class VocabParallelHead(nn.Module):
    """This rank's vocab rows of the LM head; the logits are all-gathered (exact, no sum)."""

    def __init__(self, full: nn.Linear, tp: TPGroup) -> None:
        super().__init__()
        rows = _split(full.out_features, tp, "vocab_size")
        self.tp = tp
        self.weight = nn.Parameter(full.weight.detach()[tp.rank * rows:(tp.rank + 1) * rows]
                                   .clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.weight).movedim(-1, 0).contiguous()      # [V/size, ...]
        full = funcol.wait_tensor(funcol.all_gather_single(local, 0, _group(self.tp)))
        return full.movedim(0, -1)


def _group(tp: TPGroup) -> dist.ProcessGroup:
    return tp.group if tp.group is not None else dist.group.WORLD  # type: ignore[return-value]


def shard_model(model: DeepSeekV4ForCausalLM, tp: TPGroup,
                expert_parallel: bool = False) -> DeepSeekV4ForCausalLM:
    """Shard `model` in place for rank `tp.rank` of `tp.size` (module docstring); returns it.
    `expert_parallel`: routed experts split by id instead of by intermediate dimension. Raises
    ValueError naming the dimension a size does not divide, before changing anything."""
    check_shardable(model.config, tp.size, expert_parallel)
    if tp.size == 1:
        return model
    for module in list(model.modules()):
        if isinstance(module, Attention):
            _shard_attention(module, tp)
        elif isinstance(module, MoE):
            _shard_moe(module, tp, expert_parallel)
    model.embed = VocabParallelEmbedding(model.embed, tp)  # type: ignore[assignment]
    model.head = VocabParallelHead(model.head, tp)         # type: ignore[assignment]
    return model


def check_shardable(c: ModelConfig, size: int, expert_parallel: bool = False) -> None:
    """Raise ValueError naming the first dimension of `c` that `size` ranks do not divide."""
    tp = TPGroup(0, size)
    for name, dim in (("num_heads", c.num_heads), ("o_groups", c.o_groups),
                      ("moe_inter_dim", c.moe_inter_dim), ("vocab_size", c.vocab_size),
                      *((("n_routed_experts", c.n_routed_experts),) if expert_parallel else ())):
        _split(dim, tp, name)


def _split(dim: int, tp: TPGroup, name: str) -> int:
    if dim % tp.size:
        raise ValueError(f"tensor parallel size {tp.size} does not divide {name}={dim}; "
                         f"allowed: a divisor of {dim}")
    return dim // tp.size


def _rows(w: torch.Tensor, part: int, rank: int, dim: int = 0) -> nn.Parameter:
    return nn.Parameter(w.detach().narrow(dim, rank * part, part).clone(),
                        requires_grad=w.requires_grad)


def _shard_attention(attn: Attention, tp: TPGroup) -> None:
    heads, groups = _split(attn.n_heads, tp, "num_heads"), _split(attn.o_groups, tp, "o_groups")
    r, D = tp.rank, attn.head_dim
    o_lora = attn.wo_a.weight.shape[0] // attn.o_groups
    attn.wq_b.weight = _rows(attn.wq_b.weight, heads * D, r)
    attn.attn_sink = _rows(attn.attn_sink, heads, r)
    attn.wo_a.weight = _rows(attn.wo_a.weight, groups * o_lora, r)
    attn.wo_b.weight = _rows(attn.wo_b.weight, groups * o_lora, r, dim=1)
    attn.wq_b.out_features, attn.wo_a.out_features = heads * D, groups * o_lora
    attn.wo_b.in_features = groups * o_lora
    attn.n_heads, attn.o_groups = heads, groups
    attn.reduce = AllReduce(tp)


class LocalExperts(Experts):
    """Experts [start, start + count) of a routed-expert layer (expert parallelism; parameter
    names unchanged): the (token, expert) pairs routed elsewhere get weight 0 on an in-range id,
    so the same op computes this rank's share of the layer's output."""

    def __init__(self, experts: Experts, start: int, count: int) -> None:
        nn.Module.__init__(self)
        self.limit, self.start, self.count = experts.limit, start, count
        self.w1, self.w2, self.w3 = (_rows(getattr(experts, n), count, start // count)
                                     for n in ("w1", "w2", "w3"))

    def forward(self, u: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                ctx: ForwardContext | None = None, *,
                mode: ForwardMode | None = None) -> torch.Tensor:
        local = indices - self.start
        mine = (local >= 0) & (local < self.count)
        return super().forward(u, torch.where(mine, local, 0),
                               torch.where(mine, weights, 0.0), ctx, mode=mode)


def _shard_moe(moe: MoE, tp: TPGroup, expert_parallel: bool) -> None:
    experts, shared, r = moe.experts, moe.shared_experts, tp.rank
    if not all(isinstance(getattr(experts, n, None), nn.Parameter) for n in ("w1", "w2", "w3")):
        raise ValueError("tensor parallelism of checkpoint-format (FP4 / FP8) experts is not "
                         "supported; allowed: weight_format='bf16'")
    if expert_parallel:
        count = _split(experts.w1.shape[0], tp, "n_routed_experts")
        moe.experts = LocalExperts(experts, r * count, count)
    else:
        inter = _split(experts.w1.shape[1], tp, "moe_inter_dim")
        experts.w1, experts.w3 = _rows(experts.w1, inter, r, 1), _rows(experts.w3, inter, r, 1)
        experts.w2 = _rows(experts.w2, inter, r, 2)
    part = _split(shared.w1.weight.shape[0], tp, "shared expert inter dim")
    shared.w1.weight, shared.w3.weight = (_rows(shared.w1.weight, part, r),
                                          _rows(shared.w3.weight, part, r))
    shared.w2.weight = _rows(shared.w2.weight, part, r, dim=1)
    moe.reduce = AllReduce(tp)
