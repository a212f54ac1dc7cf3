"""Serving benchmark: TTFT, TPOT and throughput vs concurrency through `dsv4 serve`, and the
server's throughput at the highest concurrency vs offline `LLM.generate` on the same workload.

Workload (fixed seed): N requests per concurrency level with prompt lengths uniform in
[min_prompt, max_prompt] (random token ids, sent as `prompt: [ids]`), greedy, `ignore_eos`, exactly
`output_len` output tokens each, streamed over SSE with `stream_options.include_usage`. An async
httpx client keeps at most `c` requests in flight. TTFT = request sent -> first streamed chunk;
TPOT = (last chunk - first chunk) / (output tokens - 1); throughput = output tokens / wall time of
the level. Offline: the same prompts through `LLM.generate` with max_running_requests = the highest
concurrency, in this process while the server idles, interleaved with repeated server runs; the
best run of each side is compared. On CUDA (`--device cuda`) the offline runs come after the
server has stopped (two copies of a large model do not fit one GPU), the same number of times.
ITL = the gaps between streamed chunks (one token each), pooled over the level's requests.
Prints a table, then one JSON line.

    # flash-4l on one H200, random weights built in memory (no checkpoint on disk):
    dsv4 init --preset flash-4l --out /tmp/flash-4l --no-weights
    python benchmarks/serving.py --model /tmp/flash-4l --load-format dummy --device cuda \
        --concurrency 1,8,32,128 --min-prompt 4096 --max-prompt 4096 --output-len 256

    python benchmarks/serving.py                            # starts a server on the default model
    python benchmarks/serving.py --url http://127.0.0.1:8000 --skip-offline  # a running server
    python benchmarks/serving.py --api native     # through SGLang's /generate instead
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from dsv4 import LLM, SamplingParams
from dsv4.assets import default_model_path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="a running server (default: start one on --model)")
    p.add_argument("--model", default=None, help="checkpoint dir (default: the embedded model)")
    p.add_argument("--concurrency", default="1,8,32",
                   help="comma-separated levels; the last is compared offline")
    p.add_argument("--num-requests", type=int, default=256,
                   help="requests at the top level (level c: min(this, 8c))")
    p.add_argument("--repeats", type=int, default=3,
                   help="top-level server runs, each followed by an offline run")
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api", default="openai", choices=("openai", "native"),
                   help="openai: /v1/completions; native: SGLang's /generate (server/native.py)")
    p.add_argument("--page-size", type=int, default=None,
                   help="KV page size (default: the server's; a multiple of the model's "
                   "C128 ratio)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    p.add_argument("--server-log", default=None, help="write the started server's output here")
    p.add_argument("--plot", default=None,
                   help="PNG path: tok/s and TTFT / TPOT p50 and p99 against concurrency")
    p.add_argument("--replot", default=None,
                   help="only draw --plot from this JSON line (an earlier run's output)")
    p.add_argument("--warmup-pass", action="store_true",
                   help="run every level once, unmeasured, before measuring (and the offline "
                   "side once): steady-state figures, without first-use costs such as a CUDA "
                   "graph captured for a new batch / context bucket")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--offline-threads", type=int, default=None,
                   help="torch threads of the offline run "
                   "(default: torch's, one per core)")
    return p.parse_args()


@dataclass
class Sample:
    ttft: float
    tpot: float | None
    tokens: int
    itl: list[float]


def make_prompts(args: argparse.Namespace, vocab: int, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(args.seed)
    lens = torch.randint(args.min_prompt, args.max_prompt + 1, (n,), generator=g).tolist()
    return [torch.randint(2, vocab, (k,), generator=g).tolist() for k in lens]


async def one_request(http: httpx.AsyncClient, prompt: list[int], output_len: int,
                      api: str = "openai") -> Sample:
    """One streamed request through /v1/completions, or through SGLang's native /generate
    (`api="native"`: server/native.py, as `sglang.bench_serving --backend sglang` sends it)."""
    if api == "native":
        return await one_native_request(http, prompt, output_len)
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sent, first, last, tokens = time.perf_counter(), None, 0.0, 0
    gaps: list[float] = []
    async with http.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            # the last chunk; the others carry "usage":null and are not parsed
            if '"usage":{' in line:
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
            else:
                if first is not None:
                    gaps.append(now - last)
                first, last = first or now, now
    return timed_sample(sent, first, last, tokens, gaps, output_len)


async def one_native_request(http: httpx.AsyncClient, prompt: list[int],
                             output_len: int) -> Sample:
    """/generate streamed: each event carries the cumulative `completion_tokens`; a token's gap is
    its event's gap over the tokens that event added."""
    body = {"input_ids": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": output_len, "temperature": 0,
                                "ignore_eos": True}}
    sent, first, last, tokens = time.perf_counter(), None, 0.0, 0
    gaps: list[float] = []
    async with http.stream("POST", "/generate", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            count = json.loads(line[6:])["meta_info"]["completion_tokens"]
            if count == tokens:
                continue
            if first is not None:
                gaps += [(now - last) / (count - tokens)] * (count - tokens)
            first, last, tokens = first or now, now, count
    return timed_sample(sent, first, last, tokens, gaps, output_len)


def timed_sample(sent: float, first: float | None, last: float, tokens: int, gaps: list[float],
                 output_len: int) -> Sample:
    """A streamed request's timings (sent, first and last token arrivals); asserts that all of its
    `output_len` tokens came."""
    assert first is not None and tokens == output_len, f"incomplete response ({tokens} tokens)"
    return Sample(ttft=first - sent, tpot=(last - first) / (tokens - 1) if tokens > 1 else None,
                  tokens=tokens, itl=gaps)


async def run_level(url: str, prompts: list[list[int]], output_len: int,
                    concurrency: int, api: str = "openai") -> tuple[float, list[Sample]]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def bounded(http: httpx.AsyncClient, prompt: list[int]) -> Sample:
        async with sem:
            return await one_request(http, prompt, output_len, api)

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600.0) as http:
        await asyncio.gather(*(bounded(http, p) for p in prompts[:2]))     # warm-up
        start = time.perf_counter()
        samples = await asyncio.gather(*(bounded(http, p) for p in prompts))
        return time.perf_counter() - start, list(samples)


