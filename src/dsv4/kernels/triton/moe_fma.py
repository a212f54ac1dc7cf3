"""The routed experts' "fma" inner loop (kernels/triton/moe.py): few rows per expert, no tl.dot.

At decode the N*k rows spread over the experts with ~1 row each, so a [16, BLOCK_N] MMA tile is
15/16 padding and the decoded weight tile has to reach the MMA operand layout through shared
memory. Here the weights stay in the layout they are loaded in and meet the activations on the CUDA
cores; `plan_moe` picks this loop while nk <= `FMA_MAX_MEAN_ROWS` * E (or `variant="fma"`).

One program: up to BLOCK_M (1, 2, 4) sorted rows of one expert (`moe_tile_map.py`; at BLOCK_M 1
no tile map: program t is (token, k) slot t, its expert read from the routing indices), BLOCK_N
output rows of W. Each K step loads W's words as one row-contiguous [BLOCK_N, 4C] tile viewed as
[BLOCK_N, C, 4] (C = BLOCK_K / CHUNK chunks of CHUNK k; 16 bytes per (n, c), one vector load per
thread: FP4 one 32-wide scale group, FP8 16 codes; a warp's lanes run along a row's chunks, so
each load reads whole 128-byte lines), decodes them in registers into CHUNK / 4 fp32 tensors
W_q[n, c, j] of the same layout, and for each row (its own [BLOCK_N, C] accumulator; the decode
is shared by the rows) loads its activations A_q[c, j] once per chunk (shared by the thread's
output rows and, in gate/up, by both matrices; in the weights' layout, nothing through shared
memory), then s = W_0 A_0 + W_1 A_1 + ... (an FFMA chain in q order per (n, c, j)), part = the
in-thread sum of s over j, acc += part * factor. After the K loop one `tl.sum` over c
(in-thread, then lanes) gives the row's BLOCK_N outputs. The order of a row's sum is fixed by
BLOCK_K and the layout (BLOCK_N, num_warps) and never involves the other rows of its tile or
batch; the plan's fma tiles do not depend on N, so a token's bits do not either. PREFETCH: each
K step issues the next step's word and scale loads before it decodes its own (two steps of
words in flight per thread; the sums are unchanged).
The activations are read in a per-block reordered copy (`fma_activations`; the gate/up epilogue
writes h the same way) where A_q's four j are contiguous and a q's chunks sit side by side.

FP4 / FP8 decode and the activations' pre-scale: `moe_fma_words.py`. The activations enter
pre-scaled by 2^ACT_SHIFT for FP4 (an fp32 copy written once per launch: x by `fma_activations`,
h by the gate/up epilogue).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels.triton.moe_combine import down_output
from dsv4.kernels.triton.moe_fma_words import decode_words, load_words, next_k
from dsv4.kernels.triton.moe_plan import MoePlan
from dsv4.kernels.triton.moe_tile_map import TileMap, slot_or_tile
from dsv4.kernels.triton.pdl import pdl_args
from dsv4.kernels.triton.pdl_enter import pdl_enter
from dsv4.kernels.triton.swiglu import swiglu_f32

ACT_SHIFT = 62          # FP4: activations enter the K loop times 2^ACT_SHIFT (module docstring)
FP4_CHUNK = 32          # k per thread chunk: one scale group, 16 bytes
FP8_CHUNK = 16          # 16 e4m3 codes


def act_shift(fmt: int) -> int:
    """log2 of the activations' pre-scale for FMT code `fmt` (2 = fp4)."""
    return ACT_SHIFT if fmt == 2 else 0


@triton.jit
def _act(a_row, k0, C: tl.constexpr, q):  # type: ignore[no-untyped-def]
    """[1, C, 4] activations A_q[c, j] = a[k0 + CHUNK c + P j + q] of one row, which the product
    broadcasts over the weights' n (a_row: [1] pointer into the `fma_activations` order, where
    they sit at k0 + 4C q + 4c + j: a q's 16-byte pieces are contiguous over c, so a warp's lanes
    along c read whole lines). Loaded at this shape (one load per chunk and q, not one per output
    row), it takes the weights' layout (nothing through shared memory). Rows are padded to whole
    BLOCK_K blocks (zeros), so no load needs a mask."""
    offs = (k0 + 4 * C * q + tl.arange(0, C) * 4)[:, None] + tl.arange(0, 4)[None, :]
    return tl.load(a_row[:, None, None] + offs[None, :, :])


