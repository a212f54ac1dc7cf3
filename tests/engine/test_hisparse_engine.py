"""HiSparse in the engine (issue 25): greedy outputs with `enable_hisparse` equal those without it,
token for token (fp32, CPU, `ref` kernels), with hot sets exactly `index_topk` wide and prompts
with several times that many C4 entries, so decode steps swap entries in and prefill chunks stage
their picks from the host mirror.

Workloads on the `micro` preset (random weights, index_topk 4): a prefix-cache hit (the same
prompt again, and prompts sharing a prefix), preemption under a cache too small for the batch,
MTP speculative decoding with rejected drafts,
chunked prefill at awkward budgets (with a hot set wide enough that short chunks go through
`select` too), overlap scheduling, routing capture, batch-invariant mode, the decode graphs'
static-buffer step; and the shipped dsv4-tiny (index_topk 128). On a GPU (`-m gpu`): captured
decode graphs with the Triton copies through the pinned mirror.
Every workload checks every manager's `check_integrity()` (the HotSet's included) after every
step, that entries were swapped in (the HotSet's stats) and that every page is free once the
prefix cache lets go. Plus the startup errors of bad or unsupported configurations, the CLI flags,
and the memory plan of a HiSparse engine.
"""

from __future__ import annotations

import dataclasses
import types
import weakref
from pathlib import Path

import pytest
import torch
from test_spec_decode import Oracle, run_staggered

from dsv4 import LLM, SamplingParams
from dsv4.assets import default_model_path
from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import random_model, write_checkpoint
from dsv4.cli.main import build_parser, main
from dsv4.cli.serve import build_config
from dsv4.config.engine import EngineConfig
from dsv4.config.engine_defaults import resolve_hisparse_entries
from dsv4.config.model import ModelConfig
from dsv4.config.server import ServerConfig
from dsv4.distributed.memory import plan_memory
from dsv4.engine import runner_setup as runner_module
from dsv4.engine.cuda_graph import DecodeGraphs
from dsv4.engine.engine import LLMEngine
from dsv4.engine.runner import ModelRunner
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM

TOPK = micro().index_topk
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
BASE: dict[str, object] = dict(page_size=16, max_total_tokens=2048, max_running_requests=4,
                               chunked_prefill_size=32)


@pytest.fixture(scope="module")
def model() -> DeepSeekV4ForCausalLM:
    return random_model(micro().replace(max_position_embeddings=1024), torch.float32,
                        torch.device("cpu"))


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, micro().vocab_size, (n,), generator=g).tolist() for n in lengths]


def run(engine: LLMEngine, prompts: list[list[int]], sequential: bool = False) -> list[list[int]]:
    """Greedy outputs of `prompts` (all queued at once, or each after the one before finished),
    with every manager's check_integrity() after every step."""
    outputs = []
    batches = [[p] for p in prompts] if sequential else [prompts]
    for batch in batches:
        reqs = [engine.add_request(p, GREEDY) for p in batch]
        while engine.has_unfinished():
            engine.step()
            engine.check_integrity()
        outputs += [r.output_ids for r in reqs]
    return outputs


def assert_free(engine: LLMEngine) -> None:
    table = engine.runner.table
    engine.flush_cache()
    engine.check_integrity()
    assert table.full.num_free == table.full.num_usable
    assert table.swa.num_free == table.swa.num_usable
    assert table.num_free_slots == engine.config.max_running_requests


# per model (the module's fixture), the plain engine's outputs per workload
_PLAIN: weakref.WeakKeyDictionary[DeepSeekV4ForCausalLM, dict[str, list[list[int]]]] = (
    weakref.WeakKeyDictionary())


def plain_outputs(model: DeepSeekV4ForCausalLM, prompts: list[list[int]],
                  sequential: bool = False, **kwargs: object) -> list[list[int]]:
    """`run` on an engine with HiSparse off (BASE and `kwargs`), computed once per arguments
    (deterministic greedy outputs; some workloads here are compared more than once)."""
    args = {**BASE, **kwargs}
    key, done = repr((prompts, sequential, sorted(args.items()))), _PLAIN.setdefault(model, {})
    if key not in done:
        done[key] = run(LLMEngine(model, EngineConfig(**args)),  # type: ignore[arg-type]
                        prompts, sequential)
    return done[key]


