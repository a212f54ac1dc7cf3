"""FP8 indexer keys: one e4m3 code per channel and one power-of-two fp32 scale per key.

The indexer-key pool of a CSA layer holds, per C4 entry, Id = 128 channels that the lightning
indexer reads for every visible entry at every decode step: at long context that read is the
indexer's whole cost. SGLang and vLLM store these keys in FP8 (128 B + a 4-byte scale per key,
against 256 B in bf16); the DeepSeek reference rounds them to FP4 in its QAT simulation
(model-spec §11). Here, with `index_key_dtype="fp8"`:

    scale = 2^k, the smallest power of two with amax(|x|) <= 448 * scale   (k in [-126, 126])
    code  = e4m3(x / scale)         round to nearest even; |x / scale| <= 448, never saturates
    value = fp32(code) * scale      (exact)

Why a power of two: x / scale is exact, so the code is one rounding of x (the same bits from
torch's cast and from the Triton kernels' integer encoding, `kernels/triton/fp8_rows.py`), and
scores over the dequantised keys may apply the scale after the dot (`q · (c * s) == s * (q · c)`
exactly in fp32). k comes from amax's exponent and mantissa bits (no log2, no division), so every
implementation derives the same scale. The scale is that of the checkpoint's UE8M0 blocks, kept
as an fp32 word per key.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0                 # largest finite e4m3 (e4m3fn)
_MANT_175 = 0x600000            # the mantissa bits of 1.75 (448 = 1.75 * 2^8)
_K_MIN, _K_MAX = -126, 126      # the scales stay normal fp32, their inverses too


def scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """k [..] int32 of the smallest power of two with amax <= 448 * 2^k (amax fp32 >= 0).

    amax = m * 2^e (m in [1, 2)): amax <= 1.75 * 2^(8 + k) iff k >= e - 8 when m <= 1.75, else
    k >= e - 7. Zero and subnormal amax take the smallest k."""
    bits = amax.float().view(torch.int32)
    e = (bits >> 23) - 127
    k = e - 8 + ((bits & 0x7FFFFF) > _MANT_175).to(torch.int32)
    return k.clamp(_K_MIN, _K_MAX)


def pow2(k: torch.Tensor) -> torch.Tensor:
    """2^k fp32 for int32 k in [-126, 127], built from its exponent bits."""
    return ((k + 127) << 23).to(torch.int32).view(torch.float32)


def quantize_index_keys(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., Id] (any float dtype; its fp32 values) -> (codes [..., Id] float8_e4m3fn,
    scales [...] fp32): per row, the module docstring's scale and codes."""
    xf = x.float()
    k = scale_exponent(xf.abs().amax(dim=-1))
    codes = (xf * pow2(-k)[..., None]).to(torch.float8_e4m3fn)
    return codes, pow2(k)


def dequantize_index_keys(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(codes [..., Id] float8_e4m3fn, scales [...] fp32) -> the keys' values [..., Id] fp32."""
    return codes.float() * scales[..., None]


def round_index_keys(x: torch.Tensor) -> torch.Tensor:
    """x [..., Id] -> its FP8 keys' values fp32 (quantise, then dequantise): what the serving path
    reads back from an FP8 pool for keys of these fp32 values."""
    return dequantize_index_keys(*quantize_index_keys(x))