@triton.jit
def _row_step(acc, w, factor, a_row, k0,  # type: ignore[no-untyped-def]
              FMT: tl.constexpr, C: tl.constexpr):
    """acc [BLOCK_N, C] + one row's scaled chunk partials: per (n, c) the products summed in
    q order (W_0 A_0 + W_1 A_1 + ...) element-wise over j, then over j in-thread."""
    CHUNK: tl.constexpr = 32 if FMT == 2 else 16
    s = w[0] * _act(a_row, k0, C, 0)
    for q in tl.static_range(1, CHUNK // 4):
        s += w[q] * _act(a_row, k0, C, q)
    return acc + tl.sum(s, axis=2) * factor


@triton.jit
def _row_step2(acc_g, acc_u, wg, fg, wu, fu, a_row, k0,  # type: ignore[no-untyped-def]
               FMT: tl.constexpr, C: tl.constexpr):
    """`_row_step` of the gate and up matrices at once: each activation load serves both (the
    same sums, in the same order, as two `_row_step` calls)."""
    CHUNK: tl.constexpr = 32 if FMT == 2 else 16
    a = _act(a_row, k0, C, 0)
    sg = wg[0] * a
    su = wu[0] * a
    for q in tl.static_range(1, CHUNK // 4):
        a = _act(a_row, k0, C, q)
        sg += wg[q] * a
        su += wu[q] * a
    return acc_g + tl.sum(sg, axis=2) * fg, acc_u + tl.sum(su, axis=2) * fu


@triton.jit
def _step(accs, a_rows, raw, k0, FMT: tl.constexpr,  # type: ignore[no-untyped-def]
          C: tl.constexpr, SHIFT: tl.constexpr, ASM: tl.constexpr, BLOCK_M: tl.constexpr):
    """One K step of one weight matrix (`load_words`' raw data at k0) for the tile's rows: accs (4
    [BLOCK_N, C] accumulators, the first BLOCK_M live) plus each row's `_row_step`; the tile is
    decoded once for all rows."""
    w, factor = decode_words(raw, FMT, SHIFT, ASM)
    acc0, acc1, acc2, acc3 = accs
    acc0 = _row_step(acc0, w, factor, a_rows[0], k0, FMT, C)
    if BLOCK_M > 1:
        acc1 = _row_step(acc1, w, factor, a_rows[1], k0, FMT, C)
    if BLOCK_M > 2:
        acc2 = _row_step(acc2, w, factor, a_rows[2], k0, FMT, C)
        acc3 = _row_step(acc3, w, factor, a_rows[3], k0, FMT, C)
    return acc0, acc1, acc2, acc3


@triton.jit
def _step2(accs_g, accs_u, a_rows, raw_g, raw_u, k0,  # type: ignore[no-untyped-def]
           FMT: tl.constexpr, C: tl.constexpr, SHIFT: tl.constexpr, ASM: tl.constexpr,
           BLOCK_M: tl.constexpr):
    """`_step` of the gate and up matrices at once (`_row_step2`)."""
    wg, fg = decode_words(raw_g, FMT, SHIFT, ASM)
    wu, fu = decode_words(raw_u, FMT, SHIFT, ASM)
    g0, g1, g2, g3 = accs_g
    u0, u1, u2, u3 = accs_u
    g0, u0 = _row_step2(g0, u0, wg, fg, wu, fu, a_rows[0], k0, FMT, C)
    if BLOCK_M > 1:
        g1, u1 = _row_step2(g1, u1, wg, fg, wu, fu, a_rows[1], k0, FMT, C)
    if BLOCK_M > 2:
        g2, u2 = _row_step2(g2, u2, wg, fg, wu, fu, a_rows[2], k0, FMT, C)
        g3, u3 = _row_step2(g3, u3, wg, fg, wu, fu, a_rows[3], k0, FMT, C)
    return (g0, g1, g2, g3), (u0, u1, u2, u3)


@triton.jit
def _row(order_ptr, row_start, row_end, m: tl.constexpr,  # type: ignore[no-untyped-def]
         SLOTS: tl.constexpr):
    """(sorted row index, in range, the row whose data the loads read (the tile's last one past
    its end: loads need no mask), its (token, k) slot) of the tile's row m, as [1] tensors (the
    interpreter refuses scalar masks). SLOTS: no tile map, the row is the slot itself."""
    p = row_start.to(tl.int64) + m + tl.arange(0, 1)  # NOTE: int64: N*k*I can pass 2^31
    p_load = tl.minimum(p, row_end - 1)
    if SLOTS:
        slot = p_load
    else:
        slot = tl.load(order_ptr + p_load)
    return p, p < row_end, p_load, slot


@triton.jit
def _tile_rows(order_ptr, row_start, row_end, SLOTS: tl.constexpr):  # type: ignore[no-untyped-def]
    """`_row` of the tile's rows 0..3 as four 4-tuples: (p, ok, q, slot)[m] (rows past BLOCK_M go
    unused)."""
    p0, ok0, q0, s0 = _row(order_ptr, row_start, row_end, 0, SLOTS)
    p1, ok1, q1, s1 = _row(order_ptr, row_start, row_end, 1, SLOTS)
    p2, ok2, q2, s2 = _row(order_ptr, row_start, row_end, 2, SLOTS)
    p3, ok3, q3, s3 = _row(order_ptr, row_start, row_end, 3, SLOTS)
    return (p0, p1, p2, p3), (ok0, ok1, ok2, ok3), (q0, q1, q2, q3), (s0, s1, s2, s3)


@triton.jit
def _perm(n, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr):  # type: ignore[no-untyped-def]
    """Column n of h -> its place in the down launch's activation order (`fma_activations`:
    within each BLOCK_K block, k = CHUNK c + P j + q goes to 4C q + 4c + j, P = CHUNK / 4)."""
    P: tl.constexpr = CHUNK // 4
    C: tl.constexpr = BLOCK_K // CHUNK
    r = n % BLOCK_K
    return (n - r) + (r % P) * (4 * C) + (r // CHUNK) * 4 + (r % CHUNK) // P


@triton.jit
def _gate_up_fma_kernel(  # type: ignore[no-untyped-def]
    x_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, order_ptr, rw_ptr, t_start_ptr, t_end_ptr,
    t_exp_ptr, K, INTER, limit,
    stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_h,
    TOPK: tl.constexpr, FMT: tl.constexpr, SHIFT: tl.constexpr, H_DTYPE: tl.constexpr,
    ASM: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, PREFETCH: tl.constexpr,
    SLOTS: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr):
    """h rows of one tile: the gate/up epilogue; x in `fma_activations` form, h written in it too
    (fp32 of the H_DTYPE-rounded value times 2^SHIFT, columns in chunk order) for the down
    launch."""
    pdl_enter(PDL)
    CHUNK: tl.constexpr = 32 if FMT == 2 else 16
    C: tl.constexpr = BLOCK_K // CHUNK
    row_start, row_end, e = slot_or_tile(t_start_ptr, t_end_ptr, t_exp_ptr, SLOTS)
    if row_start < row_end:
        p, ok, q, slot = _tile_rows(order_ptr, row_start, row_end, SLOTS)
        a_rows = (x_ptr + (slot[0] // TOPK) * stride_x, x_ptr + (slot[1] // TOPK) * stride_x,
                  x_ptr + (slot[2] // TOPK) * stride_x, x_ptr + (slot[3] // TOPK) * stride_x)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < INTER
        rows = tl.minimum(offs_n, INTER - 1)      # loads need no mask; the stores have n_mask
        z = tl.zeros((BLOCK_N, C), dtype=tl.float32)
        acc_g = (z, z, z, z)
        acc_u = (z, z, z, z)
        raw_g = load_words(w1_ptr, s1_ptr, e, rows, 0, K, stride_we, stride_wn,
                           stride_se, stride_sn, FMT, C, ASM, EVEN_K)
        raw_u = load_words(w3_ptr, s3_ptr, e, rows, 0, K, stride_we, stride_wn,
                           stride_se, stride_sn, FMT, C, ASM, EVEN_K)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            # PREFETCH: this step's words came with the last one; the next step's go out first
            k_load = next_k(k0, K, BLOCK_K, EVEN_K) if PREFETCH else k0
            cur_g, cur_u = raw_g, raw_u
            raw_g = load_words(w1_ptr, s1_ptr, e, rows, k_load, K, stride_we, stride_wn,
                               stride_se, stride_sn, FMT, C, ASM, EVEN_K)
            raw_u = load_words(w3_ptr, s3_ptr, e, rows, k_load, K, stride_we, stride_wn,
                               stride_se, stride_sn, FMT, C, ASM, EVEN_K)
            if not PREFETCH:
                cur_g, cur_u = raw_g, raw_u
            acc_g, acc_u = _step2(acc_g, acc_u, a_rows, cur_g, cur_u, k0, FMT, C, SHIFT, ASM,
                                  BLOCK_M)
        cols = _perm(offs_n, CHUNK, BLOCK_K)
        for m in tl.static_range(BLOCK_M):
            _h_row(h_ptr, acc_g[m], acc_u[m], rw_ptr, p[m], ok[m], slot[m], cols, n_mask,
                   stride_h, limit, SHIFT, H_DTYPE, LIBDEVICE)


@triton.jit
def _h_row(h_ptr, acc_g, acc_u, rw_ptr, p, ok, slot, cols, n_mask,  # type: ignore[no-untyped-def]
           stride_h, limit, SHIFT: tl.constexpr, H_DTYPE: tl.constexpr,
           LIBDEVICE: tl.constexpr):
    rw = tl.load(rw_ptr + slot)
    h = swiglu_f32(tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1), limit, tl.float32,
                   LIBDEVICE) * rw
    h = h.to(H_DTYPE).to(tl.float32) * _pow2(SHIFT)
    tl.store(h_ptr + p * stride_h + cols, h, mask=n_mask & ok)


@triton.jit
def _down_fma_kernel(  # type: ignore[no-untyped-def]
    h_ptr, w_ptr, s_ptr, out_ptr, order_ptr, t_start_ptr, t_end_ptr, t_exp_ptr,
    K, D,
    stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_o,
    TOPK: tl.constexpr, FMT: tl.constexpr, SHIFT: tl.constexpr, ASM: tl.constexpr,
    EVEN_K: tl.constexpr, ATOMIC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, PREFETCH: tl.constexpr,
    SLOTS: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    CHUNK: tl.constexpr = 32 if FMT == 2 else 16
    C: tl.constexpr = BLOCK_K // CHUNK
    row_start, row_end, e = slot_or_tile(t_start_ptr, t_end_ptr, t_exp_ptr, SLOTS)
    if row_start < row_end:
        p, ok, q, slot = _tile_rows(order_ptr, row_start, row_end, SLOTS)
        a_rows = (h_ptr + q[0] * stride_h, h_ptr + q[1] * stride_h, h_ptr + q[2] * stride_h,
                  h_ptr + q[3] * stride_h)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < D
        rows = tl.minimum(offs_n, D - 1)
        z = tl.zeros((BLOCK_N, C), dtype=tl.float32)
        acc = (z, z, z, z)
        raw = load_words(w_ptr, s_ptr, e, rows, 0, K, stride_we, stride_wn, stride_se, stride_sn,
                         FMT, C, ASM, EVEN_K)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            k_load = next_k(k0, K, BLOCK_K, EVEN_K) if PREFETCH else k0
            cur = raw
            raw = load_words(w_ptr, s_ptr, e, rows, k_load, K, stride_we, stride_wn,
                             stride_se, stride_sn, FMT, C, ASM, EVEN_K)
            if not PREFETCH:
                cur = raw
            acc = _step(acc, a_rows, cur, k0, FMT, C, SHIFT, ASM, BLOCK_M)
        for m in tl.static_range(BLOCK_M):
            _out_row(out_ptr, acc[m], ok[m], slot[m], offs_n, n_mask, stride_o, TOPK, ATOMIC)


@triton.jit
def _out_row(out_ptr, acc, ok, slot, offs_n, n_mask, stride_o,  # type: ignore[no-untyped-def]
             TOPK: tl.constexpr, ATOMIC: tl.constexpr):
    """The down epilogue of one row: atomic add into out[token], or a store at its slot."""
    y = tl.sum(acc, axis=1)
    if ATOMIC:
        tl.atomic_add(out_ptr + (slot // TOPK) * stride_o + offs_n, y, mask=n_mask & ok)
    else:
        tl.store(out_ptr + slot * stride_o + offs_n, y, mask=n_mask & ok)


@triton.jit
def _pow2(SHIFT: tl.constexpr):  # type: ignore[no-untyped-def]
    """2^SHIFT as fp32 (0 <= SHIFT < 128), built from its bits."""
    return tl.full((1,), (SHIFT + 127) << 23, tl.int32).to(tl.float32, bitcast=True)


def chunk(fmt: int) -> int:
    """k per thread chunk of FMT code `fmt` (2 = fp4: one scale group; fp8: 16)."""
    return FP4_CHUNK if fmt == 2 else FP8_CHUNK


def fma_activations(x: torch.Tensor, fmt: int, block_k: int) -> torch.Tensor:
    """x [N, d] as the fma kernels read it: fp32 times 2^act_shift(fmt) (exact below
    2^(128 - ACT_SHIFT)), each BLOCK_K block of columns reordered from k = CHUNK c + P j + q to
    4C q + 4c + j (C = BLOCK_K / CHUNK, P = CHUNK / 4: the weights' W_q[c, j] order, with a q's
    16-byte pieces side by side over c), zero-padded to whole blocks. One launch when d is whole
    blocks."""
    N, d = x.shape
    step = chunk(fmt)
    blocks = triton.cdiv(d, block_k)
    if d % block_k:
        x = torch.nn.functional.pad(x, (0, blocks * block_k - d))
    out = torch.empty(N, blocks, step // 4, block_k // step, 4, dtype=torch.float32,
                      device=x.device)
    torch.mul(x.view(N, blocks, block_k // step, 4, step // 4).permute(0, 1, 4, 2, 3),
              float(2 ** act_shift(fmt)), out=out)
    return out.view(N, blocks * block_k)


_H_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def fma_launches(x: torch.Tensor, xs: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                 s1: torch.Tensor, s3: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                 indices: torch.Tensor, tiles: TileMap | None, rw: torch.Tensor, limit: float,
                 fmt: int, topk: int, deterministic: bool, plan: MoePlan,
                 libdevice: bool) -> torch.Tensor:
    """The fma loop's gate/up and down launches (`moe.py::_launch` contract): quantised codes as
    uint8, w1 / w3 (s1 / s3) sharing strides; [N, d] fp32 out (deterministic: the [N*k, d] rows,
    which `moe.py::_launch`'s combine sums over k in a fixed order). xs: x's
    `fma_activations(x, fmt, plan.block_k)` copy. tiles None (BLOCK_M 1 only): no tile map, one
    program row per (token, k) slot reading its expert from indices."""
    slots = tiles is None
    if tiles is None:
        assert plan.block_m == 1, "the slot grid holds one row per program"
        flat = indices.reshape(-1)
        order = t_start = t_end = t_exp = flat          # only t_exp is read (SLOTS)
    else:
        order, t_start, t_end, t_exp = tiles
    nk, inter, d = indices.numel(), w1.shape[1], x.shape[1]
    common = {"TOPK": topk, "FMT": fmt, "SHIFT": act_shift(fmt), "ASM": libdevice,
              "BLOCK_M": plan.block_m,
              "BLOCK_K": plan.block_k, "NUM_STAGES": plan.num_stages,
              "PREFETCH": plan.prefetch, "SLOTS": slots}
    # h in the down launch's activation order, padded to whole blocks (zeros: its loads are
    # unmasked; the padding's weights are masked to 0, and 0 * garbage could be NaN)
    width = triton.cdiv(inter, plan.block_k) * plan.block_k
    h = (torch.empty if width == inter else torch.zeros)(nk, width, dtype=torch.float32,
                                                         device=x.device)
    dest = down_output(nk, topk, d, deterministic, x.device)
    bn, warps = plan.gate_up.block_n, plan.gate_up.num_warps
    _gate_up_fma_kernel[(t_exp.numel(), triton.cdiv(inter, bn))](
        xs, w1, w3, s1, s3, h, order, rw, t_start, t_end, t_exp, d, inter, float(limit),
        xs.stride(0), w1.stride(0), w1.stride(1), s1.stride(0), s1.stride(1), h.stride(0),
        H_DTYPE=_H_DTYPES[x.dtype], LIBDEVICE=libdevice, EVEN_K=d % plan.block_k == 0,
        BLOCK_N=bn, num_warps=warps, **common, **pdl_args(xs.device),
    )
    bn, warps = plan.down.block_n, plan.down.num_warps
    _down_fma_kernel[(t_exp.numel(), triton.cdiv(d, bn))](
        h, w2, s2, dest, order, t_start, t_end, t_exp, inter, d,
        h.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), dest.stride(0),
        ATOMIC=not deterministic, EVEN_K=inter % plan.block_k == 0, BLOCK_N=bn,
        num_warps=warps, **common, **pdl_args(h.device),
    )
    return dest
