"""ForwardMode: how a full-sequence forward computes (a serving step carries a ForwardContext).

The mode is an argument of the call (`model(ids, mode=TRAINING)`), never inferred from autograd
state. Both presets compute the same function; they differ in formulation, hence in cost and
rounding:

    mode       attention                                  routed experts
    INFERENCE  gathered: one softmax over each query's    sparse: the tokens routed to each
               index row into [window keys | entries]     expert go through it
               (`sparse_attention`, kernels/ref)          (`routed_experts`, kernels/ref)
    TRAINING   dense: masked [S, S + E] logits, two       dense: every expert on every token,
               matmuls; a cheap backward                  weighted by the (mostly zero) routing
                                                          (`routed_experts_dense`)

Which are numerically identical: INFERENCE runs the `ref` kernel backend's formulation and ops
(the serving path's `sparse_attention_multi` and `routed_experts`), so the engine on `ref` matches
it to rounding only where a sequence is split into steps (fp32: within 1e-4,
`tests/engine/test_engine_equivalence.py`). TRAINING equals INFERENCE to rounding, not bit for bit
(fp32: within 1e-5, `tests/model/test_dense_attention.py`); a trainer that must score tokens
bit-identically to the engine runs INFERENCE's formulation.

`values` (a `KernelOps`, None: the formulations above) takes the forward values of the ops the
engine runs through its kernel backend (sparse attention, mHC pre / post / head, routed experts,
RMSNorm) from those kernels, and their gradients from the formulation above
(`model/kernel_values.py`): with the engine's ops under token-count-invariant launch plans the
full-sequence forward reproduces the engine's values (the RL default mode on a GPU).

`replay` carries the selections a rollout recorded (RL: R3 routing replay and indexer replay,
`Replay`): a forward given one routes every token of MoE layer l to `replay.experts[b, s, l]`
(the live router's scores are gathered at those ids, so the gate keeps its gradient) and lets
every query of the j-th CSA layer attend to the entries `replay.indexer[b, s, j]` instead of the
indexer's live top-k. `with_replay` derives such a mode from a preset; the presets carry none.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

import torch

from dsv4.kernels.registry import KernelOps

AttentionForm = Literal["gathered", "dense"]
ExpertsForm = Literal["sparse", "dense"]


@dataclass(frozen=True, eq=False)
class Replay:
    """Recorded selections for a [B, S] forward (int tensors on the model's device, -1 = none).

    `experts`: [B, S, num_layers, num_experts_per_tok], the routed expert ids of every decoder
    layer in layer order (hash layers included: the engine records their table lookups, and the
    forward checks them against the table). `indexer`: [B, S, num_csa_layers, index_topk], the
    C4 entry ids each query attended to, per CSA layer in layer order, in the engine's pick order.
    Either may be None (that selection runs live). Rows of padding tokens may be all -1: they
    route to experts 0..k-1 and attend to no entry (their outputs are masked by the caller).
    Shapes and id ranges are checked by `DeepSeekV4ForCausalLM.check_replay` before a forward.
    """

    experts: torch.Tensor | None = None
    indexer: torch.Tensor | None = None


@dataclass(frozen=True)
class ForwardMode:
    """`attention` / `experts`: the formulations above. `replay`: recorded selections to reuse.
    `fixed_widths`: attend over index rows of a fixed width (window + `index_topk` picks, or
    window + every entry of the context for HCA) so that a query's softmax does not depend on the
    sequence length: with `batch_invariant()` matmuls this is the computation of the engine's
    `batch_invariant` mode, token for token (true on-policy RL). `values`: the kernels that give
    the forward values (module docstring), None for the formulations' own. `checkpoint_blocks`:
    activation checkpointing per block (`torch.utils.checkpoint`, non-reentrant): a block keeps
    only its input for the backward and recomputes its activations there, so a backward holds
    one block's activations at a time for a second forward's compute; the same values and
    gradients (the forward is deterministic)."""

    name: str
    attention: AttentionForm
    experts: ExpertsForm
    replay: Replay | None = field(default=None, compare=False)
    fixed_widths: bool = False
    values: KernelOps | None = field(default=None, compare=False)
    checkpoint_blocks: bool = False

    def with_checkpointing(self, on: bool) -> ForwardMode:
        """This mode with activation checkpointing per block on or off."""
        return replace(self, checkpoint_blocks=on)

    def with_values(self, ops: KernelOps | None) -> ForwardMode:
        """This mode with forward values from `ops` (None: the formulations' own)."""
        suffix = f"+{ops.name}-values" if ops is not None else ""
        return replace(self, name=self.name + suffix, values=ops)

    def with_replay(self, replay: Replay | None, fixed_widths: bool | None = None
                    ) -> ForwardMode:
        """This mode with `replay` (and `fixed_widths` when given)."""
        widths = self.fixed_widths if fixed_widths is None else fixed_widths
        return replace(self, name=f"{self.name}+replay" if replay is not None else self.name,
                       replay=replay, fixed_widths=widths)

    def __post_init__(self) -> None:
        if self.attention not in ("gathered", "dense"):
            raise ValueError(f"attention={self.attention!r} is invalid; "
                             "allowed: 'gathered', 'dense'")
        if self.experts not in ("sparse", "dense"):
            raise ValueError(f"experts={self.experts!r} is invalid; allowed: 'sparse', 'dense'")
        if self.replay is not None and not isinstance(self.replay, Replay):
            raise TypeError(f"replay={type(self.replay).__name__} is invalid; "
                            "allowed: None or a Replay")


INFERENCE = ForwardMode("inference", attention="gathered", experts="sparse")
TRAINING = ForwardMode("training", attention="dense", experts="dense")
