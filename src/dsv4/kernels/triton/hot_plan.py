"""HiSparse's plan in one launch per C4 layer (`triton_hot_plan`): the fast form of
`kernels/ref/hot_plan.py::hot_plan_ref` (same signature, same results) for calls where each
request has at most one row and a row's picks are distinct (a plain decode step: the indexer's
top-k of one query; the new entries of one token). The reference runs ~50 small torch ops per
call, which inside a decode graph cost more than the copies they plan.

Kernel design: grid (T,), one program per row t = one request slot s (pad-slot rows write -1 and
touch no map). With k picks (BLOCK_K >= k) and E hot slots (BLOCK_E >= E) held in registers:
    1. hits: j = e2s[s, pick]; stamp[s, j] = now where hit            (barrier)
    2. victims: the E stamps of s as keys (stamp + 1) * BLOCK_E + slot, sorted (`tl.sort`,
       bitonic): ascending (stamp, slot), the reference's stable sort; the slot order goes to a
       [T, BLOCK_E] scratch row so miss q can read victim q               (barrier)
       With one pick per row (k = 1: a decode step's new entries, `write_entries(hot=True)`)
       only victim 0 can be taken: the smallest key (a min), no sort and no scratch
    3. misses: the non-hit picks ranked in pick order (a prefix sum: a row's picks are
       distinct, so this is the reference's order of first appearance); miss q < E - (slots
       stamped now) takes victim q: its old entry unmapped, the miss mapped, stamped, and
       (host row, hot row) stored at src / dst [t * k + c], c its column (-1 elsewhere) (barrier)
    4. rows: e2s read again for every pick: s * E + j, or -1
    5. (WRITE, `triton_hot_write`: a decode step's new entries, one per row) the row's value is
       stored into the host mirror row of its entry (pinned memory through UVA) and, if the
       entry is now hot, into its hot row: the plan and the write path's stores in one launch
Counters (strict) by atomic adds. The clock is incremented by one torch op before the launch (the
programs share `now`). Fixed grid for a fixed T, no host syncs: CUDA-graph safe.

Contract not checked (a check would read device memory on the host): slot_ids below R are
distinct, the non-negative picks of a row are distinct and < M, stamps stay below 2^40 (the clock
counts calls: two per C4 layer and step). Where a caller cannot promise distinct slots (a verify
pass, a prefill chunk) it runs the reference (`HotSet.select(..., one_row=False)`).

Test: tests/kernels/test_hot_plan.py. Benchmark: benchmarks/kernels/bench_hot_plan.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels.triton.hisparse import INDEX_DTYPES, check_devices, check_rows
from dsv4.kernels.triton.launch import pow2

MAX_E = 16384   # hot slots per request one program sorts in registers


@triton.jit
def _hot_plan_kernel(e2s_ptr, s2e_ptr, stamp_ptr, clock_ptr,  # type: ignore[no-untyped-def]
                     slot_ptr, pick_ptr, pt_ptr, rows_ptr, src_ptr, dst_ptr, scratch_ptr, cnt_ptr,
                     val_ptr, host_ptr, dev_ptr,
                     k, E, M, R, pe, D, stride_e2s, stride_s2e, stride_stamp, stride_pick,
                     stride_pt, stride_val, stride_host, stride_dev,
                     BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, STRICT: tl.constexpr,
                     ONE_PICK: tl.constexpr, WRITE: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    s = tl.load(slot_ptr + t).to(tl.int64)
    active = (s + tl.zeros([BLOCK_K], tl.int64)) < R    # per pick: the interpreter masks blocks
    s = tl.minimum(s, R)                        # the pad slot's row: all -1, never written
    e2s, s2e = e2s_ptr + s * stride_e2s, s2e_ptr + s * stride_s2e
    stamp = stamp_ptr + s * stride_stamp
    now = tl.load(clock_ptr)
    in_k = offs_k < k
    p = tl.load(pick_ptr + t * stride_pick + offs_k, mask=in_k, other=-1).to(tl.int64)
    valid = in_k & (p >= 0) & active
    col = tl.where(valid, p, M)
    j = tl.load(e2s + col).to(tl.int64)                                   # 1. hits
    hit = valid & (j >= 0)
    tl.store(stamp + j, now + tl.zeros_like(j), mask=hit)
    tl.debug_barrier()
    offs_e = tl.arange(0, BLOCK_E)                                        # 2. victims
    in_e = offs_e < E
    st = tl.load(stamp + offs_e, mask=in_e, other=0)
    big = tl.full([BLOCK_E], 0x7FFFFFFFFFFFFFFF, tl.int64)
    keys = tl.where(in_e, (st + 1) * BLOCK_E + offs_e, big)
    free = E - tl.sum((in_e & (st == now)).to(tl.int64), axis=0)
    is_miss = valid & (j < 0)                                             # 3. misses
    rank = tl.cumsum(is_miss.to(tl.int64), axis=0) - 1
    fits = is_miss & (rank < free)
    if ONE_PICK:
        # one pick (a new entry's write): its miss, if any, takes the first victim, the
        # smallest key: a min instead of a sort and the scratch round trip
        v = tl.min(keys, axis=0) % BLOCK_E + tl.zeros([BLOCK_K], tl.int64)
    else:
        tl.store(scratch_ptr + t * BLOCK_E + offs_e, tl.sort(keys) % BLOCK_E)
        tl.debug_barrier()
        v = tl.load(scratch_ptr + t * BLOCK_E + rank, mask=fits, other=0)
    old = tl.load(s2e + v, mask=fits, other=-1).to(tl.int64)
    tl.store(e2s + old, tl.full([BLOCK_K], -1, tl.int32), mask=fits & (old >= 0))
    tl.store(e2s + p, v.to(tl.int32), mask=fits)
    tl.store(s2e + v, p.to(tl.int32), mask=fits)
    tl.store(stamp + v, now + tl.zeros_like(v), mask=fits)
    safe = tl.where(fits, p, 0)
    host = tl.load(pt_ptr + s * stride_pt + safe // pe, mask=fits, other=0) * pe + safe % pe
    tl.store(src_ptr + t * k + offs_k, tl.where(fits, host, -1), mask=in_k)
    tl.store(dst_ptr + t * k + offs_k, tl.where(fits, s * E + v, -1), mask=in_k)
    if STRICT:
        placed = tl.sum(fits.to(tl.int64), axis=0)
        tl.atomic_add(cnt_ptr, tl.sum(valid.to(tl.int64), axis=0))
        tl.atomic_add(cnt_ptr + 1, placed)
        tl.atomic_add(cnt_ptr + 2, tl.sum(is_miss.to(tl.int64), axis=0) - placed)
    tl.debug_barrier()
    j = tl.load(e2s + col).to(tl.int64)                                   # 4. rows
    row = tl.where(valid & (j >= 0), s * E + j, -1)
    tl.store(rows_ptr + t * k + offs_k, row, mask=in_k)
    if WRITE:   # 5. the new entry's value (k == 1): its host mirror row, and its hot row if any
        first = offs_k == 0
        safe_p = tl.where(valid, p, 0)
        host_all = tl.load(pt_ptr + s * stride_pt + safe_p // pe, mask=valid, other=0) * pe \
            + safe_p % pe
        _write_value(val_ptr + t * stride_val, host_ptr, dev_ptr,
                     tl.sum(tl.where(first & valid, host_all, 0), axis=0),
                     tl.sum(tl.where(first, valid.to(tl.int64), 0), axis=0),
                     tl.sum(tl.where(first, row, 0), axis=0), D, stride_host, stride_dev, BLOCK_D)


@triton.jit
def _write_value(val, host_ptr, dev_ptr, host_row, has_host,  # type: ignore[no-untyped-def]
                 dev_row, D, stride_host, stride_dev, BLOCK_D: tl.constexpr):
    """values row `val` [D] -> host_ptr row host_row (if has_host) and dev_ptr row dev_row (if
    >= 0), cast to each pool's dtype; masks as [BLOCK_D] tensors (the interpreter refuses
    scalar masks)."""
    offs = tl.arange(0, BLOCK_D)
    zero = tl.zeros([BLOCK_D], tl.int64)
    to_host = (zero + has_host) > 0
    to_dev = (zero + dev_row) >= 0
    host = host_ptr + host_row * stride_host
    dev = dev_ptr + tl.maximum(dev_row, 0) * stride_dev
    for d0 in range(0, D, BLOCK_D):
        in_d = d0 + offs < D
        v = tl.load(val + d0 + offs, mask=in_d)
        tl.store(host + d0 + offs, v.to(host_ptr.dtype.element_ty), mask=in_d & to_host)
        tl.store(dev + d0 + offs, v.to(dev_ptr.dtype.element_ty), mask=in_d & to_dev)


def _check(e2s: torch.Tensor, s2e: torch.Tensor, stamp: torch.Tensor, clock: torch.Tensor,
           slot_ids: torch.Tensor, picks: torch.Tensor, page_table: torch.Tensor,
           counters: torch.Tensor) -> None:
    named = {"e2s": e2s, "s2e": s2e, "stamp": stamp, "clock": clock, "slot_ids": slot_ids,
             "picks": picks, "page_table": page_table, "counters": counters}
    if len({t.device for t in named.values()}) != 1:
        raise ValueError("hot_plan tensors must be on one device; got "
                         + ", ".join(f"{k} on {t.device}" for k, t in named.items()))
    R = e2s.shape[0] - 1
    dtypes = {"e2s": torch.int32, "s2e": torch.int32, "stamp": torch.int64,
              "clock": torch.int64, "page_table": torch.int64, "counters": torch.int64}
    for name, dtype in dtypes.items():
        if named[name].dtype != dtype:
            raise ValueError(f"hot_plan {name} must be {dtype}; got {named[name].dtype}")
    if (e2s.dim() != 2 or s2e.dim() != 2 or stamp.shape != s2e.shape or s2e.shape[0] != R + 1
            or page_table.shape[0] != R + 1 or clock.dim() != 0 or counters.shape != (3,)):
        raise ValueError(f"hot_plan needs e2s [R + 1, M + 1], s2e and stamp [R + 1, E + 1], "
                         f"page_table [R + 1, P], clock [], counters [3]; got e2s "
                         f"{list(e2s.shape)}, s2e {list(s2e.shape)}, stamp {list(stamp.shape)}, "
                         f"page_table {list(page_table.shape)}, clock {list(clock.shape)}, "
                         f"counters {list(counters.shape)}")
    if (picks.dim() != 2 or slot_ids.shape != (picks.shape[0],)
            or picks.dtype not in INDEX_DTYPES or slot_ids.dtype not in INDEX_DTYPES):
        raise ValueError(f"hot_plan needs picks [T, k] and slot_ids [T] of int32 / int64; got "
                         f"{list(picks.shape)} {picks.dtype}, {list(slot_ids.shape)} "
                         f"{slot_ids.dtype}")
    for name in ("e2s", "s2e", "stamp", "page_table"):
        if named[name].stride(1) != 1:
            raise ValueError(f"hot_plan {name} must have unit stride in its last dim")
    if s2e.shape[1] - 1 > MAX_E:
        raise ValueError(f"hot_plan E={s2e.shape[1] - 1} hot slots per request is invalid; "
                         f"allowed: <= {MAX_E}")


def triton_hot_plan(e2s: torch.Tensor, s2e: torch.Tensor, stamp: torch.Tensor,
                    clock: torch.Tensor, slot_ids: torch.Tensor, picks: torch.Tensor,
                    page_table: torch.Tensor, page_entries: int, counters: torch.Tensor,
                    strict: bool, num_warps: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `hot_plan_ref` for rows of distinct request slots with distinct picks
    (module docstring). Shapes and dtypes as there (e2s / s2e int32, stamp / clock / page_table /
    counters int64), all on one device; ValueError otherwise. Returns (rows [T, k], src [T * k],
    dst [T * k]) int64. Graph-capture safe; no host sync. `num_warps`: the program's warps
    (default: `plan_warps`; the benchmark's `--sweep` times the others)."""
    _check(e2s, s2e, stamp, clock, slot_ids, picks, page_table, counters)
    T, k = picks.shape
    E, M, R = s2e.shape[1] - 1, e2s.shape[1] - 1, e2s.shape[0] - 1
    dev = picks.device
    rows = torch.empty(T, k, dtype=torch.int64, device=dev)
    src = torch.empty(T * k, dtype=torch.int64, device=dev)
    dst = torch.empty(T * k, dtype=torch.int64, device=dev)
    clock.add_(1)
    if T == 0 or k == 0:
        return rows, src, dst
    block_k = pow2("block_k", max(16, triton.next_power_of_2(k)), 1)
    block_e = _block_e(E)
    scratch = torch.empty(T, block_e, dtype=torch.int64, device=dev)
    picks = picks if picks.stride(1) == 1 else picks.contiguous()
    _hot_plan_kernel[(T,)](
        e2s, s2e, stamp, clock, slot_ids.contiguous(), picks, page_table, rows, src, dst,
        scratch, counters, rows, rows, rows, k, E, M, R, page_entries, 0, e2s.stride(0),
        s2e.stride(0), stamp.stride(0), picks.stride(0), page_table.stride(0), 0, 0, 0,
        BLOCK_K=block_k, BLOCK_E=block_e, STRICT=strict, ONE_PICK=k == 1, WRITE=False,
        BLOCK_D=16, num_warps=num_warps or plan_warps(E, k == 1))
    return rows, src, dst


