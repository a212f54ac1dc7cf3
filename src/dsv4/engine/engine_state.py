"""`EngineState`: what an engine reports about itself (`LLMEngine.snapshot`), the payload of the
server's /v1/engine_stats and /metrics (`server/metrics.py`), sent from the engine process to the
API process (`server/ipc.py`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineState:
    """What the engine reports about itself (the server's /v1/engine_stats and /metrics).

    Pages `*_cached` are held by the prefix cache: with no request in flight, `*_free + *_cached ==
    *_usable` for both pools."""

    num_running: int
    num_waiting: int
    num_requests: int
    full_free: int
    full_usable: int
    full_cached: int
    swa_free: int
    swa_usable: int
    swa_cached: int
    free_slots: int
    num_slots: int
    steps: int
    prefill_tokens: int
    decode_tokens: int
    num_preemptions: int
    # speculative decoding: N (0 = off), verify passes by accepted drafts (N + 1 counts), drafts
    # fed and accepted
    spec_num_steps: int = 0
    spec_accept_hist: tuple[int, ...] = ()
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens per verify pass (1 + accepted drafts / passes) since the start; None before any
        verify pass (speculative decoding off or not yet run)."""
        passes = sum(self.spec_accept_hist)
        return 1 + self.spec_accepted_tokens / passes if passes else None
