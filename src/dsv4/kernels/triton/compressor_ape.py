"""The gate scores' absolute position embedding as the Flash Compressor's kernels add it
(`compressor.py`, `compressor_group.py`, `compressor_pair.py`): per source slot, as they pool.

The serving path hands the compress ops raw gate scores and the rings hold raw scores. Only a
token that completes a window pools, and its slot s holds a position of residue s % ratio
(`kernels/ref/compressor.py`), so the slot's ape row is s % ratio: an address of constants, whose
load waits on no other load. `z + ape` is then the fp32 add the full-sequence path makes
(`score + ape[position % ratio]`): the same bits, without the `add_ape` launch a step used to
make per compressor.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def slot_ape(ape_ptr, stride_ape, offs_s, cols, take,  # type: ignore[no-untyped-def]
             RATIO: tl.constexpr):
    """ape [ratio, c*Dc] at rows offs_s % RATIO ([BLOCK_S]) and columns `cols` ([BLOCK_S,
    BLOCK_D]: a slot's columns, the Ca or Cb half with overlap): [BLOCK_S, BLOCK_D] fp32, 0 where
    not `take`."""
    return tl.load(ape_ptr + (offs_s % RATIO)[:, None] * stride_ape + cols, mask=take, other=0.0)
