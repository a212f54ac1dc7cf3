"""The MTP block (model-spec §9): shapes, loading of `mtp.*`, and its equations written out by
hand.

transformers has no MTP layer, so the oracle here is the spec itself:
    e  = enorm(embed(ids));  hX = hnorm(X_main) per stream
    X  = e_proj(e)[:, :, None] + h_proj(hX)
    X  = Block_SWA,routed(X)               (main RoPE: θ = rope_theta, no YaRN)
    logits = head(norm(hc_head_mtp(X)))
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from dsv4 import load_model
from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import write_checkpoint
from dsv4.model.block import Block
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.model.forward_mode import INFERENCE


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mtp") / "tiny"
    write_checkpoint(micro(), out, seed=5, tokenizer=False)
    return out


@pytest.fixture(scope="module")
def model(ckpt: Path) -> DeepSeekV4ForCausalLM:
    return load_model(ckpt, dtype="float32", progress=False)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def test_mtp_structure_and_weights(model: DeepSeekV4ForCausalLM, ckpt: Path) -> None:
    assert len(model.mtp) == model.config.num_mtp_layers == 1
    mtp = model.mtp[0]
    assert mtp.attn_type == "swa" and mtp.attn.compressor is None and mtp.attn.indexer is None
    assert (not mtp.ffn.gate.is_hash and mtp.ffn.gate.bias is not None
            and mtp.ffn.gate.tid2eid is None)
    assert not any(n.startswith("embed") or n.startswith("head") for n, _ in mtp.named_parameters())
    with safe_open(str(next(ckpt.glob("*.safetensors"))), framework="pt") as f:
        keys = [k for k in f.keys() if k.startswith("mtp.0.")]
        assert "mtp.0.e_proj.weight" in keys and "mtp.0.hc_head_fn" in keys
        assert not any(".compressor." in k or ".indexer." in k or "tid2eid" in k for k in keys)
        torch.testing.assert_close(mtp.e_proj.weight, f.get_tensor("mtp.0.e_proj.weight").float(),
                                   rtol=0, atol=0)
        torch.testing.assert_close(mtp.hc_head.fn, f.get_tensor("mtp.0.hc_head_fn"), rtol=0, atol=0)
        w1_e3 = f.get_tensor("mtp.0.ffn.experts.3.w1.weight").float()
    torch.testing.assert_close(mtp.ffn.experts.w1[3], w1_e3, rtol=0, atol=0)


def test_mtp_equations(model: DeepSeekV4ForCausalLM) -> None:
    cfg = model.config
    eps = cfg.rms_norm_eps
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 23), generator=gen)
    next_ids = torch.randint(0, cfg.vocab_size, (2, 23), generator=gen)
    mtp = model.mtp[0]
    with torch.no_grad():
        streams = model.forward_streams(ids)
        logits = model.mtp_logits(streams, next_ids)
        assert streams.shape == (2, 23, cfg.hc_mult, cfg.hidden_size)
        assert logits.shape == (2, 23, cfg.vocab_size) and logits.dtype == torch.float32

        # the spec, term by term
        e = rms(model.embed.weight[next_ids], mtp.enorm.weight, eps)
        hx = rms(streams, mtp.hnorm.weight, eps)
        x = (e @ mtp.e_proj.weight.T)[:, :, None, :] + hx @ mtp.h_proj.weight.T
        block = Block(cfg, "swa", "routed", cfg.num_layers)
        block_state = {k: v for k, v in mtp.state_dict().items()
                       if k.split(".")[0] in dict(block.named_children())}
        block.load_state_dict(block_state, strict=True)
        pos = torch.arange(23, dtype=torch.float32)
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.rope_head_dim, 2).float()
                                            / cfg.rope_head_dim)
        cos, sin = torch.cos(pos[:, None] * inv_freq), torch.sin(pos[:, None] * inv_freq)
        x = block(x, next_ids, cos, sin, mode=INFERENCE)
        flat = x.flatten(2)
        mix = (flat / torch.sqrt(flat.pow(2).mean(-1, keepdim=True) + eps)) @ mtp.hc_head.fn.T
        pre = torch.sigmoid(mix * mtp.hc_head.scale + mtp.hc_head.base) + cfg.hc_eps
        y = (pre[..., None] * x).sum(dim=2)
        expected = F.linear(rms(y, mtp.norm.weight, eps), model.head.weight)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)


def test_mtp_depth_out_of_range(model: DeepSeekV4ForCausalLM) -> None:
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="mtp depth=1 out of range"):
        model.mtp_logits(model.forward_streams(ids), ids, depth=1)
