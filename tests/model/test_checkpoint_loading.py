"""load_model on the tiny preset: corrupted checkpoints, arguments, sharding, the transformers
in-memory layout, the bf16 dtype policy and the training (autograd) path (model-spec §12).

Every corrupted checkpoint is a copy of one written once by `write_checkpoint`, edited with
safetensors load_file/save_file (the index json is kept in sync).
"""

from __future__ import annotations

import json
import logging
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from dsv4 import ModelConfig, load_model
from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import write_checkpoint
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.model.indexer import Indexer
from dsv4.model.moe import Gate
from dsv4.model.weights import CheckpointError, official_state_dict

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    write_checkpoint(micro(), out, seed=0, tokenizer=False)
    return out


@pytest.fixture(scope="module")
def model32(ckpt: Path) -> DeepSeekV4ForCausalLM:
    """The fp32 model; shared, so tests must not modify it (training loads its own)."""
    return load_model(ckpt, dtype="float32", progress=False)


def all_tensors(model: DeepSeekV4ForCausalLM) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters()) | dict(model.named_buffers())


def edited_copy(src: Path, dst: Path, drop: tuple[str, ...] = (),
                put: dict[str, torch.Tensor] | None = None) -> Path:
    """Copy checkpoint `src` to `dst`, dropping keys and adding/replacing tensors (in the shard
    that holds the key, new keys go to the first shard); the index weight_map follows."""
    shutil.copytree(src, dst)
    index = json.loads((dst / INDEX).read_text())
    weight_map: dict[str, str] = index["weight_map"]
    put = dict(put or {})
    for key in drop:
        assert key in weight_map, key
    first = sorted(set(weight_map.values()))[0]
    for key in put:
        weight_map.setdefault(key, first)
    for shard in sorted(set(weight_map.values())):
        tensors = load_file(str(dst / shard))
        for key in drop:
            if weight_map[key] == shard:
                del tensors[key]
        for key, t in put.items():
            if weight_map[key] == shard:
                tensors[key] = t.contiguous()
        save_file(tensors, str(dst / shard), metadata={"format": "pt"})
    for key in drop:
        del weight_map[key]
    (dst / INDEX).write_text(json.dumps(index, indent=2))
    return dst


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype, name
        assert torch.equal(got[name], t), name


@pytest.fixture
def dsv4_records() -> Iterator[list[logging.LogRecord]]:
    """Log records of the `dsv4` logger (it does not propagate to the root: caplog misses them)."""
    records: list[logging.LogRecord] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler, logger = _Keep(level=logging.DEBUG), logging.getLogger("dsv4")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


# ---- corrupted checkpoints -----------------------------------------------------------------------
@pytest.mark.parametrize("key", [
    "layers.1.attn.compressor.ape",          # CSA compressor
    "mtp.0.e_proj.weight",                   # MTP layer
    "layers.0.ffn.gate.tid2eid",             # hash-MoE buffer
    "layers.3.ffn.experts.5.w2.weight",      # one routed expert of a stacked parameter
    "hc_head_fn",                            # top-level mHC head
])
def test_missing_tensor(ckpt: Path, tmp_path: Path, key: str) -> None:
    bad = edited_copy(ckpt, tmp_path / "bad", drop=(key,))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\)") as err:
        load_model(bad, dtype="float32", progress=False)
    assert key in str(err.value)


def test_wrong_shape(ckpt: Path, tmp_path: Path) -> None:
    name = "layers.0.attn.wq_a.weight"
    w = load_file(str(next(ckpt.glob("model-*.safetensors"))))[name]
    assert tuple(w.shape) == (32, 64)
    bad = edited_copy(ckpt, tmp_path / "bad", put={name: torch.cat((w, w[:1]))})
    with pytest.raises(CheckpointError) as err:
        load_model(bad, dtype="float32", progress=False)
    msg = str(err.value)
    assert name in msg and "(33, 64)" in msg and "(32, 64)" in msg