def both(model: DeepSeekV4ForCausalLM, prompts: list[list[int]], sequential: bool = False,
         entries: int = TOPK, **kwargs: object) -> tuple[LLMEngine, dict[str, int]]:
    """Run `prompts` on an engine with HiSparse off and one with it on (`entries` hot per request
    and C4 layer); assert equal outputs; return the HiSparse engine and its HotSet's stats."""
    args = {**BASE, **kwargs}
    hot = LLMEngine(model, EngineConfig(**args, enable_hisparse=True,  # type: ignore[arg-type]
                                        hisparse_device_entries=entries))
    assert hot.runner.pools.hot is not None and hot.runner.pools.layers[1].entries is None
    expected = plain_outputs(model, prompts, sequential, **kwargs)
    assert run(hot, prompts, sequential) == expected
    stats = {k: int(v) for k, v in hot.runner.pools.hot.stats().items()}
    assert stats["hisparse/swapped"] > 0, f"no entry was swapped in: {stats}"
    assert stats["hisparse/overflow"] == 0
    assert_free(hot)
    return hot, stats


def test_prefix_cache_hits(model: DeepSeekV4ForCausalLM) -> None:
    """The same prompt twice, then prompts sharing its first pages: the cached pages' entries are
    read from the host mirror by requests that never wrote them."""
    first, tail = random_prompts([70, 30], seed=1)
    prompts = [first, first, first[:48] + tail, first[:33]]
    hot, _ = both(model, prompts, sequential=True)
    assert hot.scheduler.cached_prompt_tokens >= 64 + 48 + 32, "the prefix cache was meant to hit"


def test_preemption(model: DeepSeekV4ForCausalLM) -> None:
    prompts = random_prompts([45, 60, 37, 52, 70, 41], seed=2)
    hot, _ = both(model, prompts, max_total_tokens=112, max_running_requests=6,
                  chunked_prefill_size=64)
    assert hot.scheduler.num_preemptions > 0, "the pool was meant to be too small for the batch"


@pytest.mark.parametrize(("chunk", "entries"), [(5, TOPK), (3, 3 * TOPK), (32, 3 * TOPK)])
def test_chunked_prefill(model: DeepSeekV4ForCausalLM, chunk: int, entries: int) -> None:
    """Chunks of more tokens than entries // index_topk stage their picks; shorter ones (and
    decode steps) go through the hot set, several rows of one request per select."""
    prompts = random_prompts([61, 38, 90], seed=3)
    _, stats = both(model, prompts, entries=entries, chunked_prefill_size=chunk)
    if chunk * TOPK > entries:
        assert stats["hisparse/staged"] > 0, "long chunks were meant to stage their picks"


def test_overlap_schedule_and_routing_capture(model: DeepSeekV4ForCausalLM) -> None:
    prompts = random_prompts([50, 35, 66], seed=4)
    both(model, prompts, overlap_schedule=True)
    args = {**BASE, "capture_routing": True, "disable_prefix_cache": True}
    routing = []
    for on in (False, True):
        config = EngineConfig(**args, enable_hisparse=on)  # type: ignore[arg-type]
        engine = LLMEngine(model, config)
        reqs = [engine.add_request(p, GREEDY) for p in prompts]
        while engine.has_unfinished():
            engine.step()
        routing.append([{k: torch.cat(v) for k, v in r.routing.items()} for r in reqs])
    for off, on in zip(*routing, strict=True):
        assert off.keys() == on.keys() == {"experts", "indexer"}
        assert all(torch.equal(off[k], on[k]) for k in off)


def test_release_and_resume_memory(model: DeepSeekV4ForCausalLM) -> None:
    """release_memory drops the HotSet with the pools; resume_memory builds a fresh one that the
    request table's slots drive again, to the same outputs."""
    prompts = random_prompts([44, 29], seed=6)
    engine, _ = both(model, prompts)
    expected = plain_outputs(model, prompts)
    old = engine.runner.pools.hot
    assert engine.release_memory() > 0 and engine.runner.table.hot is None
    engine.resume_memory()
    assert engine.runner.pools.hot is not old and engine.runner.table.hot is engine.runner.pools.hot
    assert run(engine, prompts) == expected


def test_batch_invariant_mode(model: DeepSeekV4ForCausalLM) -> None:
    """Index rows of one width per layer (`fixed_widths`): padded picks select and stage too."""
    both(model, random_prompts([50, 35, 66], seed=5), batch_invariant=True, chunked_prefill_size=8)


