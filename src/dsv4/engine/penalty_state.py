"""PenaltyState: per request slot, the output-token counts and prompt-or-output membership that
frequency, presence and repetition penalties read (`engine/sampler.py::apply_penalties`).

Kept for requests with penalties only (`SamplingParams.uses_penalties`): a slot's rows are rebuilt
from the request's own tokens when such a request is admitted (`admit`), and counted in every step
where some row uses penalties (`record`), which every step of such a request is. Another request's
rows hold whatever its slot last held; a step that reads them (a batch mixing both kinds) applies
neutral penalties to them, an identity on any values. Nothing here copies a host tensor into a
device tensor synchronously (scalar fills only; index rows go through pinned `to_device`).
"""

from __future__ import annotations

import torch

from dsv4.engine.request import Request
from dsv4.utils.device import to_device


class PenaltyState:
    def __init__(self, max_requests: int, vocab_size: int, device: torch.device) -> None:
        self.device = device
        self.token_counts = torch.zeros(max_requests, vocab_size, dtype=torch.int32,
                                        device=device)
        self.seen = torch.zeros(max_requests, vocab_size, dtype=torch.bool, device=device)

    def admit(self, req: Request) -> None:
        """Rebuild the rows of `req`'s slot from its tokens (a new, re-admitted or cache-continued
        request with penalties; none of its tokens still on the device)."""
        assert req.slot is not None and req.params.uses_penalties
        assert not req.num_inflight, "admitted with a token still on the device"
        self.token_counts[req.slot] = 0
        self.seen[req.slot] = False
        # index_fill_ takes the value as a scalar: no host tensor to copy (a sync)
        self.seen[req.slot].index_fill_(0, to_device(torch.tensor(req.all_ids), self.device),
                                        True)
        if req.output_ids:
            out = to_device(torch.tensor(req.output_ids), self.device)
            self.token_counts[req.slot].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))

    def read(self, reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(slots, counts, seen) of one row per request in `reqs`: [R], [R, V] int32, [R, V]."""
        slots = to_device(torch.tensor([r.slot for r in reqs], dtype=torch.int64), self.device)
        return slots, self.token_counts[slots], self.seen[slots]

    def record(self, slots: torch.Tensor, tokens: torch.Tensor, counted: torch.Tensor,
               marked: torch.Tensor) -> None:
        """Count `tokens` [R] at `slots` [R] by `counted` [R] int32 (0 leaves a row's count) and
        mark `marked` [R] as seen."""
        self.token_counts.index_put_((slots, tokens), counted, accumulate=True)
        self.seen.index_put_((slots, marked), torch.ones_like(marked, dtype=torch.bool))