def test_wrong_shape_of_one_expert(ckpt: Path, tmp_path: Path) -> None:
    name = "layers.2.ffn.experts.1.w3.weight"
    bad = edited_copy(ckpt, tmp_path / "bad",
                      put={name: torch.zeros(32, 65, dtype=torch.bfloat16)})
    with pytest.raises(CheckpointError, match=r"\(32, 65\).*\(32, 64\)") as err:
        load_model(bad, dtype="float32", progress=False)
    assert name in str(err.value)


@pytest.mark.parametrize("key", ["layers.0.attn.bogus.weight", "layers.2.ffn.experts.8.w1.weight",
                                 "layers.0.attn.compressor.ape"])  # layer 0 is SWA: no compressor
def test_unexpected_tensor(ckpt: Path, tmp_path: Path, key: str) -> None:
    bad = edited_copy(ckpt, tmp_path / "bad",
                      put={key: torch.zeros(32, 64, dtype=torch.bfloat16)})
    with pytest.raises(CheckpointError, match="unexpected tensor") as err:
        load_model(bad, dtype="float32", progress=False)
    assert key in str(err.value)


def test_duplicate_tensor(ckpt: Path, tmp_path: Path) -> None:
    """Without an index every `*.safetensors` file is read; a key present twice is an error."""
    bad = shutil.copytree(ckpt, tmp_path / "bad")
    (bad / INDEX).unlink()
    name = "layers.0.attn.wq_a.weight"
    save_file({name: load_file(str(next(ckpt.glob("model-*.safetensors"))))[name]},
              str(bad / "extra.safetensors"))
    with pytest.raises(CheckpointError, match="appears twice") as err:
        load_model(bad, dtype="float32", progress=False)
    assert name in str(err.value)


def test_nonexistent_path(tmp_path: Path) -> None:
    path = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=str(path)):
        load_model(path, dtype="float32", progress=False)


def test_index_names_missing_shard(ckpt: Path, tmp_path: Path) -> None:
    bad = shutil.copytree(ckpt, tmp_path / "bad")
    shard = next(bad.glob("model-*.safetensors"))
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_model(bad, dtype="float32", progress=False)


@pytest.fixture(scope="module")
def ckpt_fp8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "tiny-fp8"
    write_checkpoint(micro(), out, seed=0, weight_quant="fp8", tokenizer=False)
    return out


def test_quantised_weight_without_scale(ckpt_fp8: Path, tmp_path: Path) -> None:
    bad = edited_copy(ckpt_fp8, tmp_path / "bad", drop=("layers.0.attn.wq_a.scale",))
    with pytest.raises(CheckpointError, match=r"without a `\.scale`") as err:
        load_model(bad, dtype="float32", progress=False)
    assert "layers.0.attn.wq_a" in str(err.value)


def test_scale_without_quantised_weight(ckpt_fp8: Path, tmp_path: Path) -> None:
    bad = edited_copy(ckpt_fp8, tmp_path / "bad", drop=("layers.0.attn.wq_a.weight",))
    with pytest.raises(CheckpointError,
                       match=r"`\.scale` tensors without a quantised weight") as err:
        load_model(bad, dtype="float32", progress=False)
    assert "layers.0.attn.wq_a" in str(err.value)


def test_fp8_checkpoint_loads_close_to_unquantised(ckpt_fp8: Path,
                                                   model32: DeepSeekV4ForCausalLM) -> None:
    m8 = load_model(ckpt_fp8, dtype="float32", progress=False)
    assert m8.config == model32.config.replace(weight_quant="fp8")
    w, w8 = model32.layers[0].attn.wq_a.weight, m8.layers[0].attn.wq_a.weight
    assert not torch.equal(w, w8)
    assert (w - w8).abs().max() <= 0.07 * w.abs().max()  # e4m3: 3 mantissa bits
    torch.testing.assert_close(m8.layers[0].attn.attn_sink, model32.layers[0].attn.attn_sink,
                               rtol=0, atol=0)


