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

`replay` is where the verified-RL issue threads recorded routing (expert ids [T, L_moe, k]) and
indexer selections ([T, L_c4, index_topk]) into a forward; no mode carries any, and a forward given
one raises rather than ignore it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

AttentionForm = Literal["gathered", "dense"]
ExpertsForm = Literal["sparse", "dense"]


@dataclass(frozen=True)
class ForwardMode:
    """`attention` / `experts`: the formulations above. `replay`: recorded selections to reuse."""

    name: str
    attention: AttentionForm
    experts: ExpertsForm
    replay: None = None

    def __post_init__(self) -> None:
        if self.attention not in ("gathered", "dense"):
            raise ValueError(f"attention={self.attention!r} is invalid; "
                             "allowed: 'gathered', 'dense'")
        if self.experts not in ("sparse", "dense"):
            raise ValueError(f"experts={self.experts!r} is invalid; allowed: 'sparse', 'dense'")
        if self.replay is not None:
            raise NotImplementedError("routing / indexer replay is not implemented yet; "
                                      "allowed: replay=None")


INFERENCE = ForwardMode("inference", attention="gathered", experts="sparse")
TRAINING = ForwardMode("training", attention="dense", experts="dense")
