"""Evaluation of a trained checkpoint: held-out loss, MTP agreement, task accuracy by difficulty,
samples.

Owns `evaluate_checkpoint` (the numbers of the model card, `dsv4 train eval`) and its parts. The
task accuracy runs the real serving engine (`LLM.generate`, greedy) on the held-out problems of
`tasks.eval_set`, in two prompt forms: plain (`347+58=`) and chat (the tokenizer's chat
template).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dsv4.checkpoint.tokenizer import ASSISTANT_TOKEN, USER_TOKEN
from dsv4.engine.llm import LLM
from dsv4.engine.sampling_params import SamplingParams
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.model.forward_mode import INFERENCE
from dsv4.tasks.arithmetic import Problem, chat_messages, check_answer, eval_set
from dsv4.train.data import heldout_windows
from dsv4.train.trainer import lm_losses

# No trailing newline: BPE merges "\n" with the next line's indentation, so a prompt ending in
# "\n" ends mid-token.
SAMPLE_PROMPTS = ("class Stack:\n    def __init__(self):", "def quicksort(items):",
                  "import os\n\n\ndef ")
EASY_LEVELS = (1, 2)


def read_tokens(path: Path, seq_len: int, max_tokens: int) -> list[torch.Tensor]:
    """Held-out windows [1, seq_len + 1] of a flat uint16 token file, evenly spread
    (`data.heldout_windows`)."""
    return heldout_windows(np.fromfile(path, dtype=np.uint16), seq_len, max_tokens, batch_size=1)


@torch.no_grad()
def heldout_metrics(model: DeepSeekV4ForCausalLM,
                    windows: Sequence[torch.Tensor]) -> dict[str, Any]:
    """Mean next-token loss, MTP loss and MTP top-1 accuracy (token t+2) over `windows` [1, S+1],
    and each window's loss and MTP top-1 (`window_loss`, `window_mtp_top1`): a subset of the
    windows is checked against the card without scoring them all."""
    if not windows:
        raise ValueError("heldout_metrics: no windows (token file shorter than one sequence)")
    device = next(model.parameters()).device
    losses: list[float] = []
    mtp_losses: list[float] = []
    correct: list[float] = []
    count: list[float] = []
    for w in windows:
        out = lm_losses(model, w.to(device), INFERENCE)
        losses.append(float(out["loss"]))
        if "mtp_loss" in out:
            mtp_losses.append(float(out["mtp_loss"]))
            correct.append(float(out["mtp_correct"]))
            count.append(float(out["mtp_count"]))
    n = len(windows)
    result: dict[str, Any] = {"heldout_loss": sum(losses) / n, "window_loss": losses}
    if sum(count):
        result.update(heldout_mtp_loss=sum(mtp_losses) / n, mtp_top1=sum(correct) / sum(count),
                      window_mtp_top1=[c / k for c, k in zip(correct, count, strict=True)])
    return result


def chat_prompt(problem: Problem) -> str:
    """The chat-template rendering of the question with the generation prompt (bos comes from the
    tokenizer)."""
    (user,) = chat_messages(problem, include_answer=False)
    return f"{USER_TOKEN}{user['content']}{ASSISTANT_TOKEN}"


def task_accuracy(llm: LLM, problems: Sequence[Problem], form: str,
                  max_tokens: int = 10) -> dict[str, Any]:
    """Greedy accuracy per level (and overall) on `problems`; form is 'plain' or 'chat'."""
    if form not in ("plain", "chat"):
        raise ValueError(f"form={form!r} is invalid; allowed: 'plain', 'chat'")
    prompts = [p.prompt if form == "plain" else chat_prompt(p) for p in problems]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=("\n",))
    outs = llm.generate(prompts, params, use_tqdm=False)
    hits: dict[int, list[bool]] = defaultdict(list)
    for p, o in zip(problems, outs, strict=True):
        hits[p.level].append(check_answer(p, o.text))
    by_level = {str(level): sum(h) / len(h) for level, h in sorted(hits.items())}
    total = [x for h in hits.values() for x in h]
    return {"by_level": by_level, "n_by_level": {str(k): len(v) for k, v in sorted(hits.items())},
            "overall": sum(total) / len(total)}


def samples(llm: LLM, prompts: Sequence[str] = SAMPLE_PROMPTS,
            max_tokens: int = 48) -> list[dict[str, str]]:
    outs = llm.generate(list(prompts), SamplingParams(max_tokens=max_tokens, temperature=0.0),
                        use_tqdm=False)
    return [{"prompt": p, "completion": o.text} for p, o in zip(prompts, outs, strict=True)]


def evaluate_checkpoint(model_dir: Path, heldout: Path, seq_len: int = 2048,
                        max_tokens: int = 16384, per_level: int = 50, seed: int = 0,
                        device: str = "cpu") -> dict[str, Any]:
    """All model-card numbers of the checkpoint in `model_dir`, measured on `device` in float32."""
    t0 = time.perf_counter()
    llm = LLM(model_dir, dtype="float32", device=device, page_size=128, max_total_tokens=65536,
              max_running_requests=256, chunked_prefill_size=4096)
    windows = read_tokens(heldout, seq_len, max_tokens)
    result: dict[str, Any] = heldout_metrics(llm.model, windows)
    problems = eval_set(seed, per_level)
    result["task_plain"] = task_accuracy(llm, problems, "plain")
    result["task_chat"] = task_accuracy(llm, problems, "chat")
    chat = result["task_chat"]
    easy = [str(level) for level in EASY_LEVELS]
    result["easy_chat_accuracy"] = (sum(chat["by_level"][lv] * chat["n_by_level"][lv]
                                        for lv in easy)
                                    / sum(chat["n_by_level"][lv] for lv in easy))
    # the tokens actually scored (fewer than max_tokens when the file is shorter)
    result["heldout_tokens"] = sum(w.shape[0] * (w.shape[1] - 1) for w in windows)
    result["samples"] = samples(llm)
    result["eval_seconds"] = round(time.perf_counter() - t0, 1)
    return result
