"""Radix-select building blocks shared by the Lightning TopK paths (row, compact and coop).

Owns the order-preserving key, the 8-bit digit histogram / bin search of one radix pass, the
index-order selection of one block and the -1 padding. Every helper is a `@triton.jit` device
function; none launches.

Keys. Each fp32 score maps to a uint32 whose unsigned order is the reference's order
(`ref/topk.py`): -0.0 is folded onto +0.0 (they tie), then sign set -> invert all bits, else set the
sign bit; every NaN maps to 0xFFFFFFFF, above +inf, as `torch.sort` ranks NaN (all NaNs tie with
each other, lower index first).

Radix pass p (digit = bits [24 - 8p, 32 - 8p) of the key, most significant first) over the keys
whose higher digits equal `prefix`:
    bin = largest d with count(digit >= d) >= k_rem;  k_rem -= count(digit > bin).
After 4 passes `prefix` is the k-th largest key `thr` and k_rem (>= 1) is how many keys == thr to
keep.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def order_key(x):  # type: ignore[no-untyped-def]
    """fp32 -> uint32 key whose unsigned order is the reference's score order (see the module
    docstring).

    NaN and +-0.0 are recognised by their bits, not by float compares: on the H200 `x != x` can be
    false for a NaN (the interpreter says true), which would give a NaN the key of its bit pattern,
    and a flush-to-zero `x == 0.0` would also catch denormals, which the reference orders by value.
    """
    u = x.to(tl.uint32, bitcast=True)
    mag = u & 0x7FFFFFFF
    u = tl.where(mag == 0, mag, u)                              # -0.0 -> +0.0 (they tie)
    key = tl.where((u >> 31) != 0, u ^ 0xFFFFFFFF, u | 0x80000000)
    return tl.where(mag > 0x7F800000, 0xFFFFFFFF, key)          # every NaN: above +inf


@triton.jit
def bin_floor(digit):  # type: ignore[no-untyped-def]
    """Float threshold of a digit-0 bin: order_key(x) >= digit << 24 <=> not (x < bin_floor(digit)).

    digit >= 128: the non-negative float whose key is digit << 24 (>= +0.0, so -0.0 passes with
    +0.0); 1 <= digit < 128: the negative float with key digit << 24 (low 24 bits of its magnitude
    all ones); digit 0: -inf. Never a denormal, so a flush-to-zero compare could only let more
    scores through. NaN passes (`not (NaN < t)`), as its key 0xFFFFFFFF is above every threshold.
    One compare instead of a key.
    """
    thr = digit.to(tl.uint32) << 24
    pos = (thr ^ 0x80000000).to(tl.float32, bitcast=True)
    neg = (~thr).to(tl.float32, bitcast=True)
    return tl.where(digit >= 128, pos, tl.where(digit == 0, float("-inf"), neg))


@triton.jit
def row_len(lengths_ptr, row, N):  # type: ignore[no-untyped-def]
    """Candidates of `row`: lengths[row] clamped to [0, N], as int32."""
    n = tl.load(lengths_ptr + row).to(tl.int64)
    return tl.minimum(tl.maximum(n, 0), N).to(tl.int32)


@triton.jit
def digit_hist(key, mask, prefix, SHIFT: tl.constexpr):  # type: ignore[no-untyped-def]
    """256-bin histogram of digit (key >> SHIFT) & 255 over masked keys whose higher digits equal
    prefix's."""
    match = mask & (((key >> SHIFT) >> 8) == ((prefix >> SHIFT) >> 8))
    digit = ((key >> SHIFT) & 0xFF).to(tl.int32)
    return tl.histogram(digit, 256, mask=match)


@triton.jit
def find_bin_count(hist, k_rem):  # type: ignore[no-untyped-def]
    """Bin of the k_rem-th largest key over a histogram of any power-of-two length (largest d with
    count(digit >= d) >= k_rem), the new k_rem, and the count in that bin.

    If the histogram holds fewer than k_rem keys the digit is 0 (every key is at or above it).
    """
    bins = tl.arange(0, hist.shape[0])
    incl = tl.cumsum(hist, 0)                                   # count(digit <= d)
    total = tl.sum(hist, 0)
    ge = total - incl + hist                                    # count(digit >= d), non-increasing
    digit = tl.max(tl.where(ge >= k_rem, bins, 0), 0)
    at = bins == digit
    return digit, k_rem - tl.sum(tl.where(at, total - incl, 0), 0), tl.sum(tl.where(at, hist, 0), 0)


@triton.jit
def find_bin(hist, k_rem):  # type: ignore[no-untyped-def]
    """`find_bin_count` without the count: the digit of one radix pass and the new k_rem."""
    digit, k_rem, _ = find_bin_count(hist, k_rem)
    return digit, k_rem


@triton.jit
def select_block(key, mask, thr, k_rem, eq_before, taken_before):  # type: ignore[no-untyped-def]
    """Keep mask and output positions of one block in index order; also its (#== thr, #kept).

    Keeps every key > thr and the ties == thr whose rank among all ties so far is < k_rem (lower
    index first).
    """
    eq = (mask & (key == thr)).to(tl.int32)
    eq_rank = eq_before + tl.cumsum(eq, 0) - eq                 # ties seen before this element
    keep = (mask & (key > thr)) | ((eq != 0) & (eq_rank < k_rem))
    kept = keep.to(tl.int32)
    pos = taken_before + tl.cumsum(kept, 0) - kept
    return keep, pos, tl.sum(eq, 0), tl.sum(kept, 0)


@triton.jit
def pad_tail(out_row_ptr, k_eff, K, PAD_BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """out[k_eff:K] = -1."""
    for start in range(0, K, PAD_BLOCK):
        offs = start + tl.arange(0, PAD_BLOCK)
        tl.store(out_row_ptr + offs, tl.full([PAD_BLOCK], -1, tl.int64),
                 mask=(offs >= k_eff) & (offs < K))