def test_shipped_tiny_model() -> None:
    """dsv4-tiny (index_topk 128): a 700-token prompt has 175 entries per C4 layer."""
    prompts = [torch.randint(2, 4096, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (700, 560)]
    args: dict[str, object] = dict(dtype="float32", device="cpu", page_size=128,
                                   max_total_tokens=4096, chunked_prefill_size=256)
    plain = LLM(default_model_path(), **args)  # type: ignore[arg-type]
    hot = LLM(default_model_path(), **args, enable_hisparse=True,  # type: ignore[arg-type]
              hisparse_device_entries=plain.model.config.index_topk)
    params = dataclasses.replace(GREEDY, max_tokens=8)
    expected = [o.token_ids for o in plain.generate(prompt_token_ids=prompts,
                                                    sampling_params=params, use_tqdm=False)]
    got = hot.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.token_ids for o in got] == expected
    hot.engine.check_integrity()
    assert hot.engine.runner.pools.hot is not None
    assert int(hot.engine.runner.pools.hot.stats()["hisparse/swapped"]) > 0


@pytest.mark.parametrize("overlap", [False, True])
def test_decode_through_the_graphs_static_buffers(model: DeepSeekV4ForCausalLM,
                                                  overlap: bool) -> None:
    """The decode graphs' step (`DecodeGraphs`, run eagerly from its static buffers on CPU: what
    the GPU captures) with HiSparse, with and without overlap scheduling (in-flight tokens
    through the graphs' fill path): its metadata carries the HotSet's rows, its picks go through
    `select`, and the outputs equal HiSparse off."""
    prompts = random_prompts([50, 35, 66], seed=9)
    expected = plain_outputs(model, prompts)
    engine = LLMEngine(model, EngineConfig(**BASE, enable_hisparse=True,  # type: ignore[arg-type]
                                           hisparse_device_entries=TOPK,
                                           overlap_schedule=overlap))
    runner = engine.runner
    runner.graphs = DecodeGraphs(runner.model, runner.table, runner.pools, runner.ops,
                                 max_batch=4, capture=False)
    assert run(engine, prompts) == expected
    assert runner.graphs.replays >= 8, "decode steps were meant to run through the graphs"
    assert runner.pools.hot is not None
    assert int(runner.pools.hot.stats()["hisparse/swapped"]) > 0
    assert_free(engine)


def test_hot_set_takes_the_backends_copies(model: DeepSeekV4ForCausalLM) -> None:
    """The engine's HotSet copies through its kernel backend's `swap_in` / `write_rows` ops (the
    Triton ones read and write the pinned mirror in place on a GPU)."""
    engine = LLMEngine(model, EngineConfig(**BASE, enable_hisparse=True))  # type: ignore[arg-type]
    hot, ops = engine.runner.pools.hot, engine.runner.ops
    assert hot is not None
    assert hot.swap_in is ops.swap_in and hot.write_rows is ops.write_rows


SPEC_PROMPTS = random_prompts([61, 38, 90, 17], seed=12)
SPEC_MAX_TOKENS = [9, 14, 6, 11]
SPEC_ARGS: dict[str, object] = dict(dtype="float32", device="cpu", page_size=16,
                                    chunked_prefill_size=32, max_running_requests=4,
                                    max_total_tokens=2048)


@pytest.fixture(scope="module")
def spec_plain(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[int]]]:
    """The speculative rows' micro checkpoint and its plain greedy outputs (one for all rows)."""
    path = tmp_path_factory.mktemp("hisparse_spec")
    write_checkpoint(micro(), path, seed=2, tokenizer=False)
    want = run_staggered(LLM(path, **SPEC_ARGS).engine, SPEC_PROMPTS,  # type: ignore[arg-type]
                         SPEC_MAX_TOKENS)
    return path, want


