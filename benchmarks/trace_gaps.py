"""Where a step's GPU timeline is idle: read a Chrome trace, split it into steps, list the gaps.

Input: the trace `profile_engine_step.py --trace F` writes (torch.profiler; plain or .gz). Device
events are those of category `kernel`, `gpu_memcpy` and `gpu_memset`, on every stream. Steps are
the runs of device events separated by more than `--step-gap-us` of idle device time (the host
work between profiled steps); runs of fewer than `--min-events` events are dropped (a step's
sampler tail, warm-up copies).

Per step: its span (first start to last end), busy time (the union of the events' intervals over
all streams) and idle time (span - busy). Per stream of the detailed step: its events and their
summed time (one stream's events never overlap, so a stream whose sum nears the span is the
step's critical path; the sums over the span's busy time are the streams' overlap). For the step
picked by `--step` (default: the last): the `--top` largest gaps with the events on both sides
(a gap: an event's start minus the latest end of every event before it, when positive: nothing
ran on any stream), and time per event name.

Prints a table, then ONE JSON line (also written to --out).

    python benchmarks/trace_gaps.py /tmp/trace.json --top 15
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
NAME_CHARS = 120        # event names are cut here (C++ template names run to 1,000+ characters)


class Event(NamedTuple):
    name: str
    start: float        # us
    dur: float          # us
    stream: int

    @property
    def end(self) -> float:
        return self.start + self.dur


def load_events(path: Path) -> list[Event]:
    """The device events of a Chrome trace, sorted by start."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    out = [Event(str(e["name"])[:NAME_CHARS], float(e["ts"]), float(e.get("dur", 0.0)),
                 int(e.get("tid", 0) if str(e.get("tid", 0)).isdigit() else 0))
           for e in events if e.get("cat") in DEVICE_CATEGORIES and "ts" in e]
    return sorted(out, key=lambda e: e.start)


def split_steps(events: Sequence[Event], step_gap_us: float, min_events: int) -> list[list[Event]]:
    """Runs of events separated by more than `step_gap_us` of idle device time."""
    steps: list[list[Event]] = []
    latest = None
    for e in events:
        if latest is None or e.start - latest > step_gap_us:
            steps.append([])
        steps[-1].append(e)
        latest = e.end if latest is None else max(latest, e.end)
    return [s for s in steps if len(s) >= min_events]


def gaps(step: Sequence[Event]) -> list[tuple[float, Event | None, Event]]:
    """(idle us, the event that ended last before it, the event after it), for every positive
    gap of the step in time order."""
    out: list[tuple[float, Event | None, Event]] = []
    last: Event | None = None
    for e in step:
        if last is not None and e.start > last.end:
            out.append((e.start - last.end, last, e))
        if last is None or e.end > last.end:
            last = e
    return out


def summarise(step: Sequence[Event], top: int) -> dict[str, Any]:
    """Span, busy, idle, the `top` largest gaps and the time per event name of one step."""
    span = max(e.end for e in step) - step[0].start
    idle = sum(g for g, _, _ in gaps(step))
    per_name: dict[str, list[float]] = {}
    for e in step:
        per_name.setdefault(e.name, []).append(e.dur)
    largest = sorted(gaps(step), key=lambda g: -g[0])[:top]
    per_stream: dict[int, list[float]] = {}
    for e in step:
        per_stream.setdefault(e.stream, []).append(e.dur)
    return {"events": len(step), "span_us": round(span, 2), "busy_us": round(span - idle, 2),
            "idle_us": round(idle, 2),
            "top_gaps": [{"gap_us": round(g, 2), "at_us": round(e.start - step[0].start, 2),
                          "after": b.name if b else None, "before": e.name}
                         for g, b, e in largest],
            "streams": sorted(({"stream": k, "events": len(d), "busy_us": round(sum(d), 2)}
                               for k, d in per_stream.items()), key=lambda r: -r["busy_us"]),
            "by_name": sorted(({"name": n, "count": len(d), "total_us": round(sum(d), 2)}
                               for n, d in per_name.items()), key=lambda r: -r["total_us"])}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", type=Path, help="Chrome trace JSON (.json or .json.gz)")
    p.add_argument("--step-gap-us", type=float, default=100.0,
                   help="idle device time that separates two steps")
    p.add_argument("--min-events", type=int, default=20, help="shorter runs are not steps")
    p.add_argument("--step", type=int, default=-1, help="the step detailed (index; default last)")
    p.add_argument("--top", type=int, default=10, help="largest gaps listed")
    p.add_argument("--out", type=Path, default=None, help="JSON path")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    steps = split_steps(load_events(args.trace), args.step_gap_us, args.min_events)
    if not steps:
        raise SystemExit(f"{args.trace}: no run of >= {args.min_events} device events")
    if not -len(steps) <= args.step < len(steps):
        raise SystemExit(f"--step {args.step}: the trace has {len(steps)} steps "
                         f"(allowed: {-len(steps)}..{len(steps) - 1})")
    rows = [summarise(s, 0) for s in steps]
    for i, r in enumerate(rows):
        print(f"step {i}: {r['events']} events, span {r['span_us']:.1f} us, busy "
              f"{r['busy_us']:.1f}, idle {r['idle_us']:.1f}")
    detail = summarise(steps[args.step], args.top)
    print(f"\nstreams of step {args.step % len(steps)} (span {detail['span_us']:.1f} us):")
    for r in detail["streams"]:
        print(f"  stream {r['stream']:>4}: {r['events']:4d} events, {r['busy_us']:8.1f} us")
    print(f"\nlargest gaps of step {args.step % len(steps)}:")
    for g in detail["top_gaps"]:
        print(f"  {g['gap_us']:7.2f} us at {g['at_us']:8.1f}: {str(g['after'])[:48]} -> "
              f"{g['before'][:48]}")
    print("\ntime by name:")
    for r in detail["by_name"][:args.top]:
        print(f"  {r['total_us']:9.1f} us  {r['count']:4d}x  {r['name'][:70]}")
    record = {"bench": "trace_gaps", "trace": str(args.trace), "steps": [
        {k: v for k, v in r.items() if k in ("events", "span_us", "busy_us", "idle_us")}
        for r in rows], "step": args.step % len(steps), "detail": detail}
    line = json.dumps(record)
    print(line)
    if args.out is not None:
        args.out.write_text(line + "\n")
    return record


if __name__ == "__main__":
    main()
