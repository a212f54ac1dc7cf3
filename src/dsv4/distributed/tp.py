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
Experts kept in checkpoint encoding (`weight_format="checkpoint"`: FP4 / FP8 codes and scales,
`model/quant_experts.py`) split by id only (`expert_parallel`; `LocalQuantExperts`); splitting
their intermediate dimension is refused.

FP8 linears kept in checkpoint encoding (`QuantLinear`, `model/quant_linear.py`; wq_b, wo_a, wo_b
and the shared experts' w1 / w2 / w3 are cut) stay FP8 where their cut is whole 128x128 scale
blocks: codes and scales are narrowed together (`QuantLinear.narrow_`), so the rank holds one
byte per weight and decodes exactly the full weight's cut. V4-Flash's cuts are (TP 2..8: 512-row
heads, 1024-row output groups, shared intermediate 2048 / size). A cut that is not block-aligned
(small test geometries) dequantises that linear to the model dtype first (exact; the names are
logged). The replicated FP8 linears (wq_a, wkv, the indexer's wq_b, MTP's e_proj / h_proj) stay
as loaded.

`owned_slices` states the partition once, as parameter name -> `Cut` (dim, start, size):
`shard_model` narrows a loaded model's parameters with it (then swaps in the parallel modules),
and `loading.load_shard` reads exactly those slices from the checkpoint.
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
from dsv4.model.moe import NO_COMBINE, Combine, Experts, MoE
from dsv4.model.quant_experts import QuantExperts
from dsv4.model.quant_linear import QuantLinear, dequantize_linears_
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)


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
    """Rows [start, start + V / size) of the embedding (`weight`, already this rank's rows);
    other ids give zeros, then all-reduce."""

    def __init__(self, weight: torch.Tensor, start: int, tp: TPGroup) -> None:
        super().__init__()
        self.start, self.reduce = start, AllReduce(tp)
        self.weight = nn.Parameter(weight, requires_grad=weight.requires_grad)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.reduce(x * mine.unsqueeze(-1).to(x.dtype))