@pytest.mark.parametrize(("N", "entries"), [(1, 2 * TOPK), (3, 4 * TOPK), (3, 2 * TOPK)])
def test_speculative_decoding(spec_plain: tuple[Path, dict[str, list[int]]], N: int,
                              entries: int) -> None:
    """MTP speculative decoding with HiSparse, drafts rejected at every position in turn (the
    oracle of tests/engine/test_spec_decode.py): verify passes of N + 1 tokens attend through the
    hot sets when their picks fit ((N + 1) * index_topk <= entries), else stage them; rejected
    drafts' hot entries are dropped (`truncate`); greedy outputs equal plain decoding."""
    path, want = spec_plain
    spec = LLM(path, speculative_num_steps=N, enable_hisparse=True,  # type: ignore[arg-type]
               hisparse_device_entries=entries, **SPEC_ARGS)
    Oracle(spec.engine, want, N)
    assert run_staggered(spec.engine, SPEC_PROMPTS, SPEC_MAX_TOKENS) == want
    assert all(h > 0 for h in spec.engine.spec_accept_hist), spec.engine.spec_accept_hist
    hot = spec.engine.runner.pools.hot
    assert hot is not None
    stats = {k: int(v) for k, v in hot.stats().items()}
    assert stats["hisparse/swapped"] > 0 and stats["hisparse/overflow"] == 0, stats
    assert_free(spec.engine)


def test_default_hot_entries_hold_a_verify_pass() -> None:
    assert resolve_hisparse_entries(EngineConfig(enable_hisparse=True), 512) == 1024
    spec = EngineConfig(enable_hisparse=True, speculative_num_steps=3)
    assert resolve_hisparse_entries(spec, 512) == 4 * 512


@pytest.mark.gpu
@pytest.mark.parametrize("multi_stream", [False, True])
def test_cuda_graphs_on_gpu_equal_hisparse_off(multi_stream: bool) -> None:
    """fp32 micro on a GPU with the triton backend and captured decode graphs: HiSparse on (hot
    set = top-k, swaps every step, the mirror read and written in place) equals it off, with the
    HotSet's work on the side stream (multi-stream) or in line."""
    gpu_model = random_model(micro().replace(max_position_embeddings=1024), torch.float32,
                             torch.device("cuda"))
    prompts = random_prompts([50, 35, 66, 90], seed=10)
    args = {**BASE, "kernel_backend": "triton", "warmup": "none", "multi_stream": False}
    expected = run(LLMEngine(gpu_model, EngineConfig(**args)), prompts)  # type: ignore[arg-type]
    config = EngineConfig(**{**args, "multi_stream": multi_stream},  # type: ignore[arg-type]
                          enable_hisparse=True, hisparse_device_entries=TOPK)
    engine = LLMEngine(gpu_model, config)
    assert engine.runner.graphs is not None
    assert (engine.runner.side_stream is not None) == multi_stream
    assert engine.runner.pools.hot is not None and engine.runner.pools.hot.host_pool.is_pinned()
    assert run(engine, prompts) == expected
    assert engine.runner.graphs.replays >= 8
    assert int(engine.runner.pools.hot.stats()["hisparse/swapped"]) > 0
    assert_free(engine)


@pytest.mark.gpu
def test_captured_verify_passes_on_gpu(tmp_path: Path) -> None:
    """Speculative decoding (N = 2, drafts rejected in turn) with HiSparse through the captured
    decode graphs (triton, fp32): verify passes attend through the hot sets inside the graphs;
    greedy outputs equal plain decoding."""
    write_checkpoint(micro(), tmp_path, seed=2, tokenizer=False)
    prompts = random_prompts([61, 38, 90, 17], seed=13)
    max_tokens = [9, 14, 6, 11]
    args: dict[str, object] = dict(dtype="float32", device="cuda", page_size=16,
                                   max_running_requests=4, max_total_tokens=2048,
                                   kernel_backend="triton", warmup="none")
    want = run_staggered(LLM(tmp_path, **args).engine, prompts,  # type: ignore[arg-type]
                         max_tokens)
    spec = LLM(tmp_path, speculative_num_steps=2, enable_hisparse=True,  # type: ignore[arg-type]
               hisparse_device_entries=3 * TOPK, **args)
    assert spec.engine.runner.graphs is not None
    Oracle(spec.engine, want, 2)
    assert run_staggered(spec.engine, prompts, max_tokens) == want
    assert spec.engine.runner.graphs.replays > 0
    assert_free(spec.engine)


# ---- startup errors --------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(enable_hisparse=True, hisparse_device_entries=0),
     r"hisparse_device_entries=0 is invalid; allowed: None or an integer >= the model's"),
    (dict(hisparse_device_entries=8), r"hisparse_device_entries=8 needs enable_hisparse=True"),
    (dict(enable_hisparse=1), r"enable_hisparse=1 is invalid; allowed: True or False"),
])
def test_config_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)  # type: ignore[arg-type]


