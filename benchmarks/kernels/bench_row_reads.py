"""Experiment: HBM read rate of the Flash Compressor's ring gathers, by layout (is the C4
indexer's gap the layout?).

A C4 (overlap) compressor's decode program reads, from its request's 8 consecutive ring rows of
width 2 Dc (fp32, [Ca | Cb]), the Ca half of rows 0-3 and the Cb half of rows 4-7: 8 pieces of
Dc * 4 bytes, every other piece of an 8-row block (512 B pieces for the indexer, Dc = 128; 2 KB for
attention, Dc = 512). The H200 sweep puts the indexer compressor well below the attention one as a
fraction of the copy rate (compressor_h200_202611.md). This times the reads alone, one program per
request group, with the same [8, Dc] register tile:

    halves   the current layout: rows [8, 2 Dc], Ca of rows 0-3 and Cb of rows 4-7
    planar   the same bytes from a [2, rows, Dc] layout (plane 0 = Ca, plane 1 = Cb): two
             contiguous runs of 4 Dc
    full     whole rows (twice the bytes): if it takes as long as `halves`, half-row reads cost a
             whole row

Groups are a random permutation over a pool of >= 1 GB (no L2 reuse); every program sums its tile
per column and stores Dc floats. GB/s counts the bytes the pattern needs (full: all of them),
against the 4.275 TB/s copy rate. CUDA-graph replay, median. Table, then one JSON line.

    PYTHONPATH=src python3 benchmarks/kernels/bench_row_reads.py
"""

from __future__ import annotations

import json

import torch
import triton
import triton.language as tl
from bench_common import HBM_BYTES_PER_S, time_graph_us

GROUPS = 4096                    # programs (a decode batch of 4096 requests)
POOL_BYTES = 1 << 30


@triton.jit
def _read_kernel(pool_ptr, group_ptr, out_ptr, plane_stride, DC: tl.constexpr, MODE: tl.constexpr):
    g = tl.load(group_ptr + tl.program_id(0)).to(tl.int64)
    s = tl.arange(0, 8)
    d = tl.arange(0, DC)
    row = g * 8 + s
    if MODE == 0:       # halves: row stride 2 Dc, column offset Dc for rows 4-7
        ptr = pool_ptr + row[:, None] * (2 * DC) + ((s // 4) * DC)[:, None] + d[None, :]
    elif MODE == 1:     # planar: plane s // 4, row stride Dc
        ptr = (pool_ptr + (s // 4).to(tl.int64)[:, None] * plane_stride + row[:, None] * DC
               + d[None, :])
    else:               # full rows: both halves as two [8, Dc] tiles
        ptr = pool_ptr + row[:, None] * (2 * DC) + d[None, :]
    acc = tl.sum(tl.load(ptr), 0)
    if MODE == 2:
        acc += tl.sum(tl.load(ptr + DC), 0)
    tl.store(out_ptr + tl.program_id(0) * DC + d, acc)


def run(dc: int, mode: int, warps: int) -> dict[str, float]:
    rows = POOL_BYTES // (2 * dc * 4)
    pool = torch.randn(rows * 2 * dc, device="cuda")
    out = torch.empty(GROUPS, dc, device="cuda")
    sets = [(torch.randperm(rows // 8, device="cuda")[:GROUPS].contiguous(),) for _ in range(16)]

    def fn(groups: torch.Tensor) -> None:
        _read_kernel[(GROUPS,)](pool, groups, out, rows * dc, DC=dc, MODE=mode, num_warps=warps)

    # parity: the planar read of a pool is the halves read of the same pool reinterpreted, so check
    # sums only
    fn(*sets[0])
    view = pool.view(rows, 2 * dc) if mode != 1 else pool.view(2, rows, dc)
    g = sets[0][0][:4].long()
    for j, grp in enumerate(g.tolist()):
        r = slice(grp * 8, grp * 8 + 8)
        if mode == 0:
            want = view[r][:4, :dc].sum(0) + view[r][4:, dc:].sum(0)
        elif mode == 1:
            want = view[0, r][:4].sum(0) + view[1, r][4:].sum(0)
        else:
            want = view[r].sum(0).view(2, dc).sum(0)
        assert torch.allclose(out[j], want, rtol=1e-4, atol=1e-3), f"mode {mode}: wrong sums"
    us = time_graph_us(fn, sets, 200, 10)
    need = GROUPS * 8 * dc * 4 * (2 if mode == 2 else 1)
    return {"us": us, "bytes": need, "gbps": need / us / 1e3,
            "pct": need / (us * 1e-6) / HBM_BYTES_PER_S * 100}


def main() -> None:
    results = []
    print(f"{'Dc':>5} {'layout':>8} {'warps':>5} {'us':>8} {'MB':>8} {'GB/s':>7} {'%copy':>6}")
    for dc in (128, 512):
        for mode, name in enumerate(("halves", "planar", "full")):
            for warps in (2, 4):
                r = run(dc, mode, warps)
                results.append({"Dc": dc, "layout": name, "warps": warps, **r})
                print(f"{dc:>5} {name:>8} {warps:>5} {r['us']:>8.2f} {r['bytes'] / 1e6:>8.1f} "
                      f"{r['gbps']:>7.0f} {r['pct']:>6.1f}", flush=True)
    print(json.dumps({"bench": "row_reads", "device": torch.cuda.get_device_name(),
                      "torch": torch.__version__, "triton": triton.__version__, "groups": GROUPS,
                      "results": results}))


if __name__ == "__main__":
    main()