def start_server(args: argparse.Namespace, model: Path,
                 max_running: int) -> tuple[subprocess.Popen[bytes], str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "dsv4", "serve", "--model", str(model), "--port", str(port),
           "--max-running-requests", str(max_running), "--dtype", dtype_of(args),
           "--device", args.device, "--load-format", args.load_format]
    if args.page_size is not None:
        cmd += ["--page-size", str(args.page_size)]
    log = Path(args.server_log or os.devnull)
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    tail = log.read_text(errors="replace")[-3000:] if args.server_log else "(no --server-log)"
    raise RuntimeError(f"the server did not become healthy; its log ends:\n{tail}")


def dtype_of(args: argparse.Namespace) -> str:
    return str(args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))


def offline_llm(model: Path, args: argparse.Namespace, max_running: int) -> LLM:
    extra = {"kv_cache_memory_gb": 0.5} if args.device == "cpu" else {}
    if args.page_size is not None:
        extra["page_size"] = args.page_size
    llm = LLM(model, dtype=dtype_of(args), device=args.device, load_format=args.load_format,
              max_running_requests=max_running, **extra)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompt_token_ids=make_prompts(args, llm.model.config.vocab_size, 2),
                 sampling_params=params, use_tqdm=False)  # warm-up
    return llm


def run_offline(llm: LLM, prompts: list[list[int]], args: argparse.Namespace) -> float:
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == args.output_len for o in outs)
    return len(prompts) * args.output_len / elapsed


def pct(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank below) of `values` in ms; nan when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return 1000 * ordered[int(q * (len(ordered) - 1))]


def summarize(concurrency: int, elapsed: float, samples: list[Sample]) -> dict[str, float]:
    ttft = [s.ttft for s in samples]
    tpot = [s.tpot for s in samples if s.tpot is not None]
    itl = [g for s in samples for g in s.itl]
    return {"concurrency": concurrency, "requests": len(samples), "seconds": round(elapsed, 3),
            "tok_s": round(sum(s.tokens for s in samples) / elapsed, 1),
            "ttft_ms_median": round(pct(ttft, 0.5), 1), "ttft_ms_p90": round(pct(ttft, 0.9), 1),
            "ttft_ms_p99": round(pct(ttft, 0.99), 1),
            "tpot_ms_median": round(pct(tpot, 0.5), 2), "tpot_ms_p99": round(pct(tpot, 0.99), 2),
            "itl_ms_median": round(pct(itl, 0.5), 2), "itl_ms_p99": round(pct(itl, 0.99), 2)}


def requests_for(level: int, args: argparse.Namespace) -> int:
    return min(args.num_requests, max(16, 8 * level))