class VocabParallelHead(nn.Module):
    """This rank's vocab rows of the LM head (`weight`); the logits are all-gathered (exact, no
    sum)."""

    def __init__(self, weight: torch.Tensor, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(weight, requires_grad=weight.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.weight).movedim(-1, 0).contiguous()      # [V/size, ...]
        full = funcol.wait_tensor(funcol.all_gather_single(local, 0, _group(self.tp)))
        return full.movedim(0, -1)


def _group(tp: TPGroup) -> dist.ProcessGroup:
    return tp.group if tp.group is not None else dist.group.WORLD  # type: ignore[return-value]


@dataclass(frozen=True)
class Cut:
    """The part of a full tensor that one rank owns: `size` indices from `start` along `dim`."""

    dim: int
    start: int
    size: int

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full tensor `t` (a view)."""
        return t.narrow(self.dim, self.start, self.size)


def owned_slices(model: DeepSeekV4ForCausalLM, tp: TPGroup,
                 expert_parallel: bool = False) -> dict[str, Cut]:
    """Parameter name -> rank `tp.rank`'s `Cut` of it, for every parameter the layout splits (a
    name not in the dict is replicated whole; names are the same in the full model and the shard).

    The one statement of the partition (module docstring): `shard_model` applies it to a loaded
    model, `loading.load_shard` reads it from the checkpoint. `model` is the full model (any
    device, meta included). Raises ValueError as `shard_model` does; changes nothing."""
    check_shardable(model.config, tp.size, expert_parallel)
    if tp.size == 1:
        return {}
    cuts = {"embed.weight": _part(model.embed.num_embeddings, tp, "vocab_size"),
            "head.weight": _part(model.head.out_features, tp, "vocab_size")}
    for prefix, module in model.named_modules():
        if isinstance(module, Attention):
            part = _attention_cuts(module, tp)
        elif isinstance(module, MoE):
            part = _moe_cuts(module, tp, expert_parallel)
        else:
            continue
        cuts.update({f"{prefix}.{name}": cut for name, cut in part.items()})
    return cuts


def take_owned(named: dict[str, torch.Tensor], cuts: dict[str, Cut],
               size: int) -> dict[str, torch.Tensor]:
    """This rank's part of full tensors named as the full model's state dict (a weight update):
    each name in `cuts` narrowed to its `Cut` (a view), the others whole. Raises ValueError for a
    cut tensor whose split dimension is not the full one (`size` equal parts), so every rank's
    part has the shape the rank expects."""
    owned = {}
    for name, t in named.items():
        cut = cuts.get(name)
        if cut is None:
            owned[name] = t
            continue
        if t.dim() <= cut.dim or t.shape[cut.dim] != cut.size * size:
            raise ValueError(f"tensor {name!r} has shape {list(t.shape)}; allowed: dim "
                             f"{cut.dim} of size {cut.size * size} (the full model's)")
        owned[name] = cut.take(t)
    return owned


def shard_model(model: DeepSeekV4ForCausalLM, tp: TPGroup,
                expert_parallel: bool = False) -> DeepSeekV4ForCausalLM:
    """Shard `model` in place for rank `tp.rank` of `tp.size` (module docstring); returns it.
    `expert_parallel`: routed experts split by id instead of by intermediate dimension. Raises
    ValueError naming the dimension a size does not divide, before changing anything. Needs no
    live process group (the collectives resolve `tp.group` when they run) and works on the meta
    device."""
    cuts = owned_slices(model, tp, expert_parallel)
    if not cuts:
        return model
    dtype = model.embed.weight.dtype
    log_dequantized(cut_modules_(model, cuts, dtype), dtype, "tensor parallelism")
    for prefix, module in list(model.named_modules()):
        if isinstance(module, Attention):
            _localize_attention(module, tp)
        elif isinstance(module, MoE):
            if expert_parallel:
                ids = cuts[f"{prefix}.experts.w1"]
                module.experts = (LocalQuantExperts(module.experts, ids)
                                  if isinstance(module.experts, QuantExperts)
                                  else LocalExperts(module.experts, ids))
            module.reduce = AllReduce(tp)
    model.embed = VocabParallelEmbedding(  # type: ignore[assignment]
        model.embed.weight, cuts["embed.weight"].start, tp)
    model.head = VocabParallelHead(model.head.weight, tp)  # type: ignore[assignment]
    return model


def cut_modules_(root: nn.Module, cuts: dict[str, Cut], dtype: torch.dtype) -> list[str]:
    """Apply `cuts` (names relative to `root`) in place: a parameter becomes a clone of its cut;
    an FP8 `QuantLinear` keeps its codes and scale blocks cut (`narrow_`) when the cut is whole
    scale blocks, else is dequantised to `dtype` (exact) and cut as a parameter; a `QuantExperts`
    is skipped (`LocalQuantExperts` cuts it by id). Returns the dequantised linears' names (the
    caller logs them: `log_dequantized`)."""
    loose = {name.rpartition(".")[0] for name, cut in cuts.items()
             if _is_quant_linear(root, name) and not _quant_cut_fits(root, name, cut)}
    dequantized = dequantize_linears_(root, dtype, loose) if loose else []
    for name, cut in cuts.items():
        owner, _, attr = name.rpartition(".")
        module = root.get_submodule(owner)
        if isinstance(module, QuantExperts):
            continue                    # its buffers are cut whole by `LocalQuantExperts`
        if isinstance(module, QuantLinear):
            assert attr == "weight", f"{name}: an FP8 linear is cut by its `weight`"
            module.narrow_(cut.dim, cut.start, cut.size)
            continue
        full = getattr(module, attr)
        assert isinstance(full, nn.Parameter), f"{name} is cut but is not a parameter"
        setattr(module, attr, nn.Parameter(cut.take(full.detach()).clone(),
                                           requires_grad=full.requires_grad))
    return dequantized


def log_dequantized(names: list[str], dtype: torch.dtype, layout: str) -> None:
    """One warning for the FP8 linears a layout dequantised (`cut_modules_`), if any."""
    if names:
        logger.warning("%s cuts %d FP8 linear(s) off their 128-wide scale blocks: dequantised to "
                       "%s (exact), e.g. %s", layout, len(names), dtype, names[0])


def _is_quant_linear(root: nn.Module, name: str) -> bool:
    return isinstance(root.get_submodule(name.rpartition(".")[0]), QuantLinear)


def _quant_cut_fits(root: nn.Module, name: str, cut: Cut) -> bool:
    module = root.get_submodule(name.rpartition(".")[0])
    assert isinstance(module, QuantLinear)
    return module.block_aligned(cut.dim, cut.start, cut.size)


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


def _part(total: int, tp: TPGroup, name: str, dim: int = 0, unit: int = 1) -> Cut:
    """Rank `tp.rank`'s equal share of `total` items of `unit` indices each, along `dim`."""
    size = _split(total, tp, name) * unit
    return Cut(dim, tp.rank * size, size)


def _attention_cuts(attn: Attention, tp: TPGroup) -> dict[str, Cut]:
    """Query heads (wq_b rows, sinks) and output groups (wo_a rows, wo_b columns)."""
    o_lora = attn.wo_a.weight.shape[0] // attn.o_groups
    groups = _part(attn.o_groups, tp, "o_groups", unit=o_lora)
    return {"wq_b.weight": _part(attn.n_heads, tp, "num_heads", unit=attn.head_dim),
            "attn_sink": _part(attn.n_heads, tp, "num_heads"),
            "wo_a.weight": groups, "wo_b.weight": Cut(1, groups.start, groups.size)}