def triton_hot_write(e2s: torch.Tensor, s2e: torch.Tensor, stamp: torch.Tensor,
                     clock: torch.Tensor, slot_ids: torch.Tensor, entries: torch.Tensor,
                     page_table: torch.Tensor, page_entries: int, values: torch.Tensor,
                     host_pool: torch.Tensor, device_pool: torch.Tensor,
                     num_warps: int | None = None) -> None:
    """Same contract as `hot_write_ref` for rows of distinct request slots (but the pad slot):
    the one-pick plan of `triton_hot_plan` (strict off) and the values' stores in one launch,
    instead of the plan, the host rows' lookup, the mirror write and the hot copy. entries [T]
    int32 / int64; values [T, D]; host_pool [N_host, D] (pinned CPU memory beside CUDA values,
    written in place through UVA, or on their device); device_pool [N_dev, D]; pools of
    `hisparse.py`'s POOL_DTYPES with unit stride in D. ValueError otherwise. Graph-capture safe;
    no host sync."""
    T = entries.shape[0]
    # NOTE: no counters here (strict off); the clock's broadcast view passes their check
    _check(e2s, s2e, stamp, clock, slot_ids, entries.view(T, 1), page_table, clock.expand(3))
    check_devices(host_pool, {"values": values, "device_pool": device_pool, "e2s": e2s},
                   "host_pool")
    check_rows(("values", "[T, D]", values), ("host_pool", "[N_host, D]", host_pool))
    check_rows(("values", "[T, D]", values), ("device_pool", "[N_dev, D]", device_pool))
    if entries.dim() != 1 or values.shape[0] != T:
        raise ValueError(f"hot_write needs entries [T] and values [T, D]; got "
                         f"{list(entries.shape)} and {list(values.shape)}")
    E, M, R = s2e.shape[1] - 1, e2s.shape[1] - 1, e2s.shape[0] - 1
    clock.add_(1)
    D = values.shape[1]
    if T == 0 or D == 0:
        return
    dev = e2s.device
    rows = torch.empty(T, 1, dtype=torch.int64, device=dev)
    unused = torch.empty(T, dtype=torch.int64, device=dev)     # src / dst: nothing swaps in
    block_e = _block_e(E)
    _hot_plan_kernel[(T,)](
        e2s, s2e, stamp, clock, slot_ids.contiguous(), entries.contiguous().view(T, 1),
        page_table, rows, unused, unused, unused, unused, values, host_pool, device_pool,
        1, E, M, R, page_entries, D, e2s.stride(0), s2e.stride(0), stamp.stride(0), 1,
        page_table.stride(0), values.stride(0), host_pool.stride(0), device_pool.stride(0),
        BLOCK_K=16, BLOCK_E=block_e, STRICT=False, ONE_PICK=True, WRITE=True,
        BLOCK_D=min(1024, triton.next_power_of_2(D)), num_warps=num_warps or plan_warps(E, True))


def _block_e(E: int) -> int:
    return max(16, triton.next_power_of_2(E))


def plan_warps(E: int, one_pick: bool) -> int:
    """Warps of one plan program for E hot slots. The bitonic sort of the BLOCK_E LRU keys is
    the program's latency and shortens with more threads, up to 16 warps at E = 1024; one pick
    per row sorts nothing and gains little past 8 (H200 timings: `bench_hot_plan.py --sweep`,
    benchmarks/results/hisparse_h200_202612.md)."""
    block_e = _block_e(E)
    if one_pick:
        return 8 if block_e >= 1024 else 4
    return max(4, min(16, block_e // 64))