# ---- arguments -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float16", "fp32", torch.float16])
def test_bad_dtype(ckpt: Path, dtype: object) -> None:
    with pytest.raises(ValueError, match=r"dtype=.*allowed: \['bfloat16', 'float32'\]"):
        load_model(ckpt, dtype=dtype, progress=False)  # type: ignore[arg-type]


@pytest.mark.parametrize("device", ["mps", "meta"])
def test_bad_device(ckpt: Path, device: str) -> None:
    with pytest.raises(ValueError, match=rf"device='{device}'.*allowed: \['cpu', 'cuda'\]"):
        load_model(ckpt, dtype="float32", device=device, progress=False)


def test_bad_device_unknown_to_torch(ckpt: Path) -> None:
    with pytest.raises(ValueError, match=r"device='tpu'.*allowed: \['cpu', 'cuda'\]"):
        load_model(ckpt, dtype="float32", device="tpu", progress=False)


# ---- sharding ------------------------------------------------------------------------------------
def test_sharded_checkpoint_equals_single_shard(ckpt: Path, model32: DeepSeekV4ForCausalLM,
                                                tmp_path: Path) -> None:
    out = tmp_path / "sharded"
    write_checkpoint(micro(), out, seed=0, shard_bytes=200_000, tokenizer=False)
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 2
    weight_map = json.loads((out / INDEX).read_text())["weight_map"]
    assert sorted(set(weight_map.values())) == [s.name for s in shards]
    assert len(list(ckpt.glob("model-*.safetensors"))) == 1
    model = load_model(out, dtype="float32", progress=False)
    assert model.config == model32.config
    assert_same_tensors(model.state_dict(), model32.state_dict())


