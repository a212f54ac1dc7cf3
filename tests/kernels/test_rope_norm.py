"""Parity of the fused RMSNorm + RoPE (+ cache write) kernels with the references.

The kernels of `kernels/triton/rope_norm.py` against `kernels/ref/rope_norm.py` (and
`kernels.ref.rope_norm.rms_norm` for the plain RMSNorm): micro / tiny head geometries under the
interpreter on CPU (fp32 and bf16, T = 1 and ragged 7 tokens, a rope slice narrower than the head,
scattered pool slots, column slices of a wider tensor read in place; q and
kv in one launch bit-equal to their two launches),
V4-Flash shapes (H 64, D 512, rd 64; norms over 4096
and 1024) compiled on the GPU (`-m gpu`).

    PYTHONPATH=src python -m pytest -q tests/kernels/test_rope_norm.py [-m gpu]
"""

from __future__ import annotations

import pytest
import torch

from dsv4.kernels.ref.rope_norm import (
    kv_norm_rope_store,
    q_norm_rope,
    qkv_norm_rope,
    rms_norm,
)
from dsv4.kernels.triton.rope_norm import (
    triton_kv_norm_rope_store,
    triton_q_norm_rope,
    triton_qkv_norm_rope,
    triton_rms_norm,
    triton_rope,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# max |diff| / max |ref|; bf16: two roundings vs one
TOL = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2}