def _localize_attention(attn: Attention, tp: TPGroup) -> None:
    """Sizes of an attention whose parameters hold this rank's heads and groups; all-reduce."""
    attn.wq_b.out_features, attn.wo_a.out_features = (attn.wq_b.weight.shape[0],
                                                      attn.wo_a.weight.shape[0])
    attn.wo_b.in_features = attn.wo_b.weight.shape[1]
    attn.n_heads, attn.o_groups = attn.attn_sink.shape[0], attn.o_groups // tp.size
    attn.reduce = AllReduce(tp)


def _moe_cuts(moe: MoE, tp: TPGroup, expert_parallel: bool) -> dict[str, Cut]:
    """Routed experts by id (`expert_parallel`) or by intermediate dim (w1 / w3 rows, w2
    columns); the shared expert by intermediate dim. The gate is replicated. Experts kept in
    checkpoint encoding (`QuantExperts`) split by id only; their cuts are named w1 / w2 / w3 as
    the checkpoint's tensors are (what the per-rank loader reads), and `shard_model` cuts their
    code and scale buffers the same way (`LocalQuantExperts`)."""
    experts, shared = moe.experts, moe.shared_experts
    quant = isinstance(experts, QuantExperts)
    if quant and not expert_parallel:
        raise ValueError("tensor parallelism of checkpoint-format (FP4 / FP8) experts by "
                         "intermediate dimension is not supported; allowed: expert parallelism "
                         "(ep_size = tp_size) or weight_format='bf16'")
    if not quant and not all(isinstance(getattr(experts, n, None), nn.Parameter)
                             for n in ("w1", "w2", "w3")):
        raise ValueError(f"routed experts of type {type(experts).__name__} cannot be sharded; "
                         "allowed: Experts or QuantExperts")
    if expert_parallel:
        ids = _part(moe.gate.weight.shape[0], tp, "n_routed_experts")
        cuts = {f"experts.{n}": ids for n in ("w1", "w2", "w3")}
    else:
        inter = experts.w1.shape[1]
        cuts = {"experts.w1": _part(inter, tp, "moe_inter_dim", dim=1),
                "experts.w3": _part(inter, tp, "moe_inter_dim", dim=1),
                "experts.w2": _part(inter, tp, "moe_inter_dim", dim=2)}
    inter = shared.w1.weight.shape[0]
    return {**cuts, "shared_experts.w1.weight": _part(inter, tp, "shared expert inter dim"),
            "shared_experts.w3.weight": _part(inter, tp, "shared expert inter dim"),
            "shared_experts.w2.weight": _part(inter, tp, "shared expert inter dim", dim=1)}


def _local_routing(indices: torch.Tensor, weights: torch.Tensor, start: int,
                   count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(local ids, weights) of the (token, expert) pairs for experts [start, start + count): a
    pair routed elsewhere keeps an in-range id (0) with weight 0."""
    local = indices - start
    mine = (local >= 0) & (local < count)
    return torch.where(mine, local, 0), torch.where(mine, weights, 0.0)


class LocalExperts(Experts):
    """Experts [start, start + count) of a routed-expert layer (expert parallelism; parameter
    names unchanged), built from an `Experts` whose parameters already hold those experts: the
    (token, expert) pairs routed elsewhere get weight 0 on an in-range id, so the same op computes
    this rank's share of the layer's output."""

    def __init__(self, experts: Experts, ids: Cut) -> None:
        nn.Module.__init__(self)
        assert experts.w1.shape[0] == ids.size, "experts must already be cut to `ids`"
        self.limit, self.start, self.count = experts.limit, ids.start, ids.size
        self.w1, self.w2, self.w3 = experts.w1, experts.w2, experts.w3

    def forward(self, u: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                ctx: ForwardContext | None = None, *, mode: ForwardMode | None = None,
                combine: Combine = NO_COMBINE) -> torch.Tensor:
        local, weights = _local_routing(indices, weights, self.start, self.count)
        return super().forward(u, local, weights, ctx, mode=mode, combine=combine)


class LocalQuantExperts(QuantExperts):
    """`LocalExperts` for experts kept in checkpoint encoding: experts [start, start + count) of
    a `QuantExperts` (its code and scale buffers cut by expert id; buffer names unchanged), the
    pairs routed elsewhere weighted 0 on an in-range id."""

    def __init__(self, experts: QuantExperts, ids: Cut) -> None:
        nn.Module.__init__(self)
        self.fmt, self.limit, self.inter, self.d = (experts.fmt, experts.limit, experts.inter,
                                                    experts.d)
        self.start, self.count = ids.start, ids.size
        for name in ("w13", "w13_scale", "w2", "w2_scale"):
            self.register_buffer(name, ids.take(getattr(experts, name)).clone())

    def forward(self, u: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                ctx: ForwardContext | None = None, *, mode: ForwardMode | None = None,
                combine: Combine = NO_COMBINE) -> torch.Tensor:
        local, weights = _local_routing(indices, weights, self.start, self.count)
        return super().forward(u, local, weights, ctx, mode=mode, combine=combine)
