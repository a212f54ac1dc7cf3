"""Smoke test of `benchmarks/decode_context_sweep.py` on CPU: micro preset, two contexts, batches 1
and 2."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from bench_script import load_benchmark

ROW_KEYS = {"system", "batch", "context", "status", "prefill_fit", "prefill_s", "ms_per_step",
            "tok_s", "weight_gb", "kv_gb", "floor_ms", "ratio"}


def test_smoke_sweep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_benchmark("decode_context_sweep")
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    argv = ["--preset", "micro", "--device", "cpu", "--dtype", "float32", "--contexts", "64,128",
            "--batches", "1,2", "--steps", "3", "--warmup-steps", "1", "--routing-steps", "2",
            "--copy-gib", "0.02", "--plot", str(png), "--out", str(out)]
    has_hf = importlib.util.find_spec("transformers") is not None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is fastest, and robust to a busy machine
    try:
        bench.main(argv + (["--hf"] if has_hf else []))
    finally:
        torch.set_num_threads(threads)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    result = json.loads(last)
    assert result == json.loads(out.read_text())
    assert png.stat().st_size > 0
    assert result["copy_gb_s"] > 0 and result["kernel_backend"] == "ref"
    dsv4 = [r for r in result["rows"] if r["system"] == "dsv4"]
    assert (sorted((r["batch"], r["context"]) for r in dsv4)
            == [(1, 64), (1, 128), (2, 64), (2, 128)])
    for row in result["rows"]:
        assert row["status"] == "ok", row
        assert ROW_KEYS <= set(row), row
        assert row["prefill_fit"] is True
        for key in ("prefill_s", "ms_per_step", "tok_s", "weight_gb", "floor_ms", "ratio"):
            assert row[key] > 0, (key, row)
    for row in dsv4:
        assert row["routing"] == "captured"
        # micro: top-2 routing
        assert all(1 <= e <= 2 * row["batch"] for e in row["experts_hit"])
    if has_hf:
        assert len([r for r in result["rows"] if r["system"] == "transformers"]) == 2
        assert set(result["speedup_vs_transformers"]) == {"64", "128"}


def test_sweep_with_overlap_captures_routing(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """With overlap scheduling a step's routing reaches the host one call later: the capture
    still records `--routing-steps` steps of every request (of micro's first 3 layers: the
    routing record covers those alone)."""
    bench = load_benchmark("decode_context_sweep")
    argv = ["--preset", "micro", "--device", "cpu", "--dtype", "float32", "--contexts", "64",
            "--batches", "2", "--batch-contexts", "64", "--steps", "2", "--warmup-steps", "1",
            "--routing-steps", "3", "--copy-gib", "0.02", "--overlap-schedule",
            "--num-layers", "3", "--out", str(tmp_path / "sweep.json")]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        bench.main(argv)
    finally:
        torch.set_num_threads(threads)
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["overlap_schedule"] is True and result["num_layers"] == 3
    for row in result["rows"]:
        assert row["status"] == "ok" and row["routing"] == "captured", row
        assert len(row["experts_hit"]) == 3, row          # one entry per MoE layer of the 3


@pytest.mark.parametrize("one_engine", [False, True])
def test_sweep_with_the_engine_warmup(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      one_engine: bool) -> None:
    """`--engine-warmup fast` runs the engine's warmup before the points (each new engine, or the
    shared one once) and records its seconds; the points still run as without it."""
    bench = load_benchmark("decode_context_sweep")
    argv = ["--preset", "micro", "--device", "cpu", "--dtype", "float32", "--contexts", "64",
            "--batches", "2", "--batch-contexts", "64", "--steps", "2", "--warmup-steps", "1",
            "--routing-steps", "0", "--copy-gib", "0.02", "--engine-warmup", "fast",
            "--out", str(tmp_path / "sweep.json")] + (["--one-engine"] if one_engine else [])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        bench.main(argv)
    finally:
        torch.set_num_threads(threads)
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["engine_warmup"] == "fast"
    rows = [r for r in result["rows"] if r["system"] == "dsv4"]
    assert [r["status"] for r in rows] == ["ok", "ok"]
    if one_engine:
        assert result["shared_engine_warmup_s"] > 0
        assert not any("engine_warmup_s" in r for r in rows)
    else:
        assert result["shared_engine_warmup_s"] is None
        assert all(r["engine_warmup_s"] > 0 for r in rows), rows


def test_floor_model() -> None:
    """Bytes per step: KV grows with the context; distinct experts saturate at n_routed_experts."""
    bench = load_benchmark("decode_context_sweep")
    from dsv4.checkpoint.presets import flash_4l

    cfg = flash_4l()
    small, large = bench.kv_bytes(cfg, 4096, 2), bench.kv_bytes(cfg, 131072, 2)
    # 4 layers x window 128 x 512, C4 top-512 x 512 + 1024 keys x 128, C128 32 entries x 512
    # (2 B each)
    assert small == 2 * (4 * 128 * 512 + 2 * (512 * 512 + 1024 * 128) + 2 * 32 * 512)
    assert large > small
    assert bench.expected_experts(cfg, 1) == pytest.approx([6.0] * 4)
    assert bench.expected_experts(cfg, 10_000) == pytest.approx([256.0] * 4)


def test_failing_configuration_is_a_row() -> None:
    """An out-of-memory (or any error) becomes the row's status, keeping what was measured before
    it."""
    bench = load_benchmark("decode_context_sweep")

    def decode_oom(row: dict[str, object]) -> None:
        row.update(prefill_s=1.5, prefill_fit=True)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 40.00 GiB")

    def broken(row: dict[str, object]) -> None:
        raise ValueError("bad\nsecond line")

    row = bench.measure("dsv4", 1, 131072, decode_oom)
    assert row["status"] == "oom" and row["prefill_fit"] is True and row["prefill_s"] == 1.5
    row = bench.measure("transformers", 1, 16384, broken)
    assert row["status"] == "error: ValueError: bad" and row["prefill_fit"] is False


def test_floor_counts_checkpoint_precision_bytes() -> None:
    """With FP4 experts and FP8 linears the floor counts their codes and scales (buffers: the
    experts' per hit expert, the linears' whole), not their split-K counters."""
    bench = load_benchmark("decode_context_sweep")
    from dsv4.checkpoint.presets import micro
    from dsv4.checkpoint.writer import random_model

    cfg = micro()
    coded = random_model(cfg, torch.bfloat16, torch.device("cpu"), 0, "checkpoint")
    hits = [6.0] * cfg.num_layers
    buffers = dict(coded.named_buffers())
    experts = sum(b.nbytes for n, b in buffers.items()
                  if n.startswith("layers.") and ".experts.w" in n)
    linears = sum(b.nbytes for n, b in buffers.items()
                  if n.startswith("layers.") and n.endswith((".weight", ".scale"))
                  and ".experts." not in n)       # (the MTP head is not in a decode step)
    assert experts > 0 and linears > 0
    params = bench.weight_bytes(coded, 1, hits)
    bench.CODED_BUFFERS = ("-",)                # the parameters alone
    want = bench.weight_bytes(coded, 1, hits) + linears + experts * 6 / cfg.n_routed_experts
    assert params == pytest.approx(want)


def test_step_times_count_each_call() -> None:
    """`--step-times` (CPU: wall times): one entry per call, each covering the call's work, and
    the device list equals the host list without CUDA."""
    import time as _time

    bench = load_benchmark("decode_context_sweep")
    calls: list[int] = []

    def step() -> None:
        calls.append(1)
        _time.sleep(0.002)

    device_ms, host_ms, wait_ms = bench.step_times(step, 3, torch.device("cpu"))
    assert len(calls) == 3 and len(host_ms) == 3 and device_ms == host_ms
    assert all(ms >= 2.0 for ms in host_ms) and wait_ms == [0.0] * 3


def test_time_in_accumulates_and_restores() -> None:
    """`time_in` (the host-wait timer of `--step-times`): each wrapped call adds its wall time,
    results and exceptions pass through, and the method is restored on exit."""
    import time as _time

    bench = load_benchmark("decode_context_sweep")

    class Event:
        def synchronize(self, ms: float = 2.0) -> str:
            _time.sleep(ms / 1e3)
            return "done"

    original = Event.synchronize
    with bench.time_in(Event, "synchronize") as spent:
        assert Event().synchronize() == "done"
        first = spent[0]
        assert first >= 2e-3
        Event().synchronize(1.0)
        assert spent[0] >= first + 1e-3
        spent[0] = 0.0
        with pytest.raises(TypeError):
            Event().synchronize("x")        # type: ignore[arg-type]
        assert spent[0] > 0.0
    assert Event.synchronize is original


def test_one_engine_runs_every_point_in_one_engine(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """--one-engine: the warm-up and every point share one engine sized for the largest point,
    each point's requests aborted after it (the server's protocol: no engine built per point);
    --order desc runs the points largest first; phases carry their start times."""
    bench = load_benchmark("decode_context_sweep")
    built: list[object] = []
    original = bench.LLMEngine

    def counting(*a: object, **k: object) -> object:
        engine = original(*a, **k)
        built.append(engine)
        return engine

    monkeypatch.setattr(bench, "LLMEngine", counting)
    out = tmp_path / "one.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        bench.main(["--preset", "micro", "--device", "cpu", "--dtype", "float32", "--contexts",
                    "64,160", "--batches", "2", "--steps", "3", "--warmup-steps", "1",
                    "--routing-steps", "1", "--copy-gib", "0.02", "--one-engine", "--step-times",
                    "--phases", "3", "--order", "desc",
                    "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    result = json.loads(out.read_text())
    assert result["one_engine"] is True and len(built) == 1
    engine = built[0]
    assert not engine.has_unfinished() and engine.num_running == 0
    assert len(engine.requests) == 1 + 1 + 1 + 2 + 2  # the warm-up and the four points
    assert all(r.is_finished for r in engine.requests.values())
    engine.check_integrity()
    # each point's routing capture is switched off after it: the next point's timed steps (and
    # their graphs) must not capture routing
    assert engine.runner.config.capture_routing is False
    rows = [r for r in result["rows"] if r["system"] == "dsv4"]
    # --order desc: the largest point first (the 4K step timed after the 900K one)
    assert [(r["batch"], r["context"]) for r in rows] == [(2, 160), (2, 64), (1, 160), (1, 64)]
    for row in rows:
        assert row["status"] == "ok", row
        assert row["ms_per_step"] > 0 and len(row["step_ms_device"]) == 3
        assert len(row["phase_ms"]) == 3 and row["phase_ms"][0] == row["ms_per_step"]
        assert all(ms > 0 for ms in row["phase_ms"])
        starts = row["phase_start_unix"]
        assert len(starts) == 2 and row["prefill_end_unix"] <= starts[0] <= starts[1]
    # the pools hold the largest point: 2 requests of 160 prompt tokens and their outputs
    assert engine.max_total_tokens >= 2 * (160 + 3)


def test_prefill_step_times_and_stack_dumps(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--prefill-step-times`: one [seconds, prefill tokens, decode tokens] entry per prefill
    step, the prefill tokens adding up to the prompts' (the engine's counters);
    `--stack-dump-s`: faulthandler's periodic dump armed for each prefill and cancelled after it
    (spied: real dumps of every thread at test speed can crash a pytest-xdist worker);
    `--compile-times`: the point's build log in the row."""
    bench = load_benchmark("decode_context_sweep")
    calls: list[object] = []
    phases: list[str] = []

    class PhaseLog(bench.CompileLog):  # type: ignore[name-defined,misc]
        """Records each phase the sweep files builds under (the CPU kernels build nothing)."""

        def __setattr__(self, name: str, value: object) -> None:
            if name == "phase":
                phases.append(str(value))
            super().__setattr__(name, value)

    monkeypatch.setattr(bench, "CompileLog", PhaseLog)
    monkeypatch.setattr(bench.faulthandler, "dump_traceback_later",
                        lambda timeout, repeat=False, file=None: calls.append((timeout, repeat)))
    monkeypatch.setattr(bench.faulthandler, "cancel_dump_traceback_later",
                        lambda: calls.append("cancel"))
    argv = ["--preset", "micro", "--device", "cpu", "--dtype", "float32", "--contexts", "96",
            "--batches", "2", "--batch-contexts", "96", "--steps", "2", "--warmup-steps", "1",
            "--routing-steps", "0", "--copy-gib", "0.02", "--chunked-prefill-size", "64",
            "--prefill-step-times", "--stack-dump-s", "7.5", "--compile-times"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = bench.main(argv)
    finally:
        torch.set_num_threads(threads)
    (row,) = [r for r in result["rows"] if r["system"] == "dsv4" and r["batch"] == 2]
    steps = row["prefill_steps"]
    assert len(steps) >= 3                       # 192 prompt tokens in 64-token steps
    assert all(s[0] > 0 and s[1] + s[2] <= 64 for s in steps)
    # the engine counts a 1-token chunk with logits as decode: at most one per request
    assert 2 * 96 - 2 <= sum(s[1] for s in steps) <= 2 * 96 <= sum(s[1] + s[2] for s in steps)
    # every prefill (the sweep's warm-up point's too) arms the dump and cancels it
    dsv4_rows = [r for r in result["rows"] if r["system"] == "dsv4"]
    assert len(calls) >= 2 * len(dsv4_rows)
    assert calls == [(7.5, True), "cancel"] * (len(calls) // 2)
    # `--compile-times`: the point's log is in the row (the CPU reference kernels build nothing)
    assert row["compiles"] == {} and row["slowest_compiles"] == []
    assert row["builds_after_warmup"] == []
    # each point (the sweep's warm-up point too): the warmup, then its prefill, decode and
    # routing steps
    points = len(dsv4_rows) + 1
    assert phases == ["warmup", "prefill", "decode", "routing"] * points, phases
