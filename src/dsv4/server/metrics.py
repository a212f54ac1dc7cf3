"""Serving metrics, kept in the API process and exposed at GET /metrics in Prometheus text format.

Owns `ServerMetrics`: counters (requests by finish reason, prompt / cached prompt / generated
tokens), histograms (time to first token, time per output token — as the API process sees the
tokens arrive, so they include the IPC hop), a generated-tokens/s gauge over a sliding window, and
the render function that adds the engine's gauges (running / waiting requests, KV pool usage, free
request slots) from an `EngineSnapshot` fetched at scrape time. A speculating engine adds
`dsv4_spec_*`: verify passes by accepted drafts (`dsv4_spec_accepted_drafts_total{accepted="k"}`,
k = 0..N), drafts verified and accepted, and the mean acceptance length (tokens per verify pass).
The exposition is hand-written (format 0.0.4); names start `dsv4_`.

Test: `pytest tests/server/test_components.py -k metrics`,
`pytest tests/server/test_speculative_server.py`.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from dsv4.server.ipc import EngineSnapshot

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
RATE_WINDOW_S = 10.0


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)   # last: +Inf
        self.total, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, n in zip([*map(str, self.buckets), "+Inf"], self.counts, strict=True):
            cumulative += n
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {cumulative}')
        lines += [f"{self.name}_sum {self.total}", f"{self.name}_count {self.count}"]
        return lines


class Delta(Protocol):
    """What the metrics read of a request's delta (the client's `ChoiceDelta`: tokens kept, final
    reason)."""

    @property
    def token_ids(self) -> list[int]: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def cached_tokens(self) -> int: ...


@dataclass
class RequestTiming:
    """Per engine request: when it was sent and when its tokens arrived (time.monotonic seconds)."""

    sent: float
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0


@dataclass
class ServerMetrics:
    ttft: Histogram = field(default_factory=lambda: Histogram(
        "dsv4_time_to_first_token_seconds",
        "Time from sending a request to the engine to its first token.", TTFT_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(
        "dsv4_time_per_output_token_seconds",
        "Mean time between output tokens of a finished request.", TPOT_BUCKETS))
    finished: dict[str, int] = field(default_factory=dict)
    rejected: dict[int, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    _recent: deque[tuple[float, int]] = field(default_factory=deque)

    def on_delta(self, timing: RequestTiming, delta: Delta, now: float) -> None:
        n = len(delta.token_ids)
        if n:
            if timing.first_token is None:
                timing.first_token = now
                self.ttft.observe(now - timing.sent)
            timing.last_token, timing.num_tokens = now, timing.num_tokens + n
            self.generated_tokens += n
            self._recent.append((now, n))
        if delta.finish_reason is not None:
            self._on_finish(timing, delta)

    def _on_finish(self, timing: RequestTiming, delta: Delta) -> None:
        self.finished[delta.finish_reason or ""] = (
            self.finished.get(delta.finish_reason or "", 0) + 1)
        self.prompt_tokens += delta.num_prompt_tokens
        self.cached_tokens += delta.cached_tokens
        if (timing.num_tokens > 1 and timing.first_token is not None
                and timing.last_token is not None):
            self.tpot.observe((timing.last_token - timing.first_token) / (timing.num_tokens - 1))

    def on_rejected(self, status: int) -> None:
        self.rejected[status] = self.rejected.get(status, 0) + 1

    def tokens_per_second(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()
        return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def render(self, engine: EngineSnapshot | None, healthy: bool, num_inflight: int) -> str:
        lines = _gauge("dsv4_healthy", "1 when the engine is loaded and alive.", int(healthy))
        lines += _gauge("dsv4_requests_inflight",
                        "Engine requests sent by the API and not finished.", num_inflight)
        lines += self._counters()
        lines += _gauge("dsv4_generation_tokens_per_second",
                        f"Generated tokens/s over the last {RATE_WINDOW_S:g} s.",
                        round(self.tokens_per_second(), 3))
        hit = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        lines += _gauge("dsv4_prefix_cache_hit_rate",
                        "Cached prompt tokens / prompt tokens of finished requests.", round(hit, 6))
        lines += self.ttft.render() + self.tpot.render()
        if engine is not None:
            lines += _engine_gauges(engine)
        return "\n".join(lines) + "\n"

    def _counters(self) -> list[str]:
        lines = ["# HELP dsv4_requests_finished_total Finished engine requests by finish reason.",
                 "# TYPE dsv4_requests_finished_total counter"]
        lines += [f'dsv4_requests_finished_total{{finish_reason="{r}"}} {n}'
                  for r, n in sorted(self.finished.items())]
        lines += ["# HELP dsv4_requests_rejected_total "
                  "HTTP requests rejected before reaching the engine, by status.",
                  "# TYPE dsv4_requests_rejected_total counter"]
        lines += [f'dsv4_requests_rejected_total{{status="{s}"}} {n}'
                  for s, n in sorted(self.rejected.items())]
        lines += _counter("dsv4_prompt_tokens_total", "Prompt tokens of finished requests.",
                          self.prompt_tokens)
        lines += _counter("dsv4_cached_prompt_tokens_total",
                          "Prompt tokens served from the prefix cache.", self.cached_tokens)
        lines += _counter("dsv4_generation_tokens_total", "Generated tokens.",
                          self.generated_tokens)
        return lines


def _engine_gauges(s: EngineSnapshot) -> list[str]:
    lines = _gauge("dsv4_requests_running", "Requests in the engine's running batch.",
                   s.num_running)
    lines += _gauge("dsv4_requests_waiting", "Requests in the engine's waiting queue.",
                    s.num_waiting)
    lines += _gauge("dsv4_request_slots_free", "Free request slots of the engine.", s.free_slots)
    lines += ["# HELP dsv4_kv_pages_free Free KV cache pages by pool.",
              "# TYPE dsv4_kv_pages_free gauge",
              f'dsv4_kv_pages_free{{pool="full"}} {s.full_free}',
              f'dsv4_kv_pages_free{{pool="swa"}} {s.swa_free}',
              "# HELP dsv4_kv_pages_usable Usable KV cache pages by pool.",
              "# TYPE dsv4_kv_pages_usable gauge",
              f'dsv4_kv_pages_usable{{pool="full"}} {s.full_usable}',
              f'dsv4_kv_pages_usable{{pool="swa"}} {s.swa_usable}',
              "# HELP dsv4_kv_cache_usage Fraction of usable KV pages in use by pool.",
              "# TYPE dsv4_kv_cache_usage gauge",
              f'dsv4_kv_cache_usage{{pool="full"}} {1 - s.full_free / max(1, s.full_usable):.6f}',
              f'dsv4_kv_cache_usage{{pool="swa"}} {1 - s.swa_free / max(1, s.swa_usable):.6f}']
    lines += _counter("dsv4_requests_aborted_total",
                      "Requests aborted in the engine (client gone, abort, shutdown).",
                      s.num_aborted)
    lines += _counter("dsv4_engine_steps_total", "Engine steps run.", s.steps)
    lines += _counter("dsv4_preemptions_total",
                      "Requests preempted for lack of KV pages or retracted by a weight update.",
                      s.num_preemptions)
    lines += _gauge("dsv4_weight_version", "Weight updates applied since the model loaded.",
                    s.weight_version)
    if s.spec_num_steps:
        lines += _speculative(s)
    return lines


def _speculative(s: EngineSnapshot) -> list[str]:
    """Speculative decoding's series: verify passes by accepted drafts (k = 0..N), drafts verified
    and accepted, and tokens per verify pass (NaN before the first)."""
    lines = _gauge("dsv4_spec_num_steps", "Draft tokens per speculative decode step (N).",
                   s.spec_num_steps)
    lines += ["# HELP dsv4_spec_accepted_drafts_total Verify passes by drafts accepted.",
              "# TYPE dsv4_spec_accepted_drafts_total counter"]
    lines += [f'dsv4_spec_accepted_drafts_total{{accepted="{k}"}} {n}'
              for k, n in enumerate(s.spec_accept_hist)]
    lines += _counter("dsv4_spec_draft_tokens_total", "Draft tokens verified by the target.",
                      s.spec_draft_tokens)
    lines += _counter("dsv4_spec_accepted_tokens_total", "Draft tokens the target accepted.",
                      s.spec_accepted_tokens)
    mean = s.mean_acceptance_length
    lines += _gauge("dsv4_spec_mean_acceptance_length",
                    "Tokens per verify pass (1 + accepted drafts / passes) since the start.",
                    math.nan if mean is None else round(mean, 6))
    return lines


def _gauge(name: str, help_text: str, value: float) -> list[str]:
    # NOTE: the exposition format spells a missing ratio "NaN" (Python prints "nan")
    text = "NaN" if math.isnan(value) else str(value)
    return [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {text}"]


def _counter(name: str, help_text: str, value: float) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {value}"]
