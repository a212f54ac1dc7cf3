"""LLM: the offline API (vLLM-style). `LLM(model=path).generate(prompts, SamplingParams(...))`.

    from dsv4 import LLM, SamplingParams
    llm = LLM(model="/path/to/checkpoint", dtype="float32", device="cpu", page_size=16)
    outs = llm.generate(["def fib(n):"], SamplingParams(max_tokens=32, temperature=0))
    print(outs[0].text)

Keyword arguments beyond model/dtype/device/weight_format/tensor_parallel_size/
expert_parallel_size/data_parallel_size/load_format/load_balance_method are EngineConfig fields
(weight_format "checkpoint" keeps the routed experts in FP4 and the FP8 linears in FP8, see
`model/quant_experts.py` and `model/quant_linear.py`; `load_format="dummy"` builds random weights
from the checkpoint's config.json alone, `load_served_model`; with several ranks each draws only
its shard, `distributed/dummy.py`;
`model="in-memory:<preset>"` builds a preset's geometry with random weights, no checkpoint at all:
`checkpoint/source.py`).
`tensor_parallel_size=N` > 1 runs N ranks (this process is rank 0; the others are spawned and
stopped by `close()` or the `with` block; GPU rank r uses cuda:r), the model sharded as
`distributed/tp.py` says; `expert_parallel_size=N` also splits the routed experts by id
(`engine/parallel.py`). `data_parallel_size=N` > 1 (with
tensor_parallel_size 1) runs N ranks with data-parallel attention: each rank serves its own requests
(own KV cache and prefix cache), the MoE layers run over all ranks' tokens (`distributed/dp.py`;
`expert_parallel_size=N` splits their experts; `load_balance_method` "shortest_queue" or
"cache_aware" picks each request's rank: `engine/dp_router.py`). The tokenizer is read from the
checkpoint directory (`tokenizer.json`); without one, pass `prompt_token_ids` and read
`token_ids` (the text stays empty). Before `LLM(...)` returns, the engine warms up
(`EngineConfig.warmup`; by default "fast" on CUDA with Triton, "none" elsewhere).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from dsv4.checkpoint.source import resolve_model_source
from dsv4.checkpoint.writer import random_model
from dsv4.config.engine import EngineConfig, check_weight_format
from dsv4.config.model import ModelConfig
from dsv4.config.server import LOAD_FORMATS
from dsv4.engine.data_parallel import DataParallelEngine
from dsv4.engine.engine import LLMEngine
from dsv4.engine.grammar import Grammars
from dsv4.engine.parallel import ParallelEngine, check_layout
from dsv4.engine.parallel_ranks import RankSpec, free_init_method
from dsv4.engine.request import Request, RequestOutput
from dsv4.engine.sampling_params import SamplingParams
from dsv4.engine.stop import OutputText
from dsv4.engine.warmup import warm_up
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.model.loader import load_model, resolve_device, resolve_dtype
from dsv4.utils.logging import init_logger
from dsv4.utils.threads import use_cpu_threads

logger = init_logger(__name__)


def load_served_model(path: Path, dtype: str, device: str, weight_format: str = "bf16",
                      load_format: str = "auto", seed: int = 0) -> DeepSeekV4ForCausalLM:
    """The checkpoint's model (`load_format` "auto"), or one of its config with random weights
    built in memory ("dummy", vLLM's and SGLang's name: only config.json is read; `seed` seeds
    the weights; with weight_format "checkpoint" the routed experts are random FP4 codes built
    on the device): what `LLM` and `dsv4 serve` load."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} is invalid; allowed: {list(LOAD_FORMATS)}")
    if load_format == "auto":
        return load_model(path, dtype=dtype, device=device,
                          weight_format=check_weight_format(weight_format))
    logger.info("load_format dummy: random weights for %s (seed %d, %s)", path, seed,
                weight_format)
    return random_model(ModelConfig.from_hf(path), resolve_dtype(dtype), resolve_device(device),
                        seed, check_weight_format(weight_format))


def _engine_config(engine_args: dict[str, Any]) -> EngineConfig:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(engine_args) - names)
    if unknown:
        raise ValueError(f"unknown engine argument(s) {unknown}; allowed: {sorted(names)}")
    return EngineConfig(**engine_args)