# ---- transformers in-memory layout ---------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_checkpoint(model32: DeepSeekV4ForCausalLM,
                  tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A transformers `DeepseekV4ForCausalLM` filled with our weights, saved with its in-memory
    names (`model.safetensors`) + its config.json; the MTP tensors (which transformers drops) in
    `mtp.safetensors`."""
    transformers = pytest.importorskip("transformers")
    from dsv4.model.state_dict_adapter import to_hf_state_dict

    cfg = model32.config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_model = transformers.DeepseekV4ForCausalLM(
            transformers.DeepseekV4Config(**cfg.to_hf_dict()))
    official = official_state_dict(model32)
    hf_sd = to_hf_state_dict(official)
    assert sorted(hf_sd) == sorted(hf_model.state_dict())
    hf_model.load_state_dict(hf_sd, strict=True)
    out = tmp_path_factory.mktemp("hf") / "tiny-hf"
    out.mkdir()
    save_file({k: v.detach().clone().contiguous() for k, v in hf_model.state_dict().items()},
              str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(hf_model.config.to_dict()))
    mtp = {k: v.clone().contiguous() for k, v in official.items() if k.startswith("mtp.")}
    assert mtp
    save_file(mtp, str(out / "mtp.safetensors"))
    return out


def test_transformers_layout_loads_exactly(hf_checkpoint: Path,
                                           model32: DeepSeekV4ForCausalLM) -> None:
    names = list(load_file(str(hf_checkpoint / "model.safetensors")))
    assert ("model.embed_tokens.weight" in names
            and "model.layers.2.mlp.experts.gate_up_proj" in names)
    assert "layer_types" in json.loads((hf_checkpoint / "config.json").read_text())
    assert ModelConfig.from_hf(hf_checkpoint) == model32.config
    model = load_model(hf_checkpoint, dtype="float32", progress=False)
    assert_same_tensors(all_tensors(model), all_tensors(model32))


def test_transformers_layout_missing_one_mtp_tensor(hf_checkpoint: Path, tmp_path: Path) -> None:
    bad = shutil.copytree(hf_checkpoint, tmp_path / "bad")
    mtp = load_file(str(bad / "mtp.safetensors"))
    del mtp["mtp.0.h_proj.weight"]
    save_file(mtp, str(bad / "mtp.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\).*mtp\.0\.h_proj\.weight"):
        load_model(bad, dtype="float32", progress=False)


def test_transformers_layout_without_mtp(hf_checkpoint: Path, model32: DeepSeekV4ForCausalLM,
                                         tmp_path: Path,
                                         dsv4_records: list[logging.LogRecord]) -> None:
    """transformers drops MTP when it saves; such a checkpoint (no `mtp.*` at all) loads without the
    MTP layer and says so (`loader._mtp_checked`); the main model is exact."""
    plain = shutil.copytree(hf_checkpoint, tmp_path / "plain")
    (plain / "mtp.safetensors").unlink()
    model = load_model(plain, dtype="float32", progress=False)
    assert len(model.mtp) == 0 and model.config == model32.config.replace(num_mtp_layers=0)
    assert any(r.levelno == logging.WARNING and "mtp" in r.getMessage() for r in dsv4_records)
    want = {k: v for k, v in all_tensors(model32).items() if not k.startswith("mtp.")}
    assert_same_tensors(all_tensors(model), want)


def test_official_layout_without_mtp_is_an_error(ckpt: Path, tmp_path: Path) -> None:
    """Only the transformers layout may lack MTP: an official checkpoint must carry it."""
    index = json.loads((ckpt / INDEX).read_text())
    mtp_keys = tuple(k for k in index["weight_map"] if k.startswith("mtp."))
    bad = edited_copy(ckpt, tmp_path / "bad", drop=mtp_keys)
    with pytest.raises(CheckpointError, match=r"missing \d+ tensor\(s\).*'mtp\.0\."):
        load_model(bad, dtype="float32", progress=False)


# ---- bf16 dtype policy ---------------------------------------------------------------------------
def _expect_fp32(name: str) -> bool:
    return (name.endswith("norm.weight") or ".hc_attn." in name or ".hc_ffn." in name
            or name.startswith("hc_head.") or ".hc_head." in name
            or name.endswith(("attn_sink", ".ape", "gate.bias", "compressor.wkv.weight",
                              "compressor.wgate.weight")))


def test_bf16_dtype_policy(ckpt: Path) -> None:
    model = load_model(ckpt, dtype="bfloat16", progress=False)
    params = dict(model.named_parameters())
    for name in ("layers.0.attn_norm.weight", "layers.0.attn.q_norm.weight",
                 "layers.0.attn.kv_norm.weight", "norm.weight", "layers.0.hc_attn.fn",
                 "layers.0.hc_ffn.base", "hc_head.fn", "layers.0.attn.attn_sink",
                 "layers.1.attn.compressor.ape", "layers.1.attn.indexer.compressor.ape",
                 "layers.2.ffn.gate.bias", "layers.1.attn.compressor.wkv.weight",
                 "layers.1.attn.compressor.wgate.weight", "layers.2.attn.compressor.wkv.weight",
                 "mtp.0.hc_head.fn", "mtp.0.enorm.weight"):
        assert params[name].dtype == torch.float32, name
    for name in ("layers.0.attn.wq_a.weight", "layers.0.attn.wo_a.weight", "embed.weight",
                 "head.weight", "layers.2.ffn.experts.w1", "layers.0.ffn.shared_experts.w2.weight",
                 "layers.0.ffn.gate.weight", "layers.1.attn.indexer.wq_b.weight",
                 "mtp.0.e_proj.weight"):
        assert params[name].dtype == torch.bfloat16, name
    for name, p in params.items():  # the whole policy, written independently of keeps_fp32
        assert p.dtype == (torch.float32 if _expect_fp32(name) else torch.bfloat16), name
    buffers = dict(model.named_buffers())
    assert buffers["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    assert buffers["rope_main.inv_freq"].dtype == torch.float32


def _discrete_choices(model: DeepSeekV4ForCausalLM,
                      ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits and, per gate / indexer, the sorted selected ids per token ([B, S, k])."""
    choices: list[torch.Tensor] = []
    B, S = ids.shape

    def hook(module: torch.nn.Module, args: object, out: object) -> None:
        sel = out[0] if isinstance(out, tuple) else out
        choices.append(sel.reshape(B, S, -1).sort(dim=-1).values)

    handles = [m.register_forward_hook(hook) for m in model.modules()
               if isinstance(m, (Gate, Indexer))]
    try:
        with torch.no_grad():
            logits = model(ids)
    finally:
        for h in handles:
            h.remove()
    return logits, choices


