"""FP8 indexer keys: one e4m3 code per channel and one power-of-two fp32 scale per key.

The indexer-key pool of a CSA layer holds, per C4 entry, Id = 128 channels that the lightning
indexer reads for every visible entry at every decode step: at long context that read is the
indexer's whole cost. SGLang and vLLM store these keys in FP8 (128 B + a 4-byte scale per key,
against 256 B in bf16); the DeepSeek reference rounds them to FP4 in its QAT simulation
(model-spec §11). Here, with `index_cache_dtype="fp8"`, a key (or an indexer query head) is
quantised as the reference quantises activations, one block per key: `ref/act_quant.py`'s
power-of-two scale of its amax and e4m3 codes (the Triton kernels use `triton/act_quant.py`'s
`pow2_ceil_scale` / `e4m3_codes`: the same bits). The value is code * scale, exactly. Because the
scale is a power of two, a score over the dequantised keys may apply it after the dot
(`q · (c * s) == s * (q · c)` exactly in fp32).
"""

from __future__ import annotations

import torch

from dsv4.kernels.ref.act_quant import act_quant


def quantize_index_keys(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., Id] (any float dtype; its fp32 values) -> (codes [..., Id] float8_e4m3fn,
    scales [...] fp32): `act_quant` with one block per row."""
    codes, scales = act_quant(x, block=x.shape[-1])
    return codes, scales[..., 0]


def dequantize_index_keys(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(codes [..., Id] float8_e4m3fn, scales [...] fp32) -> the keys' values [..., Id] fp32."""
    return codes.float() * scales[..., None]


def round_index_keys(x: torch.Tensor) -> torch.Tensor:
    """x [..., Id] -> its FP8 keys' values fp32 (quantise, then dequantise): what the serving path
    reads back from an FP8 pool for keys of these fp32 values."""
    return dequantize_index_keys(*quantize_index_keys(x))
