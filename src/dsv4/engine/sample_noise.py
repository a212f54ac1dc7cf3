"""The sampler's randomness: counter-based uniforms, a pure function of (seed, step, token id).

A request samples the same tokens alone or in any batch, on any device, and after preemption or
a restart: no generator state exists (`hash_uniform`). `engine/sampler.py` draws its categorical
samples from these (the exponential race), speculative decoding its acceptance tests.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MASK31 = (1 << 31) - 1
# NOTE: multipliers are odd (so multiplication mod 2**31 is a bijection) and < 2**32, so a
# product with a value < 2**31 stays below 2**63 and int64 arithmetic never overflows.
_MUL1 = 0x7FEB352D
_MUL2 = 0x846CA68B
_SEED_SALT = 0x2545F491
_KEY1_SALT = 0x1B873593
_KEY2_SALT = 0x5BD1E995
_UNIFORM_BITS = 23


def _mix31_(x: Tensor) -> Tensor:
    """In place: bijective avalanche mix of int64 values in [0, 2**31) (31-bit lowbias-style)."""
    x ^= x >> 16
    x *= _MUL1
    x &= _MASK31
    x ^= x >> 15
    x *= _MUL2
    x &= _MASK31
    x ^= x >> 16
    return x


def _row_keys(seeds: Tensor, steps: Tensor) -> tuple[Tensor, Tensor]:
    """Two independent 31-bit keys per row from (seed < 2**63, step < 2**31); `[B]` each."""
    key = _mix31_((seeds & _MASK31) ^ _SEED_SALT)
    key = _mix31_(key ^ ((seeds >> 31) & _MASK31))
    key = _mix31_(key ^ (seeds >> 62))
    key = _mix31_(key ^ (steps & _MASK31))
    return _mix31_(key ^ _KEY1_SALT), _mix31_(key ^ _KEY2_SALT)


def hash_uniform(seeds: Tensor, steps: Tensor, vocab: int, device: torch.device | str) -> Tensor:
    """Counter-based uniforms: `u[b, v] = f(seeds[b], steps[b], v)` in the open interval (0, 1).

    A stateless hash RNG (like Philox, but plain int64 tensor ops so it runs unchanged on any
    device): each row's (seed, step) is folded into two 31-bit keys, then every token id `v` goes
    through two keyed rounds `x = mix(x ^ key)`, where `mix` is a multiply-xorshift bijection on
    [0, 2**31). Values stay below 2**31 so int64 products never overflow. The top 23 bits of `x`
    map to `(y + 0.5) / 2**23`, which float32 represents exactly, so the result is strictly inside
    (0, 1) and `-log(u)` is finite and positive.

    A row depends only on its own (seed, step), never on the other rows or the batch size.

    NOTE: eager mode runs ~25 int64 passes over `[B, V]` (3.7 ms at B=256, V=129280 on an H200);
    the chain is purely elementwise, so `torch.compile` fuses it into one kernel with
    bitwise-identical output (0.08 ms).

    `seeds`: `[B]` int64 in [0, 2**63); `steps`: `[B]` int64 in [0, 2**31); `vocab`: the number of
    columns V; `device`: the result's device. Returns `[B, V]` float32.
    """
    seeds = seeds.to(device=device, dtype=torch.int64)
    steps = steps.to(device=device, dtype=torch.int64)
    key1, key2 = _row_keys(seeds, steps)  # [B], [B]
    # [B, V]
    x = torch.arange(vocab, device=device, dtype=torch.int64).unsqueeze(0) ^ key1.unsqueeze(1)
    _mix31_(x)
    x ^= key2.unsqueeze(1)
    _mix31_(x)
    x >>= 31 - _UNIFORM_BITS
    return (x.to(torch.float32) + 0.5) * (2.0**-_UNIFORM_BITS)
