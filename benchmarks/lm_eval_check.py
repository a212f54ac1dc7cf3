"""lm-evaluation-harness against `dsv4 serve`: local loglikelihood and generate_until tasks.

    PYTHONPATH=src python benchmarks/lm_eval_check.py [--problems 40] [--out FILE.json]

Needs `pip install lm_eval` (not a dsv4 dependency). Writes a local task (held-out arithmetic
problems of levels 1-3 in the shipped dsv4-tiny's chat form; four choices: the answer and three
near misses; no delimiter between question and answer), starts `dsv4 serve` with dsv4-tiny on
loopback (CPU, fp32), and runs `lm_eval --model local-completions` on it twice: with the
tokenizer read from the model directory (`tokenizer_backend=huggingface`) and through the
server's /tokenize routes (`tokenizer_backend=remote`). The same accuracy is computed offline
from `LLM(...)` prompt log-probs (sum of the choice tokens' log-probs, argmax), which lm-eval's
`acc` must equal. A second task (`generate_until`: the same questions, greedy, at most 8
tokens, exact match of the answer) runs once over the server, and its score is checked against
`LLM.generate` offline with the same settings. Prints one line per run, then one JSON line (also
written to --out).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from local_server import local_server

from dsv4 import LLM, SamplingParams
from dsv4.assets import default_model_path
from dsv4.rl.rewards import chat_prompt
from dsv4.tasks.arithmetic import eval_set

TASK = "dsv4_arith_mc"
GEN_TASK = "dsv4_arith_gen"
UNTIL = ["\n", "<｜User｜>"]


def problems(n: int) -> list[dict[str, Any]]:
    rng = random.Random(0)
    docs = []
    for p in eval_set(seed=0, per_level=n // 3 + 1, levels=(1, 2, 3))[:n]:
        answer = int(p.answer)
        wrong = sorted({answer + d for d in (-10, -1, 1, 2, 10) if answer + d >= 0} - {answer})
        choices = [str(answer)] + [str(w) for w in rng.sample(wrong, 3)]
        rng.shuffle(choices)
        docs.append({"question": chat_prompt(p), "choices": choices,
                     "answer": choices.index(str(answer))})
    return docs


def write_task(root: Path, docs: list[dict[str, Any]]) -> None:
    data = root / "arith_mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (root / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: \"{{question}}\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{answer}}\"\ntarget_delimiter: \"\"\n"
        "metric_list:\n  - metric: acc\n")
    gen = root / "arith_gen.jsonl"
    gen.write_text("".join(json.dumps({"question": d["question"],
                                       "target": d["choices"][d["answer"]]}) + "\n"
                           for d in docs))
    (root / f"{GEN_TASK}.yaml").write_text(
        f"task: {GEN_TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {gen}\ntest_split: test\noutput_type: generate_until\n"
        "doc_to_text: \"{{question}}\"\ndoc_to_target: \"{{target}}\"\ntarget_delimiter: \"\"\n"
        f"generation_kwargs:\n  until: {json.dumps(UNTIL)}\n  do_sample: false\n"
        "  temperature: 0.0\n  max_gen_toks: 8\n"
        "metric_list:\n  - metric: exact_match\n")


def offline_exact_match(docs: list[dict[str, Any]]) -> float:
    """The generate_until task's exact match from `LLM.generate` (greedy, 8 tokens, `UNTIL`)."""
    llm = LLM(default_model_path(), dtype="float32", device="cpu", page_size=128,
              max_total_tokens=8192)
    outs = llm.generate([d["question"] for d in docs], SamplingParams.create(
        max_tokens=8, temperature=0.0, stop=UNTIL), use_tqdm=False)
    return sum(o.text == d["choices"][d["answer"]] for o, d in zip(outs, docs, strict=True)
               ) / len(docs)


def offline_accuracy(docs: list[dict[str, Any]]) -> float:
    """lm-eval's `acc`, computed from the offline engine's prompt log-probs."""
    llm = LLM(default_model_path(), dtype="float32", device="cpu", page_size=128,
              max_total_tokens=8192)
    right = 0
    for d in docs:
        context = llm.encode(d["question"])
        scores = []
        for choice in d["choices"]:
            ids = llm.encode(d["question"] + choice)
            out = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
                max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
            assert out.prompt_logprobs is not None and ids[:len(context)] == context
            scores.append(sum(lp for lp in out.prompt_logprobs[len(context):]
                              if lp is not None))
        right += int(max(range(len(scores)), key=scores.__getitem__) == d["answer"])
    return right / len(docs)


def run_lm_eval(port: int, backend: str, include: Path, out: Path, task: str = TASK,
                metric: str = "acc,none") -> float:
    args = (f"model=dsv4-tiny,base_url=http://127.0.0.1:{port}/v1/completions,"
            f"tokenizer_backend={backend},num_concurrent=1,max_retries=1,add_bos_token=True")
    if backend == "huggingface":
        args += f",tokenizer={default_model_path()}"
    subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions",
                    "--model_args", args, "--tasks", task, "--include_path", str(include),
                    "--batch_size", "1", "--output_path", str(out)], check=True,
                   env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    result = next(out.rglob("results_*.json"))
    return float(json.loads(result.read_text())["results"][task][metric])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--problems", type=int, default=40)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    docs = problems(args.problems)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_task(root, docs)
        with local_server() as port:
            accs = {b: run_lm_eval(port, b, root, root / f"out_{b}")
                    for b in ("huggingface", "remote")}
            gen = run_lm_eval(port, "huggingface", root, root / "out_gen", GEN_TASK,
                              "exact_match,none")
    offline, offline_gen = offline_accuracy(docs), offline_exact_match(docs)
    for backend, acc in accs.items():
        print(f"lm-eval local-completions, tokenizer_backend={backend}: acc {acc:.4f}")
    print(f"offline (LLM prompt_logprobs): acc {offline:.4f}")
    print(f"lm-eval generate_until: exact_match {gen:.4f}; offline (LLM.generate) "
          f"{offline_gen:.4f}")
    result = {"bench": "lm_eval_check", "task": TASK, "problems": len(docs),
              "acc": accs, "offline_acc": offline, "gen_task": GEN_TASK,
              "gen_exact_match": gen, "offline_gen_exact_match": offline_gen}
    print(json.dumps(result))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
