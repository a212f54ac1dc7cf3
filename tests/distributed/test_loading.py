"""Per-rank loading (`distributed/loading.py`, issue 22): `load_shard` equals load-then-shard.

For `micro` (bf16, and FP8 / FP4 with cuts inside scale blocks), the shipped dsv4-tiny (official
FP8 / FP4 layout) and `micro` in the transformers layout, at TP 2 and EP 2, both ranks computed in
one process (no process group): every parameter and buffer of `load_shard` equals
`shard_model(load_model(...))`'s exactly, the modules match, and each rank reads less than the
full load (official layout: at least half the expert bytes fewer; the transformers layout's
stacked experts are read whole, then cut). Under DP attention `load_dp_shard` equals
`enable_dp_attention(load_model(...))` the same way, in both weight formats, with and without EP.
A missing tensor is reported by the rank that owns it; layouts `shard_model` refuses are refused
before reading."""

from __future__ import annotations

import json
import shutil
from itertools import chain
from pathlib import Path

import pytest
import torch
from fp8_geometry import micro_blocks
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dsv4.assets import default_model_path
from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import random_model, write_checkpoint
from dsv4.distributed.dp import DPGroup, enable_dp_attention
from dsv4.distributed.loading import (
    Source,
    load_dp_shard_with_report,
    load_shard,
    load_shard_with_report,
)
from dsv4.distributed.tp import TPGroup, shard_model
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.model.loader import load_model
from dsv4.model.quant_linear import QuantLinear
from dsv4.model.state_dict_adapter import to_hf_state_dict
from dsv4.model.weights import CheckpointError, official_state_dict, shard_files


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    write_checkpoint(micro(), root / "micro", seed=4, tokenizer=False)
    write_checkpoint(micro(), root / "micro-fp8-fp4", seed=4, weight_quant="fp8+fp4",
                     tokenizer=False)
    hf = root / "micro-hf"               # transformers in-memory names, stacked experts
    hf.mkdir()
    official = official_state_dict(load_model(root / "micro", "float32", progress=False))
    save_file({k: v.contiguous() for k, v in to_hf_state_dict(official).items()},
              str(hf / "model.safetensors"))
    save_file({k: v.contiguous() for k, v in official.items() if k.startswith("mtp.")},
              str(hf / "mtp.safetensors"))
    shutil.copy(root / "micro" / "config.json", hf / "config.json")
    write_checkpoint(micro_blocks(), root / "blocks", seed=4, weight_quant="fp8+fp4",
                     tokenizer=False)
    return {"micro": root / "micro", "micro-fp8-fp4": root / "micro-fp8-fp4",
            "micro-hf": hf, "tiny": default_model_path(), "blocks": root / "blocks"}


def tensors(model: DeepSeekV4ForCausalLM) -> dict[str, torch.Tensor]:
    return dict(chain(model.named_parameters(), model.named_buffers()))


def expert_bytes(path: Path) -> int:
    """Bytes of the routed experts' tensors (codes and scales) in the checkpoint."""
    total = 0
    for file in shard_files(path):
        with safe_open(str(file), framework="pt") as f:
            total += sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size()
                         for k in f.keys() if ".experts." in k)
    return total


@pytest.mark.parametrize("layout", ["tp2", "ep2"])
@pytest.mark.parametrize(("name", "dtype"), [("micro", "float32"), ("micro-fp8-fp4", "float32"),
                                             ("micro-hf", "float32"), ("tiny", "bfloat16")])
def test_shard_equals_load_then_shard(checkpoints: dict[str, Path], name: str, dtype: str,
                                      layout: str) -> None:
    path, ep = checkpoints[name], layout == "ep2"
    experts = expert_bytes(path)
    for rank in range(2):
        tp = TPGroup(rank, 2)
        want = shard_model(load_model(path, dtype, progress=False), tp, ep)
        got, report = load_shard_with_report(path, dtype, "cpu", tp, ep)
        a, b = tensors(want), tensors(got)
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
            assert a[key].requires_grad == b[key].requires_grad, key
        for (na, ma), (nb, mb) in zip(want.named_modules(), got.named_modules(), strict=True):
            assert (na, type(ma), ma.training) == (nb, type(mb), mb.training)
        assert report.bytes_read < report.checkpoint_bytes
        if name != "micro-hf":          # official layout: a rank reads half the experts' bytes
            assert experts > 0 and report.bytes_read <= report.checkpoint_bytes - experts // 2
        assert report.host_peak == report.shard_bytes + report.staged > report.shard_bytes


