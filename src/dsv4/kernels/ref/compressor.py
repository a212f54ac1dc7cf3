"""Reference token compressor ops (spec §6.5): gated pooling, and the serving-path step after
`project`.

Entry i of a non-overlap compressor pools the window [m*i, m*i + m) with a per-channel softmax
over positions. The overlap (C4) compressor pools 8 slots: the Ca half of window i-1 (slots
0..m-1) and the Cb half of window i (slots m..2m-1); window 0's Ca slots have weight 0.

`compress_cached` is the serving step (the `compress` op of `kernels/registry.py`; its fast form
is `kernels/triton/compressor.py::triton_compress_cached`): gather each token's S source rows from
this step's projections or the ring state, pool, weighted RMSNorm, RoPE at the entry position,
cast, write the entry, then write this step's ring rows. All ring reads precede all ring writes.

The gate scores' absolute position embedding (`ape`, [ratio, c*Dc]) is added per source slot as
the step pools: the serving path hands the op raw scores and the rings hold raw scores. Only a
token that completes a window pools, and for it slot s holds position p - S + 1 + s with
(p + 1) % ratio == 0 (S = ratio or 2 ratio): its ape row is s % ratio, whatever p is. So the
sum `score + ape[s % ratio]` is the fp32 add of the same two operands as the full-sequence
path's `score + ape[position % ratio]`: the same bits, with no position needed and no launch of
its own. Without `ape` (None) the scores and ring rows are taken to include it already.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dsv4.kernels.ref.index_keys import quantize_index_keys
from dsv4.kernels.ref.rope_norm import apply_rope, rms_normalize


class CompressIndex(NamedTuple):
    """Gather / scatter rows of one compressor step for T new tokens and S source slots.

    S = 2m (overlap) or m. Built by `engine/metadata.py` (`CompressPlan.index`). Slot s of token t
    (position p) is source position p - S + 1 + s. A `write_slot` equal to the last row of `out`, or
    a `ring_write` equal to the last ring row, is the trash row: the token completes no window /
    keeps no ring row (nobody reads a trash row).
    """

    # [T, S] int64 row of this step's kv/score holding the source (if from_new)
    src_new: torch.Tensor
    src_ring: torch.Tensor      # [T, S] int64 ring row holding the source (if valid, not from_new)
    from_new: torch.Tensor      # [T, S] bool: the source was projected in this step
    src_valid: torch.Tensor     # [T, S] bool: source position >= 0
    write_slot: torch.Tensor    # [T] int64 entry row of `out` written by the token (trash: none)
    ring_write: torch.Tensor    # [T] int64 ring row keeping the token's kv/score (trash: none)
    # Promise that no ring row read by this step is also written by it (true for decode:
    # engine/metadata.py); lets a fused kernel write the ring in the same launch. The reference
    # does not need it.
    ring_reads_disjoint: bool = False


def project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The compressor projections (the `project` op): x [T, k] @ w [n, k]^T -> [T, n] fp32, each
    operand taken as its fp32 values (x of any float dtype; w fp32, or bf16 as a
    checkpoint-format model holds it)."""
    return torch.nn.functional.linear(x.float(), w.float())


