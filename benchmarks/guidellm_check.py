"""guidellm (vLLM's load generator) against `dsv4 serve`: a third-party benchmark client end to end.

    python3 -m venv /tmp/gl && /tmp/gl/bin/pip install guidellm
    PYTHONPATH=src python3 benchmarks/guidellm_check.py --guidellm /tmp/gl/bin/guidellm

guidellm is not a dsv4 dependency (it pins its own transformers / datasets), so it runs from its
own environment. Starts `dsv4 serve` with dsv4-tiny on loopback (CPU, fp32), runs `guidellm run`
(OpenAI HTTP backend, `--streams` concurrent streams, `--requests` requests of synthetic text with
`--prompt-tokens` / `--output-tokens`, the model directory's tokenizer), and reads its JSON report:
requests completed / errored / incomplete, and the median TTFT, inter-token latency and output
tokens per second. Prints a summary, then one JSON line (also written to --out).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from local_server import local_server

from dsv4.assets import default_model_path


def summarise(report: dict[str, Any]) -> dict[str, Any]:
    """Counts and medians of the first benchmark of a guidellm JSON report."""
    bench = report["benchmarks"][0]
    metrics = bench["metrics"]

    def median(name: str) -> float | None:
        stats = metrics.get(name, {}).get("successful")
        return None if not stats else stats.get("median")

    totals = metrics["request_totals"]
    return {"successful": totals["successful"], "errored": totals["errored"],
            "incomplete": totals["incomplete"],
            "ttft_ms_median": median("time_to_first_token_ms"),
            "itl_ms_median": median("inter_token_latency_ms"),
            "output_tokens_per_s_median": median("output_tokens_per_second")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--guidellm", default="guidellm", help="the guidellm executable")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--requests", type=int, default=80)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    with local_server() as port, tempfile.TemporaryDirectory() as tmp:
        report_path = Path(tmp) / "benchmarks.json"
        cmd = [args.guidellm, "run",
               "--backend", f"kind=openai_http,target=http://127.0.0.1:{port},model=dsv4-tiny",
               "--profile", f"kind=concurrent,streams={args.streams}",
               "--constraint", f"kind=max_requests,count={args.requests}",
               "--tokenizer", f"kind=huggingface_auto,model={default_model_path()}",
               "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},"
                         f"output_tokens={args.output_tokens}",
               "--output", f"kind=json,path={report_path}",
               "--disable-console-interactive"]
        started = time.monotonic()
        subprocess.run(cmd, check=True)
        wall = time.monotonic() - started
        result = summarise(json.loads(report_path.read_text()))
    result = {"bench": "guidellm_check", "streams": args.streams, "requests": args.requests,
              "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
              "wall_s": round(wall, 1), **result}
    print(f"guidellm: {result['successful']} ok, {result['errored']} errored, "
          f"{result['incomplete']} incomplete of {args.requests}; TTFT median "
          f"{result['ttft_ms_median']} ms, ITL median {result['itl_ms_median']} ms")
    print(json.dumps(result))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