@pytest.mark.parametrize("ep", [False, True])
@pytest.mark.parametrize(("name", "dtype", "fmt"), [
    ("micro", "float32", "bf16"), ("micro-hf", "float32", "bf16"),
    ("micro-fp8-fp4", "float32", "checkpoint"), ("tiny", "bfloat16", "checkpoint"),
    ("blocks", "float32", "checkpoint")])
def test_dp_shard_equals_load_then_enable(checkpoints: dict[str, Path], name: str, dtype: str,
                                          fmt: str, ep: bool) -> None:
    """Under DP attention each rank's `load_dp_shard` holds what `enable_dp_attention` makes of
    the full load, bit for bit (tiny in checkpoint format: FP4 experts cut by id, the FP8 shared
    experts dequantised and cut); with EP it reads at least half the experts' bytes fewer
    (official layouts), without it the whole checkpoint."""
    path = checkpoints[name]
    experts = expert_bytes(path)
    for rank in range(2):
        dp = DPGroup(rank, 2)
        want = enable_dp_attention(load_model(path, dtype, progress=False, weight_format=fmt),
                                   dp, ep)
        got, report = load_dp_shard_with_report(path, dtype, "cpu", dp, ep, fmt)
        a, b = tensors(want), tensors(got)
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
        for (na, ma), (nb, mb) in zip(want.named_modules(), got.named_modules(), strict=True):
            assert (na, type(ma)) == (nb, type(mb))
        if not ep:
            assert report.bytes_read == report.checkpoint_bytes
        elif name != "micro-hf":
            assert experts > 0 and report.bytes_read <= report.checkpoint_bytes - experts // 2
            local = got.layers[2].ffn.experts
            assert local.start == rank * local.count == rank * got.config.n_routed_experts // 2


@pytest.mark.parametrize(("name", "dtype"), [("micro-fp8-fp4", "float32"), ("tiny", "bfloat16"),
                                             ("blocks", "float32")])
def test_expert_parallel_shard_keeps_checkpoint_format(checkpoints: dict[str, Path], name: str,
                                                      dtype: str) -> None:
    """EP 2 with the experts kept as FP4 codes: `load_shard` equals load-then-shard, each rank
    holds half the experts' codes and scales, and reads about half the experts' bytes."""
    path = checkpoints[name]
    experts = expert_bytes(path)
    for rank in range(2):
        tp = TPGroup(rank, 2)
        want = shard_model(load_model(path, dtype, progress=False, weight_format="checkpoint"),
                           tp, True)
        got, report = load_shard_with_report(path, dtype, "cpu", tp, True, "checkpoint")
        a, b = tensors(want), tensors(got)
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
        local = got.layers[2].ffn.experts
        assert type(local).__name__ == "LocalQuantExperts" and local.start == rank * local.count
        assert local.w13.shape[0] == got.config.n_routed_experts // 2
        assert report.bytes_read <= report.checkpoint_bytes - experts // 2


def named_bytes(path: Path, ends: tuple[str, ...]) -> int:
    """Bytes of the checkpoint's non-expert tensors (codes and scales alike) whose name, or module
    name, ends with one of `ends`."""
    total = 0
    for file in shard_files(path):
        with safe_open(str(file), framework="pt") as f:
            total += sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size()
                         for k in f.keys()
                         if (k.endswith(ends) or k.rsplit(".", 1)[0].endswith(ends))
                         and ".experts." not in k)
    return total


@pytest.mark.parametrize("dp", [False, True], ids=["tp2-ep2", "dp2-ep2"])
def test_fp8_linears_cut_on_scale_blocks_stay_fp8(checkpoints: dict[str, Path], dp: bool) -> None:
    """On a geometry whose cuts are whole 128x128 blocks (as V4-Flash's), every FP8 linear of the
    full load is still FP8 codes in each rank's shard: a cut one holds half its codes and
    scales, and decodes exactly to the full weight's cut; the rank reads half of those linears'
    bytes (the official layout's codes and scales, less a rounding of the scale rows)."""
    path = checkpoints["blocks"]
    full = load_model(path, "float32", progress=False, weight_format="checkpoint")
    dense = {n: m.dequantized(torch.float32) for n, m in full.named_modules()
             if isinstance(m, QuantLinear)}
    cut = ("shared_experts.w1", "shared_experts.w2", "shared_experts.w3")
    if not dp:
        cut += ("attn.wq_b", "attn.wo_a", "attn.wo_b")
    for rank in range(2):
        group = TPGroup(rank, 2)
        got, report = (load_dp_shard_with_report(path, "float32", "cpu", group, True, "checkpoint")
                       if dp else load_shard_with_report(path, "float32", "cpu", group, True,
                                                         "checkpoint"))
        kept = {n: m for n, m in got.named_modules() if isinstance(m, QuantLinear)}
        assert set(kept) == set(dense)
        halved = 0
        for name, m in kept.items():
            want = dense[name]
            if name.endswith(cut) and ".indexer." not in name:
                dim = 1 if name.endswith(("wo_b", "w2")) else 0
                size = want.shape[dim] // 2
                want = want.narrow(dim, rank * size, size)
                halved += 1
            assert torch.equal(m.dequantized(torch.float32), want), name
        assert halved == len([n for n in dense if n.endswith(cut) and ".indexer." not in n]) > 0
        split = named_bytes(path, cut) + expert_bytes(path)
        if not dp:
            split += named_bytes(path, ("embed", "head", "attn_sink"))
        assert report.bytes_read == report.checkpoint_bytes - split // 2