def sequence_index(batch: int, seq_len: int, ratio: int, overlap: bool,
                   device: torch.device) -> tuple[CompressIndex, torch.Tensor]:
    """The `CompressIndex` of a [batch, seq_len] full-sequence forward run as one serving step
    (every source is new, no ring: a 1-row trash ring), and each token's entry position [T].

    Token t = b * seq_len + p writes entry b * E + p // ratio (E = seq_len // ratio) when it
    completes a window; `out` then needs batch * E + 1 rows (the last: the trash row)."""
    S = 2 * ratio if overlap else ratio
    pos = torch.arange(seq_len, device=device).repeat(batch)                        # [T]
    row = torch.arange(batch * seq_len, device=device)
    src = pos[:, None] - S + 1 + torch.arange(S, device=device)                     # [T, S]
    valid = src >= 0
    E = seq_len // ratio
    emits = (pos + 1) % ratio == 0
    write = torch.where(emits, (row // seq_len) * E + pos // ratio, batch * E)
    zeros = torch.zeros_like(pos)
    index = CompressIndex(src_new=(row[:, None] - (pos[:, None] - src)).clamp(min=0),
                          src_ring=torch.zeros_like(src), from_new=valid, src_valid=valid,
                          write_slot=write, ring_write=zeros)
    return index, (pos - ratio + 1).clamp(min=0)


def compress_windows(kv: torch.Tensor, score: torch.Tensor, ratio: int,
                     overlap: bool) -> torch.Tensor:
    """Pool complete windows. kv, score: [B, S, c*Dc] fp32 (score already includes `ape`).

    Returns [B, S // ratio, Dc] fp32; the incomplete tail window (S % ratio tokens) is dropped.
    """
    B, S, width = kv.shape
    E = S // ratio
    kv = kv[:, :E * ratio].reshape(B, E, ratio, width)
    score = score[:, :E * ratio].reshape(B, E, ratio, width)
    if overlap:
        kv, score = _overlap_slots(kv, score)
    weights = torch.softmax(score, dim=2)
    return (kv * weights).sum(dim=2)


def _overlap_slots(kv: torch.Tensor, score: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # [B, E, m, 2*Dc] -> [B, E, 2m, Dc]: slots [0, m) = Ca of the previous window, [m, 2m) = Cb of
    # this one
    dc = kv.shape[-1] // 2
    prev_kv = torch.cat((torch.zeros_like(kv[:, :1, :, :dc]), kv[:, :-1, :, :dc]), dim=1)
    prev_score = torch.cat((torch.full_like(score[:, :1, :, :dc], float("-inf")),
                            score[:, :-1, :, :dc]), dim=1)
    return (torch.cat((prev_kv, kv[..., dc:]), dim=2),
            torch.cat((prev_score, score[..., dc:]), dim=2))


def pool_sources(kv: torch.Tensor, score: torch.Tensor, valid: torch.Tensor, ratio: int,
                 overlap: bool) -> torch.Tensor:
    """Pool per-token source slots (serving path).

    kv, score: [T, S, c*Dc] fp32 for source positions p-S+1 .. p (S = 2*ratio with overlap, else
    ratio); valid: [T, S]. Returns [T, Dc] fp32.

    With overlap, slots [0, ratio) contribute their Ca half and slots [ratio, 2*ratio) their Cb
    half.
    """
    if overlap:
        dc = kv.shape[-1] // 2
        kv = torch.cat((kv[:, :ratio, :dc], kv[:, ratio:, dc:]), dim=1)
        score = torch.cat((score[:, :ratio, :dc], score[:, ratio:, dc:]), dim=1)
    score = score.masked_fill(~valid[..., None], float("-inf"))
    kv = kv.masked_fill(~valid[..., None], 0.0)
    return (kv * torch.softmax(score, dim=1)).sum(dim=1)


def compress_geometry(kv: torch.Tensor, index: CompressIndex,
                      out: torch.Tensor) -> tuple[int, bool]:
    """`(ratio, overlap)` implied by the shapes.

    overlap iff kv's width is 2 * Dc; S = 2 * ratio then, else ratio.
    """
    overlap = kv.shape[1] == 2 * out.shape[1]
    S = index.src_new.shape[1]
    return (S // 2 if overlap else S), overlap


def compress_cached(kv: torch.Tensor, score: torch.Tensor, ring_kv: torch.Tensor,
                    ring_score: torch.Tensor, index: CompressIndex, norm_weight: torch.Tensor,
                    eps: float, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, *,
                    ape: torch.Tensor | None = None, out_scale: torch.Tensor | None = None,
                    key_dtype: torch.dtype = torch.float32) -> None:
    """One serving step of a compressor, in place (the steps of spec §6.5 after the projections).

    kv, score: [T, c*Dc] fp32 projections of this step's tokens; c = 2 with overlap. ring_kv,
    ring_score: [N_ring, c*Dc] fp32 ring state (RingState), read for older sources, then updated.
    norm_weight: [Dc] (compressor.norm); cos, sin: [T, rd/2] fp32 RoPE of each token's entry
    position. out: [N_out, Dc] entry pool (bf16 / fp32), row `write_slot[t]` receives token t's
    entry. ape: [ratio, c*Dc] fp32, added to the scores per source slot (module docstring; the
    scores and the rings stay raw); None: the scores and rings include it already. out_scale:
    [N_out] fp32 with `out` float8_e4m3fn (an FP8 indexer-key pool): each entry is rounded to
    `key_dtype` (the dtype a float pool would hold), then quantised (`ref/index_keys.py`), its
    codes to `out` and its scale to `out_scale` at the same row.
    """
    ratio, overlap = compress_geometry(kv, index, out)
    new, ring = index.from_new[..., None], index.src_ring
    src_kv = torch.where(new, kv[index.src_new], ring_kv[ring])                   # [T, S, c*Dc]
    src_score = torch.where(new, score[index.src_new], ring_score[ring])
    if ape is not None:                          # slot s: ape row s % ratio
        src_score = src_score + ape.repeat(index.src_new.shape[1] // ratio, 1)
    pooled = pool_sources(src_kv, src_score, index.src_valid, ratio, overlap)     # [T, Dc] fp32
    normed = norm_weight * rms_normalize(pooled, eps)
    entries = apply_rope(normed, cos, sin)
    if out_scale is None:
        out[index.write_slot] = entries.to(out.dtype)
    else:
        codes, scales = quantize_index_keys(entries.to(key_dtype))
        out[index.write_slot] = codes
        out_scale[index.write_slot] = scales
    ring_kv[index.ring_write] = kv
    ring_score[index.ring_write] = score


class CompressTarget(NamedTuple):
    """One compressor's tensors in a serving step: `compress_cached`'s unshared arguments."""

    kv: torch.Tensor            # [T, c*Dc] fp32 projections
    score: torch.Tensor         # [T, c*Dc] fp32
    ring_kv: torch.Tensor       # [N_ring, c*Dc] fp32 ring state
    ring_score: torch.Tensor    # [N_ring, c*Dc] fp32
    norm_weight: torch.Tensor   # [Dc]
    out: torch.Tensor           # [N_out, Dc] entry pool
    # [ratio, c*Dc] fp32, added per source slot (raw scores and rings); None: included already
    ape: torch.Tensor | None = None
    # [N_out] fp32: `out` holds FP8 codes, these their scales (`compress_cached`'s out_scale)
    out_scale: torch.Tensor | None = None
    key_dtype: torch.dtype = torch.float32   # with out_scale: entries rounded to it first


def compress_cached_pair(first: CompressTarget, second: CompressTarget, index: CompressIndex,
                         eps: float, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Two compressors that share one step's `index`, entry positions (cos, sin) and eps.

    A CSA layer's attention compressor and its indexer's: same ratio and overlap, rings and entry
    pools of equal row counts (one plan addresses both). In place, each exactly as
    `compress_cached` (the `compress_pair` op; its fast form fuses both into one launch:
    `kernels/triton/compressor_pair.py`).
    """
    for c in (first, second):
        compress_cached(c.kv, c.score, c.ring_kv, c.ring_score, index, c.norm_weight, eps, cos, sin,
                        c.out, ape=c.ape, out_scale=c.out_scale, key_dtype=c.key_dtype)