def measure(args: argparse.Namespace, url: str, model: Path, levels: list[int],
            stop_server: Callable[[], None]) -> dict[str, object]:
    """Every level once on the server; the top level `repeats` times, each run followed by an
    offline run of the same prompts while the server idles. Interleaving cancels slow drifts in the
    machine's load, and the comparison uses the best run of each side (on a shared machine a run can
    only be slowed down, never sped up, by other work); the ratio of the medians is reported too.
    On CUDA the offline runs follow `stop_server()` instead (one model per GPU)."""
    prompts = make_prompts(args, json.loads((model / "config.json").read_text())["vocab_size"],
                           args.num_requests)
    if args.warmup_pass:
        for c in levels:
            asyncio.run(run_level(url, prompts[:requests_for(c, args)], args.output_len, c,
                                  args.api))
    rows = [summarize(c, *asyncio.run(run_level(url, prompts[:requests_for(c, args)],
                                                args.output_len, c, args.api)))
            for c in levels[:-1]]
    top = levels[-1]
    top_prompts = prompts[:requests_for(top, args)]
    if args.offline_threads is not None:
        torch.set_num_threads(args.offline_threads)
    after = args.device == "cuda"
    llm = None if args.skip_offline or after else offline_llm(model, args, top)
    if llm is not None and args.warmup_pass:
        run_offline(llm, top_prompts, args)
    server_runs, offline_runs = [], []
    for _ in range(args.repeats):
        server_runs.append(summarize(top, *asyncio.run(run_level(url, top_prompts,
                                                                 args.output_len, top,
                                                                 args.api))))
        if llm is not None:
            offline_runs.append(run_offline(llm, top_prompts, args))
    if after and not args.skip_offline:
        stop_server()
        llm = offline_llm(model, args, top)
        if args.warmup_pass:
            run_offline(llm, top_prompts, args)
        offline_runs = [run_offline(llm, top_prompts, args) for _ in range(args.repeats)]
    rows.append(max(server_runs, key=lambda r: r["tok_s"]))
    offline = max(offline_runs) if offline_runs else float("nan")
    median_ratio = (statistics.median(r["tok_s"] for r in server_runs)
                    / statistics.median(offline_runs or [offline]))
    return {"levels": rows, "server_tok_s_runs": [r["tok_s"] for r in server_runs],
            "offline_tok_s_runs": [round(x, 1) for x in offline_runs],
            "offline_tok_s": round(offline, 1),
            "server_vs_offline": round(rows[-1]["tok_s"] / offline, 3),
            "server_vs_offline_median": round(median_ratio, 3)}


def plot(result: dict[str, Any], path: str) -> None:
    """Output tok/s (left) and TTFT / TPOT p50 and p99 (right) against concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["levels"]
    c = [r["concurrency"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(c, [r["tok_s"] for r in rows], "o-", label="server")
    left.axhline(result["offline_tok_s"], color="k", ls="--",
                 label=f"offline LLM.generate at {c[-1]}")
    left.set_ylabel("output tokens / s")
    for key, style in (("ttft", "o-"), ("tpot", "s-")):
        for q, alpha in (("median", 1.0), ("p99", 0.5)):
            right.plot(c, [r[f"{key}_ms_{q}"] for r in rows], style, alpha=alpha,
                       label=f"{key.upper()} {'p50' if q == 'median' else q}")
    right.set_yscale("log")
    right.set_ylabel("ms")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"dsv4 serve: {result['model']}, {result['dtype']}, prompts "
                 f"{result['prompt_len'][0]}, {result['output_len']} output tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), args.plot)
        return
    levels = [int(c) for c in args.concurrency.split(",")]
    model = Path(args.model) if args.model else default_model_path()
    load_before = os.getloadavg()[0]
    proc, url = (None, args.url) if args.url else start_server(args, model, max(levels))

    def stop() -> None:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)

    try:
        result = measure(args, url, model, levels, stop)
    finally:
        stop()
    rows, ratio = result["levels"], float(result["server_vs_offline"])  # type: ignore[arg-type]
    cols = [("concurrency", "concurrency"), ("requests", "requests"), ("tok_s", "tok/s"),
            ("ttft_ms_median", "TTFT p50"), ("ttft_ms_p99", "TTFT p99"),
            ("tpot_ms_median", "TPOT p50"), ("tpot_ms_p99", "TPOT p99"),
            ("itl_ms_median", "ITL p50"), ("itl_ms_p99", "ITL p99")]
    print("".join(f"{label:>12}" for _, label in cols) + "   (ms)")
    for r in rows:  # type: ignore[attr-defined]
        print("".join(f"{r[key]:>12}" for key, _ in cols))
    print(f"top level runs: server {result['server_tok_s_runs']} tok/s, offline LLM.generate "
          f"(max_running_requests={max(levels)}) {result['offline_tok_s_runs']} tok/s; "
          f"best server = {100 * ratio:.1f}% of best offline (target >= 90%; medians: "
          f"{100 * float(result['server_vs_offline_median']):.1f}%)")  # type: ignore[arg-type]
    record = {
        "benchmark": "serving", "api": args.api, "model": str(model), "device": args.device,
        "dtype": dtype_of(args), "load_format": args.load_format,
        "prompt_len": [args.min_prompt, args.max_prompt],
        "output_len": args.output_len, **result, "target_met": ratio >= 0.9,
        "torch": torch.__version__, "offline_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "commit": _commit(),
    }
    print(json.dumps(record))
    if args.plot:
        plot(record, args.plot)


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


if __name__ == "__main__":
    main()
