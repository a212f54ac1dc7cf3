"""Offline throughput: the dsv4 engine vs transformers' `generate` on the same weights, one process.

Fixed seed; N requests with prompt lengths uniform in [min_prompt, max_prompt] and a fixed number
of greedy output tokens (ignore_eos), on a checkpoint written by `dsv4 init` (default: the tiny
preset). transformers runs each request alone (batch 1): DeepSeek-V4's compressor in transformers
ignores the attention mask, so padded batches would be wrong (model-spec §13). The engine gets all
requests at once (continuous batching). Prints a table, then one JSON line.

    python benchmarks/offline_throughput.py --num-requests 64 --output-len 32
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from dsv4 import LLM, SamplingParams
from dsv4.checkpoint.presets import get_preset
from dsv4.checkpoint.writer import write_checkpoint


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="micro")
    p.add_argument("--model", default=None,
                   help="checkpoint dir (default: write the preset to a temp dir)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunked-prefill-size", type=int, default=2048)
    p.add_argument("--skip-hf", action="store_true")
    return p.parse_args()


def make_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(args.seed)
    lens = torch.randint(args.min_prompt, args.max_prompt + 1, (args.num_requests,),
                         generator=g).tolist()
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lens]


def run_engine(llm: LLM, prompts: list[list[int]], out_len: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts[:2], sampling_params=params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return time.perf_counter() - start, [o.token_ids for o in outs]


def run_transformers(model_dir: Path, llm: LLM, prompts: list[list[int]], out_len: int,
                     device: str) -> tuple[float, list[list[int]]]:
    import transformers

    from dsv4.model.state_dict_adapter import to_hf_state_dict
    from dsv4.model.weights import official_state_dict

    model = llm.model
    sd = official_state_dict(model)
    hf = transformers.DeepseekV4ForCausalLM(
        transformers.DeepseekV4Config(**model.config.to_hf_dict()))
    hf.load_state_dict(to_hf_state_dict(sd), strict=True)
    hf = hf.to(device=device, dtype=next(model.parameters()).dtype).eval()
    outs = []
    with torch.no_grad():
        # no eos at all (like ignore_eos): min_new_tokens would instead mask eos out of the argmax
        hf.generation_config.eos_token_id = None
        gen = dict(max_new_tokens=out_len, do_sample=False, pad_token_id=0)
        hf.generate(torch.tensor([prompts[0]], device=device), **gen)  # warm-up
        start = time.perf_counter()
        for p in prompts:
            ids = hf.generate(torch.tensor([p], device=device), **gen)
            outs.append(ids[0, len(p):].tolist())
    return time.perf_counter() - start, outs


def git_commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else Path(tmp) / args.preset
        if not args.model:
            write_checkpoint(get_preset(args.preset), model_dir, seed=args.seed)
        llm = LLM(model_dir, dtype=args.dtype, device=args.device, page_size=args.page_size,
                  max_running_requests=args.num_requests,
                  chunked_prefill_size=args.chunked_prefill_size,
                  max_total_tokens=args.num_requests
                  * (args.max_prompt + args.output_len + args.page_size))
        prompts = make_prompts(args, llm.model.config.vocab_size)
        total = args.num_requests * args.output_len
        t_engine, engine_out = run_engine(llm, prompts, args.output_len)
        t_hf, hf_out = (float("nan"), []) if args.skip_hf else run_transformers(
            model_dir, llm, prompts, args.output_len, args.device)
    agree = sum(a == b for a, b in zip(engine_out, hf_out, strict=False))
    result = {
        "benchmark": "offline_throughput", "preset": args.preset, "device": args.device,
        "dtype": args.dtype, "num_requests": args.num_requests,
        "prompt_len": [args.min_prompt, args.max_prompt], "output_len": args.output_len,
        "engine_s": round(t_engine, 3), "engine_tok_s": round(total / t_engine, 1),
        "transformers_s": round(t_hf, 3), "transformers_tok_s": round(total / t_hf, 1),
        "speedup": round(t_hf / t_engine, 2), "greedy_agree": f"{agree}/{len(hf_out)}",
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(), "commit": git_commit(),
    }
    print(f"{'system':<14}{'seconds':>10}{'tok/s':>10}")
    print(f"{'dsv4 engine':<14}{t_engine:>10.2f}{total / t_engine:>10.1f}")
    print(f"{'transformers':<14}{t_hf:>10.2f}{total / t_hf:>10.1f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