class LLM:
    def __init__(self, model: str | Path, dtype: str | None = None, device: str | None = None,
                 weight_format: str = "bf16", tensor_parallel_size: int = 1,
                 expert_parallel_size: int = 1, data_parallel_size: int = 1,
                 load_format: str = "auto", load_balance_method: str = "shortest_queue",
                 **engine_args: Any) -> None:
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
        config = _engine_config(engine_args)
        check_layout(tensor_parallel_size, expert_parallel_size, device, data_parallel_size)
        if device == "cpu":
            use_cpu_threads()
        path, load_format = resolve_model_source(model, load_format)
        tok_file = path / "tokenizer.json"
        self.tokenizer = Tokenizer.from_file(str(tok_file)) if tok_file.is_file() else None
        self.engine: LLMEngine | ParallelEngine
        world = max(tensor_parallel_size, data_parallel_size)
        if world > 1:
            spec = RankSpec(str(path), dtype, device, check_weight_format(weight_format), config,
                            world, expert_parallel_size > 1, free_init_method(),
                            data_parallel=data_parallel_size > 1,
                            load_balance_method=load_balance_method, load_format=load_format)
            self.engine = DataParallelEngine(spec) if spec.data_parallel else ParallelEngine(spec)
            self.model = self.engine.engine.runner.model  # rank 0's shard
            return
        self.model = load_served_model(path, dtype, device, weight_format, load_format,
                                       config.seed)
        mc = self.model.config
        grammars = (Grammars(tok_file, mc.vocab_size, [mc.eos_token_id])
                    if self.tokenizer is not None else None)
        self.engine = LLMEngine(self.model, config, grammars)
        warm_up(self.engine)      # the config's mode; "none" (the default off CUDA) runs nothing

    def close(self) -> None:
        """Stop the other ranks (tensor or data parallel size > 1); a no-op otherwise."""
        if isinstance(self.engine, ParallelEngine):
            self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer.json; "
                             "pass prompt_token_ids instead of text")
        return list(self.tokenizer.encode(prompt).ids)

    def generate(self, prompts: str | Sequence[str] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in input order."""
        token_lists = self._token_lists(prompts, prompt_token_ids)
        params = self._params(sampling_params, len(token_lists))
        # validate everything before admitting anything
        for ids, p in zip(token_lists, params, strict=True):
            self.engine.validate(ids, p)
        reqs = [self.engine.add_request(ids, p) for ids, p in zip(token_lists, params, strict=True)]
        texts = ({r.rid: OutputText(self.tokenizer, r.params) for r in reqs}
                 if self.tokenizer is not None else {})
        with tqdm(total=len(reqs), desc="generate", unit="req",
                  disable=not use_tqdm or len(reqs) < 2) as bar:
            while self.engine.has_unfinished():
                updated = self.engine.step()
                for req in updated:
                    if req.rid in texts:
                        self._feed_text(req, texts[req.rid])
                bar.update(sum(r.is_finished for r in updated))
        return [self._output(self.engine.pop(r.rid), texts.get(r.rid)) for r in reqs]

    def _feed_text(self, req: Request, text: OutputText) -> None:
        """Detokenise the request's new tokens; a stop string in them finishes it in the engine."""
        text.feed(req.output_ids[text.num_tokens:])
        if text.stopped:
            self.engine.finish(req.rid, "stop")
        elif req.is_finished:
            text.finish()

    @staticmethod
    def _output(req: Request, text: OutputText | None) -> RequestOutput:
        if text is None:
            return RequestOutput.from_request(req)
        return RequestOutput.from_request(req, text.text, text.num_tokens,
                                          "stop" if text.stopped else None)

    def _token_lists(self, prompts: str | Sequence[str] | None,
                     prompt_token_ids: Sequence[Sequence[int]] | None) -> list[list[int]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompts and prompt_token_ids")
        if prompt_token_ids is not None:
            return [list(ids) for ids in prompt_token_ids]
        assert prompts is not None
        return [self.encode(p) for p in ([prompts] if isinstance(prompts, str) else prompts)]

    @staticmethod
    def _params(sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if len(sampling_params) != n:
            raise ValueError(f"sampling_params has {len(sampling_params)} entries; "
                             f"allowed: one per prompt ({n})")
        return list(sampling_params)