@pytest.mark.parametrize(("geometry", "fmt", "layout"), [
    ("micro", "bf16", "tp2"), ("micro", "bf16", "tp2-ep2"), ("micro", "checkpoint", "tp2-ep2"),
    ("blocks", "checkpoint", "tp2-ep2"), ("micro", "bf16", "dp2-ep2"),
    ("blocks", "checkpoint", "dp2-ep2")])
def test_dummy_shard_equals_random_model_then_layout(tmp_path: Path, geometry: str, fmt: str,
                                                    layout: str) -> None:
    """`Source("dummy")`: each rank draws its shard of the random model without building the
    rest (nothing but config.json read), bit for bit what the one-process random model holds
    after the same layout: float cuts, experts by id, FP4 expert codes per expert, FP8 linears cut
    on their blocks (blocks) or dequantised then cut (micro)."""
    config = micro_blocks() if geometry == "blocks" else micro()
    path = tmp_path / geometry
    write_checkpoint(config, path, weights=False, tokenizer=False)
    ep, dp = "ep2" in layout, layout.startswith("dp")
    for rank in range(2):
        group = TPGroup(rank, 2)
        full = random_model(config, torch.float32, torch.device("cpu"), 7,
                            fmt)  # type: ignore[arg-type]
        want = enable_dp_attention(full, group, ep) if dp else shard_model(full, group, ep)
        load = load_dp_shard_with_report if dp else load_shard_with_report
        got, report = load(path, "float32", "cpu", group, ep, fmt,  # type: ignore[arg-type]
                           Source("dummy", 7))
        a, b = tensors(want), tensors(got)
        assert a.keys() == b.keys() and report.bytes_read == 0
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
        for (na, ma), (nb, mb) in zip(want.named_modules(), got.named_modules(), strict=True):
            assert (na, type(ma)) == (nb, type(mb))


def test_checkpoint_bytes_are_what_the_full_load_reads(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["tiny"]
    full = sum(t.numel() * t.element_size() for f in shard_files(path)
               for t in load_file(str(f)).values())
    _, report = load_shard_with_report(path, "bfloat16", "cpu", TPGroup(0, 1))
    assert report.checkpoint_bytes == report.bytes_read == full


def test_a_missing_tensor_is_reported_by_its_owner(checkpoints: dict[str, Path],
                                                   tmp_path: Path) -> None:
    bad = shutil.copytree(checkpoints["micro"], tmp_path / "bad")
    (file,) = shard_files(bad)
    state = load_file(str(file))
    del state["layers.2.ffn.experts.5.w1.weight"]          # expert 5 of 8: EP rank 1's
    save_file(state, str(file))
    index = bad / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())
        del weight_map["weight_map"]["layers.2.ffn.experts.5.w1.weight"]
        index.write_text(json.dumps(weight_map))
    load_shard(bad, "float32", "cpu", TPGroup(0, 2), expert_parallel=True)
    with pytest.raises(CheckpointError, match="missing 1 tensor"):
        load_shard(bad, "float32", "cpu", TPGroup(1, 2), expert_parallel=True)
    with pytest.raises(CheckpointError, match="missing 1 tensor"):
        load_shard(bad, "float32", "cpu", TPGroup(0, 2))


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"tp": TPGroup(0, 3)}, "does not divide num_heads="),
    ({"tp": TPGroup(0, 2), "weight_format": "checkpoint"}, "checkpoint-format"),
])
def test_refused_layouts(checkpoints: dict[str, Path], kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_shard(checkpoints["micro"], "float32", "cpu", **kwargs)
