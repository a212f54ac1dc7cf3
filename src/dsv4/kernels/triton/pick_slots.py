"""The indexer's picks as entry ids and pool slots in one launch: `triton_pick_slots`, the fast
form of `kernels/ref/indexer.py::pick_slots` (same signature, bit-equal int64 outputs).

After the lightning indexer's top-k, a CSA layer needs each pick as an entry id (masked where the
candidate is not visible; what routing capture records) and as the pool slot sparse attention
reads. In torch that is a gather, masks and wheres: about ten small launches per CSA layer per
step. Here one program per BLOCK_T rows loads each row's picks, gathers their candidate slots
(a pick of -1 reads nothing) and writes ids = pick where its slot is >= 0 (else -1) and slots =
that slot. T, K and the strides change from step to step and are not specialised on. No host
sync: CUDA-graph capturable.

Test: tests/kernels/test_pick_slots.py (interpreter parity; its GPU part on CUDA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels.triton.pdl import pdl_args
from dsv4.kernels.triton.pdl_enter import pdl_enter

BLOCK_ELEMS = 2048      # picks per program (rows x the picks' width, rounded to powers of two)


@triton.jit(do_not_specialize=["T", "K", "stride_p", "stride_c"])
def _pick_slots_kernel(picks_ptr, cand_ptr, ids_ptr, slots_ptr,  # type: ignore[no-untyped-def]
                       T, K, stride_p, stride_c,
                       BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_K)
    live = (rows < T)[:, None] & (cols < K)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    pick = tl.load(picks_ptr + r64 * stride_p + cols[None, :], mask=live, other=-1)
    slot = tl.load(cand_ptr + r64 * stride_c + tl.maximum(pick, 0), mask=live & (pick >= 0),
                   other=-1)
    out = r64 * K + cols[None, :]
    tl.store(ids_ptr + out, tl.where(slot >= 0, pick, -1), mask=live)
    tl.store(slots_ptr + out, tl.where(slot >= 0, slot, -1), mask=live)


def triton_pick_slots(picks: torch.Tensor,
                      candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `pick_slots`: picks [T, K], candidates [T, V] (V >= 1), both int64 with
    unit column stride, on one device -> (ids, slots) [T, K] int64, contiguous."""
    if (picks.dim() != 2 or candidates.dim() != 2 or picks.shape[0] != candidates.shape[0]
            or candidates.shape[1] < 1):
        raise ValueError(f"picks [T, K] and candidates [T, V >= 1] expected; got "
                         f"{tuple(picks.shape)}, {tuple(candidates.shape)}")
    if picks.dtype != torch.int64 or candidates.dtype != torch.int64:
        raise ValueError(f"picks and candidates must be int64; got {picks.dtype}, "
                         f"{candidates.dtype}")
    if picks.device != candidates.device:
        raise ValueError(f"picks on {picks.device}, candidates on {candidates.device}: "
                         "expected one device")
    if picks.stride(1) != 1 and picks.shape[1] > 1 or candidates.stride(1) != 1:
        raise ValueError("picks and candidates need unit column stride")
    T, K = picks.shape
    ids = torch.empty(T, K, dtype=torch.int64, device=picks.device)
    slots = torch.empty_like(ids)
    if T == 0 or K == 0:
        return ids, slots
    block_k = triton.next_power_of_2(K)
    block_t = max(1, min(triton.next_power_of_2(T), BLOCK_ELEMS // block_k))
    _pick_slots_kernel[(triton.cdiv(T, block_t),)](
        picks, candidates, ids, slots, T, K, picks.stride(0), candidates.stride(0),
        BLOCK_T=block_t, BLOCK_K=block_k, **pdl_args(picks.device))
    return ids, slots
