"""Random weights for one rank's shard (`load_format="dummy"` with several ranks; issue 22's
real-scale line, the in-memory source of issue 21).

`randomize_shard_(shard, full, cuts, seed)` fills a rank's skeleton (`shard_model` or
`enable_dp_attention` of the full model on the meta device) with exactly the values that
`checkpoint.writer.random_model(config, seed=seed)` then the same layout would hold, without ever
building the full model: every tensor and coded module draws from its own stream
(`model/random_init.py::name_generator`: seed and name), so a rank draws only what it holds,
plus the rest of a tensor it holds a cut of:

- float tensors: the full tensor drawn (`random_init.init_tensor`) and narrowed to the rank's `Cut`;
  stacked routed experts one expert at a time, only the rank's experts under expert parallelism;
- checkpoint-format routed experts (`QuantExperts`): each expert's codes from its own stream
  (`random_init.expert_generator`), only the rank's (`LocalQuantExperts.start`);
- FP8 linears (`QuantLinear`): the full codes drawn, then cut on their scale blocks
  (`QuantLinear.narrow_`), or dequantised and cut where the layout dequantised that linear
  (`tp.cut_modules_`).

Invariant (tested): equal, bit for bit, to the one-process random model put through the same
layout, so a parallel run on random weights is checked against one process like a checkpoint.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from itertools import chain

import torch
from torch import nn

from dsv4.distributed.tp import Cut
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.model.quant_experts import QuantExperts
from dsv4.model.quant_linear import QuantLinear
from dsv4.model.random_init import expert_generator, init_tensor, name_generator
from dsv4.model.weights import internal_to_official


@dataclass(frozen=True)
class FullShapes:
    """What the full model holds, recorded before the layout cuts it (the meta full model is cut
    in place): every parameter's and buffer's shape, and each FP8 linear's (in, out)."""

    tensors: dict[str, tuple[int, ...]]
    linears: dict[str, tuple[int, int]]

    @classmethod
    def of(cls, full: DeepSeekV4ForCausalLM) -> FullShapes:
        return cls({n: tuple(t.shape) for n, t in chain(full.named_parameters(),
                                                        full.named_buffers())},
                   {n: (m.in_features, m.out_features) for n, m in full.named_modules()
                    if isinstance(m, QuantLinear)})


@torch.no_grad()
def randomize_shard_(shard: DeepSeekV4ForCausalLM, full: FullShapes, cuts: dict[str, Cut],
                     seed: int) -> DeepSeekV4ForCausalLM:
    """Fill `shard` (materialised, any device) in place as the module docstring says."""
    coded: set[int] = set()
    for name, module in shard.named_modules():
        if isinstance(module, QuantExperts):
            module.randomize_(functools.partial(expert_generator, seed, name, module.w13.device))
        elif name in full.linears:
            _fill_linear(module, name, full.linears[name], cuts.get(f"{name}.weight"), seed)
        else:
            continue
        coded.update(id(t) for t in chain(module.parameters(), module.buffers()))
    num_experts = shard.config.n_routed_experts
    for name, t in chain(shard.named_parameters(), shard.named_buffers()):
        if name.endswith("inv_freq") or id(t) in coded or name not in full.tensors:
            continue
        _fill_tensor(t, name, full.tensors[name], cuts.get(name), num_experts, shard, seed)
    return shard


def _fill_linear(module: nn.Module, name: str, shape: tuple[int, int], cut: Cut | None,
                 seed: int) -> None:
    """An FP8 linear's codes drawn whole, then this rank's cut: kept coded (`QuantLinear`) or
    dequantised (an `nn.Linear` the layout made of it)."""
    device = next(chain(module.parameters(), module.buffers())).device
    whole = QuantLinear(*shape).to(device)
    whole.randomize_(name_generator(seed, name, device))
    if isinstance(module, QuantLinear):
        if cut is not None:
            whole.narrow_(cut.dim, cut.start, cut.size)
        module.weight.copy_(whole.weight)
        module.scale.copy_(whole.scale)
        return
    assert isinstance(module, nn.Linear), f"{name}: {type(module).__name__}"
    dense = whole.dequantized(module.weight.dtype)
    module.weight.copy_(dense if cut is None else cut.take(dense))


def _fill_tensor(t: torch.Tensor, name: str, shape: tuple[int, ...], cut: Cut | None,
                 num_experts: int, shard: DeepSeekV4ForCausalLM, seed: int) -> None:
    """One float (or index) tensor: its official tensors drawn whole, then cut."""
    config, device = shard.config, t.device
    for official, expert in internal_to_official(name, num_experts):
        if expert is None:
            value = init_tensor(official, shape, config, seed, device)
            t.copy_((value if cut is None else cut.take(value)).to(t.dtype))
            continue
        row = expert
        if cut is not None and cut.dim == 0:            # expert parallel: whole experts by id
            row = expert - cut.start
            if not 0 <= row < cut.size:
                continue
        value = init_tensor(official, shape[1:], config, seed, device)
        if cut is not None and cut.dim > 0:             # each expert's intermediate dim
            value = value.narrow(cut.dim - 1, cut.start, cut.size)
        t[row].copy_(value.to(t.dtype))
