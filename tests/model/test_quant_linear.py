"""FP8 linears kept in checkpoint encoding (`weight_format="checkpoint"`, `model/quant_linear.py`).

On `micro` written in the official layout (FP8 linears, FP4 experts): the load keeps the file's
codes and scales byte for byte in `QuantLinear`s exactly where the file has FP8 linears; serving
(fp32, `ref` backend) gives the greedy tokens and logits of the same checkpoint with its linears
dequantised; the grouped wo_a product on 128-row groups equals the float einsum; fusion skips
FP8 groups; tensor parallelism cuts whole scale blocks and dequantises a linear cut inside
one (`narrow_`); `update_weights` re-quantises a
float weight with the writer's codec; random weights build in the encoding; the compressor
projections stay the bf16 they are stored in; and the flash-4l geometry's weight bytes (meta
device) against bf16.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from dsv4 import LLM, SamplingParams
from dsv4.checkpoint.presets import flash_4l, micro
from dsv4.checkpoint.writer import random_model, write_checkpoint
from dsv4.distributed.tp import TPGroup, shard_model
from dsv4.engine.weight_sync import update_weights
from dsv4.kernels.ref import quant
from dsv4.model.fused_projections import fuse_projections
from dsv4.model.loader import empty_model, load_model
from dsv4.model.moe import MLP
from dsv4.model.quant_linear import QuantLinear
from dsv4.model.weights import shard_files

PROMPTS = [[5, 9, 17, 33, 2, 80, 41], [7, 7, 100, 3]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("micro_fp8")
    write_checkpoint(micro(), path, seed=4, tokenizer=False, weight_quant="fp8+fp4")
    return path


def _quant_linears(model: nn.Module) -> dict[str, QuantLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def test_load_keeps_the_file_bytes(ckpt: Path) -> None:
    model = load_model(ckpt, dtype="float32", progress=False, weight_format="checkpoint")
    coded = _quant_linears(model)
    files: dict[str, torch.Tensor] = {}
    for file in shard_files(ckpt):
        with safe_open(str(file), "pt") as f:
            files.update({k: f.get_tensor(k) for k in f.keys()})
    fp8 = {k.removesuffix(".scale") for k in files
           if k.endswith(".scale") and ".experts." not in k}
    assert set(coded) == fp8 and any(n.endswith("wo_a") for n in coded)
    for name, m in coded.items():
        assert m.weight.dtype == torch.float8_e4m3fn
        assert torch.equal(m.weight.view(torch.uint8), files[f"{name}.weight"].view(torch.uint8))
        assert torch.equal(m.scale, files[f"{name}.scale"].view(torch.uint8))
    # the compressor projections: bf16 as stored (fp32 in a float model), the file's bytes
    projections = {n: p for n, p in model.named_parameters()
                   if n.endswith(("compressor.wkv.weight", "compressor.wgate.weight"))}
    assert any(".indexer." in n for n in projections)
    for name, p in projections.items():
        assert files[name].dtype == p.dtype == torch.bfloat16, name
        assert torch.equal(p.view(torch.int16), files[name].view(torch.int16)), name
    dense = load_model(ckpt, dtype="float32", progress=False)
    for name, m in coded.items():
        assert torch.equal(m.dequantized(torch.float32), dense.get_submodule(name).weight)


def _serve(path: Path, fmt: str, backend: str) -> list[tuple[list[int], list[float]]]:
    llm = LLM(path, dtype="float32", device="cpu", weight_format=fmt, page_size=16,
              max_total_tokens=512, kernel_backend=backend)
    assert bool(_quant_linears(llm.model)) == (fmt == "checkpoint")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    return [(list(o.token_ids), list(o.logprobs)) for o in outs]


def serves_like_dequantised(path: Path, backend: str) -> None:
    """Greedy tokens equal and chosen log-probs within 1e-5 (GEMM rounding) of the dequantised
    model's (the `ref` backend of both)."""
    want = _serve(path, "bf16", "ref")
    got = _serve(path, "checkpoint", backend)
    for (ids_a, lp_a), (ids_b, lp_b) in zip(want, got, strict=True):
        assert ids_a == ids_b and len(lp_a) == len(ids_a)
        assert max(abs(a - b) for a, b in zip(lp_a, lp_b, strict=True)) < 1e-5


def test_serves_like_dequantised_ref(ckpt: Path) -> None:
    serves_like_dequantised(ckpt, "ref")