def _tables(T: int, rd: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    angles = (torch.rand(T, rd // 2, generator=g, device=DEVICE) * 6.3
              * torch.arange(1, T + 1, device=DEVICE)[:, None])
    return angles.cos(), angles.sin()


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert err <= TOL[dtype], f"max |diff| / max |ref| = {err:.2e}"


def check_all(T: int, H: int, D: int, rd: int, dtype: torch.dtype, seed: int = 0) -> None:
    g = torch.Generator(DEVICE).manual_seed(seed)
    cos, sin = _tables(T, rd, g)
    q = (torch.randn(T, H, D, generator=g, device=DEVICE) * 3).to(dtype)
    _close(triton_q_norm_rope(q, cos, sin, 1e-6), q_norm_rope(q, cos, sin, 1e-6), dtype)
    kv = (torch.randn(T, D, generator=g, device=DEVICE) * 2).to(dtype)
    weight = torch.rand(D, generator=g, device=DEVICE) + 0.5
    slots = torch.randperm(3 * T + 5, generator=g, device=DEVICE)[:T]
    pools = [torch.full((3 * T + 5, D), 7.0, dtype=dtype, device=DEVICE) for _ in range(2)]
    kv_norm_rope_store(kv, weight, 1e-6, cos, sin, pools[0], slots)
    triton_kv_norm_rope_store(kv, weight, 1e-6, cos, sin, pools[1], slots)
    untouched = torch.ones(3 * T + 5, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert bool((pools[1][untouched] == 7.0).all()), "a row outside `slots` was written"
    _close(pools[1][slots], pools[0][slots], dtype)
    # both in one launch: the two launches' bits; the reference's values
    both = torch.full_like(pools[1], 7.0)
    q_both = triton_qkv_norm_rope(q, 1e-6, kv, weight, 1e-6, cos, sin, both, slots)
    assert torch.equal(q_both, triton_q_norm_rope(q, cos, sin, 1e-6))
    assert torch.equal(both, pools[1])
    ref_pool = torch.full_like(pools[0], 7.0)
    _close(q_both, qkv_norm_rope(q, 1e-6, kv, weight, 1e-6, cos, sin, ref_pool, slots), dtype)
    assert torch.equal(ref_pool, pools[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H,D,rd", [(1, 4, 32, 8), (7, 4, 32, 8), (5, 8, 64, 16), (3, 2, 48, 48)])
def test_parity(T: int, H: int, D: int, rd: int, dtype: torch.dtype) -> None:
    check_all(T, H, D, rd, dtype, seed=T + D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (1, 7, 96), (5, 256)])
def test_rms_norm(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    g = torch.Generator(DEVICE).manual_seed(len(shape))
    x = (torch.randn(*shape, generator=g, device=DEVICE) * 4).to(dtype)
    w = torch.rand(shape[-1], generator=g, device=DEVICE) + 0.5
    _close(triton_rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6), dtype)


@pytest.mark.parametrize("T", [1, 5])
def test_column_slices_read_in_place(T: int) -> None:
    """Inputs that are column slices of one wider tensor (a fused projection's output: rows a
    stride apart, heads D apart) give their contiguous copies' results bit for bit."""
    H, D, rd = 4, 32, 8
    g = torch.Generator(DEVICE).manual_seed(T)
    cos, sin = _tables(T, rd, g)
    wide = torch.randn(T, 48 + H * D + D, generator=g, device=DEVICE) * 3
    q, kv = wide[:, 48:48 + H * D].view(T, H, D), wide[:, 48 + H * D:]
    for op in (lambda x: triton_q_norm_rope(x, cos, sin, 1e-6),
               lambda x: triton_rope(x, cos, sin)):
        assert torch.equal(op(q), op(q.contiguous()))
    weight = torch.rand(D, generator=g, device=DEVICE) + 0.5
    slots = torch.randperm(T + 3, generator=g, device=DEVICE)[:T]
    pools = [torch.zeros(T + 3, D, device=DEVICE) for _ in range(2)]
    triton_kv_norm_rope_store(kv, weight, 1e-6, cos, sin, pools[0], slots)
    triton_kv_norm_rope_store(kv.contiguous(), weight, 1e-6, cos, sin, pools[1], slots)
    assert torch.equal(pools[0], pools[1])
    pool = torch.zeros(T + 3, D, device=DEVICE)
    got = triton_qkv_norm_rope(q, 1e-6, kv, weight, 1e-6, cos, sin, pool, slots)
    assert torch.equal(got, triton_q_norm_rope(q.contiguous(), cos, sin, 1e-6))
    assert torch.equal(pool, pools[1])
    for x in (kv, wide[None, :, :H * D]):          # [T, D] and [1, T, H * D] slices
        got = triton_rms_norm(x, torch.ones(x.shape[-1], device=DEVICE), 1e-6)
        assert got.is_contiguous()
        assert torch.equal(got, triton_rms_norm(x.contiguous(), torch.ones(x.shape[-1],
                                                                              device=DEVICE),
                                                1e-6))


def test_validation() -> None:
    cos, sin = _tables(2, 8, torch.Generator(DEVICE).manual_seed(0))
    with pytest.raises(ValueError, match="cos / sin"):
        triton_q_norm_rope(torch.randn(3, 4, 32, device=DEVICE), cos, sin, 1e-6)
    with pytest.raises(ValueError, match="slots"):
        triton_kv_norm_rope_store(torch.randn(2, 32, device=DEVICE), torch.ones(32, device=DEVICE),
                                  1e-6, cos, sin, torch.zeros(8, 32, device=DEVICE),
                                  torch.zeros(2, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="must share T and D"):
        triton_qkv_norm_rope(torch.randn(2, 4, 32, device=DEVICE), 1e-6,
                             torch.randn(2, 16, device=DEVICE), torch.ones(16, device=DEVICE),
                             1e-6, cos, sin, torch.zeros(8, 16, device=DEVICE),
                             torch.zeros(2, dtype=torch.int64, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 4096])
def test_flash_shapes(T: int) -> None:
    check_all(T, 64, 512, 64, torch.bfloat16, seed=T)
    g = torch.Generator(DEVICE).manual_seed(T)
    for d in (4096, 1024):   # the blocks' norms (hidden size) and q_norm (q_lora_rank)
        x = torch.randn(T, d, generator=g, device=DEVICE).to(torch.bfloat16)
        w = torch.rand(d, generator=g, device=DEVICE) + 0.5
        _close(triton_rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6), torch.bfloat16)