def test_too_few_hot_entries_is_a_startup_error(model: DeepSeekV4ForCausalLM) -> None:
    config = EngineConfig(**BASE, enable_hisparse=True,  # type: ignore[arg-type]
                          hisparse_device_entries=TOPK - 1)
    with pytest.raises(ValueError, match=f"hisparse_device_entries={TOPK - 1} is invalid; "
                                         f"allowed: an integer >= the model's index_topk={TOPK}"):
        LLMEngine(model, config)


def test_unsupported_paths_are_startup_errors(model: DeepSeekV4ForCausalLM,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="enable_hisparse=True with tp_size=2, dp_size=1 is not "
                                         "supported"):
        ServerConfig(model="m", enable_hisparse=True, tp_size=2)
    with pytest.raises(ValueError, match="dp_size=2 is not supported"):
        ServerConfig(model="m", enable_hisparse=True, dp_size=2)
    # CUDA graphs with speculative decoding: a captured verify pass must attend through the hot
    # sets (a staged one syncs the host)
    fake = types.SimpleNamespace(
        device=torch.device("cuda"), hot_entries=2 * TOPK, model=types.SimpleNamespace(
            config=micro()), config=EngineConfig(enable_hisparse=True, kernel_backend="triton",
                                                 speculative_num_steps=2))
    with pytest.raises(ValueError, match=r"hisparse_device_entries=8 is too few for CUDA graphs "
                                         r"with speculative_num_steps=2.*allowed: "
                                         r"hisparse_device_entries >= 12"):
        ModelRunner._decode_graphs(fake)  # type: ignore[arg-type]
    no_csa = random_model(micro().replace(attn_types=("swa", "hca") * 2 + ("swa",)),
                          torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"needs a model with C4 \(csa\) attention layers"):
        LLMEngine(no_csa, EngineConfig(**BASE, enable_hisparse=True))  # type: ignore[arg-type]
    monkeypatch.setattr(runner_module, "available_host_bytes", lambda: 1024)
    with pytest.raises(ValueError, match="the host mirror needs .* GB and the host has 0.00 GB "
                                         "available"):
        LLMEngine(model, EngineConfig(**BASE, enable_hisparse=True))  # type: ignore[arg-type]


# ---- CLI and memory plan ---------------------------------------------------------------------
def test_cli_serve_flags() -> None:
    def config(*argv: str) -> EngineConfig:
        args = build_parser().parse_args(["serve", "--device", "cpu", *argv])
        return build_config(args).engine_config

    assert not config().enable_hisparse and config().hisparse_device_entries is None
    on = config("--enable-hisparse", "--hisparse-device-entries", "256")
    assert on.enable_hisparse and on.hisparse_device_entries == 256
    with pytest.raises(ValueError, match="--enable-hisparse with --tp-size"):
        config("--enable-hisparse", "--tp-size", "2")


def test_cli_generate_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_checkpoint(micro(), tmp_path, seed=8)
    flags = ["generate", "--model", str(tmp_path), "--max-tokens", "12", "--device", "cpu",
             "--dtype", "float32", "--page-size", "16"]
    prompt = "def fib(n): return fib(n - 1) + fib(n - 2) if n > 1 else n"
    assert main([*flags, prompt]) == 0
    plain = capsys.readouterr().out
    assert main([*flags, "--enable-hisparse", "--hisparse-device-entries", str(TOPK), prompt]) == 0
    assert capsys.readouterr().out == plain
    assert main([*flags, "--enable-hisparse", "--hisparse-device-entries", "1", prompt]) == 2


def test_memory_plan_counts_the_hot_sets(model: DeepSeekV4ForCausalLM) -> None:
    """The dry-run plan of a HiSparse engine equals its allocation: the KV pools hold the hot sets
    and no C4 entries, the host mirror is counted apart; a KV budget holds more full pages."""
    config = EngineConfig(page_size=16, max_running_requests=16, kv_cache_memory_gb=0.0015,
                          swa_tokens=512, enable_hisparse=True)
    cfg: ModelConfig = model.config
    (plan,) = plan_memory(cfg, config, torch.float32)
    runner = LLMEngine(model, config).runner
    assert runner.pools.hot is not None
    assert plan.kv == runner.pools.nbytes() and plan.full_pages == runner.layout.num_full_pages - 1
    host = runner.pools.hot.host_pool
    assert plan.host == host.numel() * host.element_size()
    (off,) = plan_memory(cfg, dataclasses.replace(config, enable_hisparse=False), torch.float32)
    assert plan.full_pages > off.full_pages