def test_full_sequence_logits_match(ckpt: Path) -> None:
    dense = load_model(ckpt, dtype="float32", progress=False)
    coded = load_model(ckpt, dtype="float32", progress=False, weight_format="checkpoint")
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        assert torch.allclose(coded(ids), dense(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [128, 48])
def test_grouped_equals_einsum(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole 128-row blocks per group run the op on the group's rows; 48 (micro's geometry) runs
    it on all rows per group (no dequantised copy: that path's host checks broke graph capture)."""
    g, d_in = 2, 192
    q = QuantLinear(d_in, g * rows)
    q.quantize_from(torch.randn(g * rows, d_in) / d_in**0.5)
    x = torch.randn(3, 4, g, d_in)
    w = q.dequantized(torch.float32).view(g, rows, d_in)
    want = torch.einsum("bsgd,grd->bsgr", x, w)

    def refuse(*args: object) -> None:
        raise AssertionError("grouped() dequantised the weight (host syncs under capture)")

    monkeypatch.setattr(QuantLinear, "dequantized", refuse)
    assert torch.allclose(q.grouped(x), want, rtol=1e-5, atol=1e-5)


def test_fusion_stacks_fp8_groups(ckpt: Path) -> None:
    """FP8 members fuse among themselves when every member but the last holds whole 128-row
    scale blocks: on micro wq_b (128 rows) | the indexer's wq_b does; wq_a (32 rows) | wkv and
    w1 (32) | w3 do not. The members' codes and scales become views of the stacked ones, and the
    group's one `quant_linear` call gives each member's own output."""
    model = load_model(ckpt, dtype="float32", progress=False, weight_format="checkpoint")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fuse_projections(model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    fused = 0
    for m in model.modules():
        if isinstance(m, MLP):
            assert isinstance(m.w1, QuantLinear) and m.fused_w13 is None
        if hasattr(m, "fused_x") and m.indexer is not None:
            assert m.fused_x is None and m.fused_q is not None and m.fused_q.scale is not None
            members = [m.wq_b, m.indexer.wq_b]
            assert m.fused_q.holds([q.weight for q in members], [q.scale for q in members])
            x = torch.randn(3, m.wq_b.in_features)
            for got, q in zip(m.fused_q(x, m.fused_q.gemm(None)), members, strict=True):
                assert torch.equal(got, q(x))
            fused += 1
    assert fused > 0


def test_tensor_parallel_dequantises_only_cuts_off_the_blocks(ckpt: Path) -> None:
    """micro's cut FP8 linears (wq_b: 64 rows per rank, wo_a / wo_b, the shared experts) are not
    whole 128-wide scale blocks: dequantised exactly, then cut; the replicated ones (wq_a, wkv,
    the indexer's wq_b) stay FP8 codes."""
    model = load_model(ckpt, dtype="float32", progress=False, weight_format="checkpoint")
    wq_b = _quant_linears(model)["layers.0.attn.wq_b"].dequantized(torch.float32)
    kept = {n for n in _quant_linears(model) if not n.endswith(("wq_b", "wo_a", "wo_b"))
            and ".shared_experts." not in n or ".indexer." in n}
    shard = shard_model(model, TPGroup(0, 2), expert_parallel=True)
    assert set(_quant_linears(shard)) == kept and kept
    got = shard.get_submodule("layers.0.attn.wq_b").weight
    assert isinstance(got, nn.Parameter) and torch.equal(got, wq_b[:got.shape[0]])


@pytest.mark.parametrize(("dim", "start", "size"), [(0, 128, 128), (1, 0, 128), (0, 256, 44),
                                                    (1, 128, 72)])
def test_narrow_keeps_the_codes_of_whole_blocks(dim: int, start: int, size: int) -> None:
    """A cut of whole scale blocks (the matrix's last partial block included) decodes to exactly
    the full weight's cut; its split-K counters cover the new rows."""
    q = QuantLinear(200, 300)
    q.randomize_(torch.Generator().manual_seed(0))
    q.scale.copy_(torch.randint(120, 134, q.scale.shape, dtype=torch.uint8))
    full = q.dequantized(torch.float32)
    q.narrow_(dim, start, size)
    assert torch.equal(q.dequantized(torch.float32), full.narrow(dim, start, size))
    assert (q.out_features, q.in_features) == tuple(q.weight.shape)
    assert q.counters.shape[0] * 16 >= q.out_features and not q.counters.any()


@pytest.mark.parametrize(("dim", "start", "size", "match"), [
    (0, 64, 128, "whole 128-wide"), (1, 0, 100, "whole 128-wide"), (0, 256, 128, "outside")])
def test_narrow_refuses_cuts_inside_blocks(dim: int, start: int, size: int, match: str) -> None:
    q = QuantLinear(200, 300)
    with pytest.raises(ValueError, match=match):
        q.narrow_(dim, start, size)
    assert tuple(q.weight.shape) == (300, 200)


def test_update_weights_requantises(ckpt: Path) -> None:
    model = load_model(ckpt, dtype="float32", progress=False, weight_format="checkpoint")
    name = "layers.1.attn.wq_a"
    m = _quant_linears(model)[name]
    new = (torch.randn(m.out_features, m.in_features) / 8).to(torch.bfloat16)
    update_weights(model, {f"{name}.weight": new})
    codes, scale = quant.quant_fp8_block(new)
    assert torch.equal(m.weight.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(m.scale, scale.view(torch.uint8))
    with pytest.raises(ValueError, match="shape"):
        update_weights(model, {f"{name}.weight": new[:-1]})


def test_update_weights_reaches_a_fused_fp8_group(ckpt: Path) -> None:
    """`update_weights` writes an FP8 member's codes and scales in place, so its fused group
    (views of the stacked buffers) computes with the new weight at once."""
    model = load_model(ckpt, dtype="float32", progress=False, weight_format="checkpoint")
    fuse_projections(model)
    attn = model.get_submodule("layers.1.attn")
    group = attn.fused_q
    assert group is not None and group.scale is not None
    new = (torch.randn(attn.wq_b.out_features, attn.wq_b.in_features) / 8).to(torch.bfloat16)
    update_weights(model, {"layers.1.attn.wq_b.weight": new})
    assert group.holds([attn.wq_b.weight, attn.indexer.wq_b.weight],
                       [attn.wq_b.scale, attn.indexer.wq_b.scale])
    x = torch.randn(2, attn.wq_b.in_features)
    got = group(x, group.gemm(None))[0]
    want = x @ quant.dequant_fp8_block(*quant.quant_fp8_block(new), torch.float32).T
    assert torch.equal(got, want)


def test_random_weights_in_the_encoding() -> None:
    model = random_model(micro(), torch.float32, torch.device("cpu"), seed=3,
                         weight_format="checkpoint")
    coded = _quant_linears(model)
    assert coded and all(not (m.weight.view(torch.uint8) & 0x7F == 0x7F).any()
                         for m in coded.values())
    for m in coded.values():
        rms = float(m.dequantized(torch.float32).square().mean().sqrt())
        assert 0.5 < rms * m.in_features**0.5 < 2.0
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([PROMPTS[0]]))).all()


def _nbytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def test_flash_4l_weight_bytes() -> None:
    """flash-4l (meta device): the FP8 linears hold half their bf16 bytes (plus 1/16384 for the
    scales), and the whole model in checkpoint precision (FP4 experts + FP8 linears) under 0.35x
    of its bf16 bytes (the issue's target)."""
    meta = torch.device("meta")
    bf16 = empty_model(flash_4l(), torch.bfloat16, meta)
    coded = empty_model(flash_4l(), torch.bfloat16, meta, "checkpoint")
    linears = _quant_linears(coded)
    dense = sum(bf16.get_submodule(n).weight.numel() * 2 for n in linears)
    fp8 = sum(_nbytes(m) for m in linears.values())
    assert 0.5 < fp8 / dense < 0.5002
    projections = [n for n, _ in bf16.named_parameters()
                   if n.endswith(("compressor.wkv.weight", "compressor.wgate.weight"))]
    assert projections
    for n in projections:   # fp32 in the float model, bf16 as stored in checkpoint precision
        assert bf16.get_parameter(n).dtype == torch.float32
        assert coded.get_parameter(n).dtype == torch.bfloat16
    ratio = _nbytes(coded) / _nbytes(bf16)
    print(f"flash-4l: FP8 linears {fp8 / dense:.4f}x of bf16; whole model {ratio:.4f}x "
          f"({_nbytes(coded) / 1e9:.2f} of {_nbytes(bf16) / 1e9:.2f} GB)")
    assert ratio <= 0.35


def test_split_k_counters_are_held_zero_and_not_state() -> None:
    """Each FP8 linear holds its kernel's split-K counters: zero after an uninitialised build
    (`to_empty` leaves garbage; `reset_buffers` zeroes them), not in the state dict (checkpoint
    names unchanged), and handed to the op on every call."""
    model = empty_model(micro(), torch.float32, torch.device("cpu"), "checkpoint")
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert linears and all(int(m.counters.abs().sum()) == 0 for m in linears)
    assert not any(k.endswith("counters") for k in model.state_dict())
    seen: list[torch.Tensor | None] = []

    class Ops:
        @staticmethod
        def quant_linear(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, *,
                         counters: torch.Tensor | None = None, up: torch.Tensor | None = None,
                         limit: float = 0.0) -> torch.Tensor:
            seen.append(counters)
            return x.new_zeros(*x.shape[:-1], w.shape[0])

    q = linears[0]
    q(torch.zeros(2, q.in_features), Ops())  # type: ignore[arg-type]
    assert len(seen) == 1 and seen[0] is q.counters