def test_bf16_forward_close_to_fp32(ckpt: Path, model32: DeepSeekV4ForCausalLM) -> None:
    model = load_model(ckpt, dtype="bfloat16", progress=False)
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    ref, ref_sel = _discrete_choices(model32, ids)
    got, got_sel = _discrete_choices(model, ids)
    assert got.dtype == torch.float32 and got.shape == ref.shape == (2, 40, 512)
    assert torch.isfinite(got).all()
    # bf16 rounding can flip a near-tied routed-expert or indexer top-k choice; that token's logits
    # then legitimately differ by O(1), and later tokens attend to it. Compare exactly-comparable
    # positions: those before the first discrete disagreement of their row (spec §13, gotcha 1).
    assert len(ref_sel) == len(got_sel) == 5 + 2  # 5 gates, 2 CSA indexers
    same = torch.stack([(a == b).all(-1)
                        for a, b in zip(ref_sel, got_sel, strict=True)]).all(0)  # [B, S]
    clean = same.int().cumprod(dim=-1).bool()
    assert clean.float().mean() >= 0.4
    scale = ref.abs().max()
    diff = (got - ref).abs()
    assert diff.amax(-1)[clean].max() < 0.1 * scale
    assert diff.mean() < 0.02 * scale  # everywhere, flips included


# ---- training path -------------------------------------------------------------------------------
def test_backward_reaches_every_kind_of_parameter(ckpt: Path) -> None:
    model = load_model(ckpt, dtype="float32", progress=False).train()
    assert all(p.requires_grad for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (2, 33), generator=g)
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    assert torch.isfinite(loss)
    loss.backward()
    params = dict(model.named_parameters())
    for name in ("embed.weight", "head.weight", "norm.weight", "hc_head.fn", "hc_head.base",
                 "hc_head.scale", "layers.0.hc_attn.fn", "layers.0.hc_ffn.fn",
                 "layers.0.attn.wq_a.weight", "layers.0.attn.attn_sink",
                 "layers.1.attn.compressor.wkv.weight", "layers.1.attn.compressor.wgate.weight",
                 "layers.1.attn.compressor.ape", "layers.2.attn.compressor.wkv.weight",
                 "layers.2.ffn.experts.w1", "layers.4.ffn.experts.w2", "layers.0.ffn.experts.w3",
                 "layers.2.ffn.gate.weight", "layers.3.ffn.shared_experts.w1.weight"):
        grad = params[name].grad
        assert grad is not None, name
        assert torch.isfinite(grad).all(), name
        assert grad.abs().sum() > 0, name
    # MTP is unused by forward()
    assert all(p.grad is None for n, p in params.items() if n.startswith("mtp."))


def test_loading_does_not_import_torch_dynamo() -> None:
    """A fresh process that loads the shipped model never imports torch._dynamo (over a second of
    every server, rank and actor start): the meta-device construction runs no torch._refs op."""
    import subprocess
    import sys

    code = ("import sys; from dsv4.assets import default_model_path; "
            "from dsv4.model.loader import load_model; "
            "load_model(default_model_path(), dtype='float32', device='cpu', progress=False); "
            "print('torch._dynamo' in sys.modules)")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(root / "src"), "OMP_NUM_THREADS": "1",
                              "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "False", out.stdout + out.stderr
