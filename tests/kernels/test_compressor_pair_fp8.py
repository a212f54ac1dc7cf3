"""The compress pair op with an FP8 indexer-key pool (the second target's `out_scale`).

Reference: its codes and scales are `quantize_index_keys` of the entries a float pool gets,
rounded to `key_dtype` first. Triton (fused launch, at any step size): the same codes and scales
where its fp32 entries round alike, and never more than one e4m3 step away (the fp32 entries
differ from the reference's in their last bits: other summation orders). The attention entries
and both rings are unchanged by the indexer's format. Engine metadata drives the steps
(`compress_steps.EngineSteps`): a prefill, an extend beside decodes, then decode steps.
"""

from __future__ import annotations

import pytest
import torch
from compress_steps import EngineSteps

from dsv4.checkpoint.presets import micro
from dsv4.kernels.ref.compressor import CompressTarget, compress_cached_pair
from dsv4.kernels.ref.index_keys import dequantize_index_keys, quantize_index_keys
from dsv4.kernels.triton.compressor_pair import triton_compress_pair

# the interpreter's fp32 -> bf16 cast truncates; the GPU's (and torch's) rounds to nearest even
pytestmark = pytest.mark.usefixtures("round_bf16_to_nearest_even")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
DCS, RD = (32, 16), 8


class Pools:
    """One CSA layer's two compressor states: rings, attention entries, indexer keys (float
    entries, or FP8 codes with scales)."""

    def __init__(self, rows: int, n_out: int, fp8: bool) -> None:
        self.rings = [(torch.zeros(rows, 2 * dc, device=DEVICE),
                       torch.full((rows, 2 * dc), float("-inf"), device=DEVICE)) for dc in DCS]
        self.entries = torch.zeros(n_out, DCS[0], device=DEVICE)
        self.keys = torch.zeros(n_out, DCS[1], device=DEVICE,
                                dtype=torch.float8_e4m3fn if fp8 else torch.float32)
        self.scales = torch.zeros(n_out, device=DEVICE) if fp8 else None

    def targets(self, proj: list[tuple[torch.Tensor, torch.Tensor]], weights: list[torch.Tensor],
                apes: list[torch.Tensor], key_dtype: torch.dtype) -> list[CompressTarget]:
        (ka, sa), (kb, sb) = proj
        first = CompressTarget(ka, sa, *self.rings[0], weights[0], self.entries, apes[0])
        second = CompressTarget(kb, sb, *self.rings[1], weights[1], self.keys, apes[1],
                                self.scales, key_dtype)
        return [first, second]


def run_steps(key_dtype: torch.dtype, fuse_knobs: dict[str, bool]) -> None:
    steps = EngineSteps(micro(), 16, torch.device(DEVICE))
    cache = steps.cache("csa")
    assert cache.state is not None and cache.entries is not None
    rows, n_out = cache.state.kv.shape[0], cache.entries.shape[0]
    gen = torch.Generator(DEVICE).manual_seed(5)
    weights = [torch.rand(dc, generator=gen, device=DEVICE) + 0.5 for dc in DCS]
    apes = [torch.randn(4, 2 * dc, generator=gen, device=DEVICE) for dc in DCS]
    inv_freq = 1.0 / 10000 ** (torch.arange(0, RD, 2, device=DEVICE) / RD)
    ref_float, ref_fp8, kernel = Pools(rows, n_out, False), Pools(rows, n_out, True), \
        Pools(rows, n_out, True)
    works = [[(0, 9), (1, 13)], [(0, 1), (1, 11)]] + [[(0, 1), (1, 1)]] * 9
    for work in works:
        plan = steps.plan(work, 4)
        freqs = plan.entry_pos[:, None].float() * inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        T = sum(n for _, n in work)
        proj = [(torch.randn(T, 2 * dc, generator=gen, device=DEVICE),
                 2 * torch.randn(T, 2 * dc, generator=gen, device=DEVICE)) for dc in DCS]
        compress_cached_pair(*ref_float.targets(proj, weights, apes, key_dtype), plan.index, EPS,
                             cos, sin)
        compress_cached_pair(*ref_fp8.targets(proj, weights, apes, key_dtype), plan.index, EPS,
                             cos, sin)
        triton_compress_pair(*kernel.targets(proj, weights, apes, key_dtype), plan.index, EPS,
                             cos, sin, **fuse_knobs)
        steps.release(work)
    live = slice(0, n_out - 1)
    assert ref_fp8.scales is not None and kernel.scales is not None
    written = ref_float.keys[live].abs().amax(dim=1) > 0      # rows no step wrote stay zero
    assert int(written.sum()) >= 6
    codes, scales = quantize_index_keys(ref_float.keys[live].to(key_dtype))
    assert torch.equal(ref_fp8.keys[live].view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(ref_fp8.scales[live][written], scales[written])
    for a, b in zip(ref_float.rings + [(ref_float.entries,)], kernel.rings + [(kernel.entries,)],
                    strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.allclose(x[:-1], y[:-1], rtol=1e-5, atol=1e-6)    # (last: trash)
    same_codes = (kernel.keys[live].view(torch.uint8) == codes.view(torch.uint8))[written]
    assert same_codes.float().mean() >= 0.99
    assert (kernel.scales[live] == scales)[written].float().mean() >= 0.9
    got = dequantize_index_keys(kernel.keys[live], kernel.scales[live])[written]
    want = dequantize_index_keys(codes, scales)[written]
    step = want.abs().clamp(min=2 ** -6 * scales[written][:, None]) * 2 ** -3
    assert ((got - want).abs() <= step).all()


@pytest.mark.parametrize("key_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_keys_against_reference(key_dtype: torch.dtype) -> None:
    run_steps(key_dtype, {})


def test_fp8_keys_invariant_plan_fuses() -> None:
    """`invariant=True` (RL's token-count-invariant plans) takes the fused launch with FP8 keys
    at every step size; `fuse=False` cannot write FP8 and raises."""
    run_steps(torch.float32, {"invariant": True})
    with pytest.raises(ValueError, match="written by the fused launch only"):
        run_steps(torch.float32, {"fuse": False})
