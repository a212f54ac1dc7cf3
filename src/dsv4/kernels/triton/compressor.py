"""Flash Compressor: one fused Triton pass for a compressor's serving step (spec §6.5; serving-reference §1.6).

Owns `triton_compress_cached`, the fast form of `kernels/ref/compressor.py::compress_cached` (same signature,
same semantics; the `triton` kernel backend maps `KernelOps.compress` to it). For T new tokens with S source
slots each (S = 2m for the overlap C4 compressor, m for C128), Dc output channels and c*Dc projected ones:

    for every token t that completes a window (write_slot[t] != trash):
        z_s, k_s = score / kv row of source slot s: this step's row src_new[t, s] if from_new[t, s],
                   else ring row src_ring[t, s]; columns [0, Dc) for s < m, [Dc, 2Dc) for s >= m (overlap)
        pooled   = Σ_s softmax_s(z_s) k_s                     per channel, over valid slots only
        entry    = RoPE_pos(norm_w * pooled / sqrt(mean(pooled²) + eps))   RoPE on the trailing rd channels
        out[write_slot[t]] = entry.to(out.dtype)
    then for every token with ring_write[t] != trash:  ring_kv/score[ring_write[t]] = kv/score[t]

Kernel design. Grid = (T,): program t owns token t and the whole Dc row of its entry, so the RMSNorm's sum of
squares is a register reduction (no second pass, no workspace). It walks the S slots in BLOCK_S chunks with an
online softmax per channel (running max m, denominator l, accumulator acc, each [BLOCK_D] fp32):

    for each chunk of BLOCK_S slots:                     index rows: 4 small [BLOCK_S] loads
        K, Z = two masked gathers ([BLOCK_S, BLOCK_D] fp32): this step's rows where from_new, ring rows
               elsewhere (a masked-off lane moves no bytes), Z = -inf where the slot is invalid
        m' = max(m, max_s Z);  l = l e^(m-m') + Σ_s e^(Z-m');  acc = acc e^(m-m') + Σ_s e^(Z-m') K
    pooled = acc / l  ->  norm  ->  RoPE on (even, odd) pairs (tl.split of a [BLOCK_D/2, 2] view)  ->  store

Each source row half is Dc * 4 contiguous bytes (2 KB for Dc = 512): the gathers are row-granular, coalesced
and 128-bit vectorised. The geometry (S, m, Dc, c*Dc, first rope pair) is constexpr: one compile per compressor
shape, three per model (sm_90, C4 Dc 512, 4 warps: 110 registers, no spills). Tokens that complete no window
(m-1 of every m tokens in prefill) skip the pooling after one 8-byte load.

Ring rows, and why a second launch. The reference reads every ring row before it writes any. A program that
wrote its token's ring row while another program of the same launch still had to read the old contents would
race. That happens only when some request brings n >= ring - S + 2 new tokens (engine/metadata.py, NOTE in
`_plan`), i.e. in prefill / extend, where `CompressIndex.ring_reads_disjoint` is False: the ring rows are then
written by a second, tiny launch (`_ring_write_kernel`, grid (T,)) that runs after the first has finished
reading. In decode (n = 1 per request, ring >= S) the flag is True and the first launch writes the ring rows
itself: one launch per compressor per step.

Invariants: the last row of `out` / of the ring is the trash row (LayerCache.entry_trash, RingState.trash);
the kernel never writes it (its contents are unspecified; the reference writes garbage there and nobody reads
it). Every non-trash write_slot and ring_write is distinct (one writer per row: metadata.py). Every source
index must be in range (not checked: that would need a host sync). An entry has at least one valid slot (its
own window's last token), so l > 0. Dc and rd are even; padded channels (Dc not a power of two) are masked.

Not implemented (documented for a later PR): splitting one entry over several programs. C128 has S = 128
slots of 2 KB (Dc = 512): at small batch the T programs are too few to fill the GPU. A channel split is free
for the pooling (the softmax is per channel) but the RMSNorm then needs a cross-program reduction (a second
launch over a [T, Dc] fp32 workspace, ~10% more bytes for C4, or a last-arriver atomic pattern).

Test: tests/kernels/test_compressor_triton.py. Benchmark: benchmarks/kernels/bench_compressor.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels.ref.compressor import CompressIndex, compress_geometry

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_TILE_ELEMENTS = 8192        # BLOCK_S * BLOCK_D per chunk (2 gathers of 32 KB fp32)
_ELEMENTS_PER_WARP = 1024    # default num_warps: about 32 tile elements per thread and per gather


@triton.jit
def _store_ring_row(kv_ptr, score_ptr, ring_kv_ptr, ring_score_ptr, ring_write_ptr,  # type: ignore[no-untyped-def]
                    t, width, ring_trash, stride_kv, stride_ring, BLOCK_W: tl.constexpr):
    row = tl.load(ring_write_ptr + t)
    if row != ring_trash:
        offs = tl.arange(0, BLOCK_W)
        mask = offs < width
        kv = tl.load(kv_ptr + t * stride_kv + offs, mask=mask)
        score = tl.load(score_ptr + t * stride_kv + offs, mask=mask)
        tl.store(ring_kv_ptr + row * stride_ring + offs, kv, mask=mask)
        tl.store(ring_score_ptr + row * stride_ring + offs, score, mask=mask)


@triton.jit
def _compress_kernel(  # type: ignore[no-untyped-def]
    kv_ptr, score_ptr, ring_kv_ptr, ring_score_ptr,
    src_new_ptr, src_ring_ptr, from_new_ptr, valid_ptr, write_slot_ptr, ring_write_ptr,
    w_ptr, cos_ptr, sin_ptr, out_ptr,
    out_trash, ring_trash, eps,
    stride_kv, stride_ring, stride_src, stride_cs, stride_out,
    S: tl.constexpr, RATIO: tl.constexpr, DC: tl.constexpr, WIDTH: tl.constexpr, ROPE_FIRST: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr,
    OVERLAP: tl.constexpr, WRITE_RING: tl.constexpr,
):
    # NOTE: the geometry is compile-time (a model has 3 compressor shapes): masks over d vanish for Dc = 2^k.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(write_slot_ptr + t)
    if slot != out_trash:
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < DC
        m = tl.full([BLOCK_D], float("-inf"), tl.float32)
        den = tl.zeros([BLOCK_D], tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for s0 in range(0, S, BLOCK_S):
            offs_s = s0 + tl.arange(0, BLOCK_S)
            s_mask = offs_s < S
            idx = t * stride_src + offs_s
            new_row = tl.load(src_new_ptr + idx, mask=s_mask, other=0)
            ring_row = tl.load(src_ring_ptr + idx, mask=s_mask, other=0)
            is_new = tl.load(from_new_ptr + idx, mask=s_mask, other=0) != 0
            ok = (tl.load(valid_ptr + idx, mask=s_mask, other=0) != 0) & s_mask
            if OVERLAP:   # slots [0, ratio) read the Ca half, [ratio, 2 ratio) the Cb half
                # NOTE: a product, not tl.where(s >= RATIO, DC, 0): it keeps the x16 divisibility that lets the
                # compiler vectorise the gathers (128-bit loads)
                cols = ((offs_s // RATIO) * DC)[:, None] + offs_d[None, :]
            else:
                cols = tl.zeros([BLOCK_S], tl.int32)[:, None] + offs_d[None, :]
            take = ok[:, None] & d_mask[None, :]
            from_new = take & is_new[:, None]
            from_ring = take & ~is_new[:, None]
            off_new = new_row[:, None] * stride_kv + cols
            off_ring = ring_row[:, None] * stride_ring + cols
            k = tl.where(from_new, tl.load(kv_ptr + off_new, mask=from_new, other=0.0),
                         tl.load(ring_kv_ptr + off_ring, mask=from_ring, other=0.0))
            z = tl.where(from_new, tl.load(score_ptr + off_new, mask=from_new, other=0.0),
                         tl.load(ring_score_ptr + off_ring, mask=from_ring, other=0.0))
            z = tl.where(take, z, float("-inf"))                                 # [BLOCK_S, BLOCK_D]
            m_new = tl.maximum(m, tl.max(z, axis=0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)               # no valid slot yet: -inf - -inf
            alpha = tl.exp(m - m_safe)
            p = tl.exp(z - m_safe[None, :])
            den = den * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p * k, axis=0)
            m = m_new
        pooled = tl.where(d_mask, acc / tl.where(d_mask, den, 1.0), 0.0)         # [BLOCK_D] fp32
        inv_rms = 1.0 / tl.sqrt(tl.sum(pooled * pooled, axis=0) / DC + eps)
        w = tl.load(w_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        y = w * (pooled * inv_rms)
        # RoPE on interleaved pairs (y[2i], y[2i+1]); pair i is rotated when i >= rope_first
        a, b = tl.split(tl.reshape(y, (BLOCK_D // 2, 2)))
        pair = tl.arange(0, BLOCK_D // 2)
        is_rope = (pair >= ROPE_FIRST) & (2 * pair < DC)
        cos = tl.load(cos_ptr + t * stride_cs + (pair - ROPE_FIRST), mask=is_rope, other=1.0)
        sin = tl.load(sin_ptr + t * stride_cs + (pair - ROPE_FIRST), mask=is_rope, other=0.0)
        ra = tl.where(is_rope, a * cos - b * sin, a)
        rb = tl.where(is_rope, a * sin + b * cos, b)
        entry = tl.reshape(tl.join(ra, rb), (BLOCK_D,))
        tl.store(out_ptr + slot * stride_out + offs_d, entry.to(out_ptr.dtype.element_ty), mask=d_mask)
    if WRITE_RING:
        _store_ring_row(kv_ptr, score_ptr, ring_kv_ptr, ring_score_ptr, ring_write_ptr,
                        t, WIDTH, ring_trash, stride_kv, stride_ring, BLOCK_W)


@triton.jit
def _ring_write_kernel(kv_ptr, score_ptr, ring_kv_ptr, ring_score_ptr, ring_write_ptr,  # type: ignore[no-untyped-def]
                       width, ring_trash, stride_kv, stride_ring, BLOCK_W: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    _store_ring_row(kv_ptr, score_ptr, ring_kv_ptr, ring_score_ptr, ring_write_ptr,
                    t, width, ring_trash, stride_kv, stride_ring, BLOCK_W)


def _check_rows(name: str, x: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...],
                contiguous: bool = True) -> None:
    if tuple(x.shape) != shape or x.dtype not in dtypes:
        raise ValueError(f"{name} must be {list(shape)} of {[str(d) for d in dtypes]}; got {list(x.shape)} {x.dtype}")
    if not x.is_contiguous() if contiguous else x.stride(-1) != 1:
        raise ValueError(f"{name} must be {'contiguous' if contiguous else 'unit-stride in its last dim'}; "
                         f"got strides {x.stride()} for shape {list(x.shape)}")


def _check(kv: torch.Tensor, score: torch.Tensor, ring_kv: torch.Tensor, ring_score: torch.Tensor,
           index: CompressIndex, norm_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           out: torch.Tensor) -> None:
    if kv.dim() != 2 or out.dim() != 2 or index.src_new.dim() != 2 or cos.dim() != 2:
        raise ValueError(f"expected kv [T, c*Dc], out [N, Dc], index.src_new [T, S], cos [T, rd/2]; got "
                         f"{list(kv.shape)}, {list(out.shape)}, {list(index.src_new.shape)}, {list(cos.shape)}")
    (T, width), Dc, S, half_rd = kv.shape, out.shape[1], index.src_new.shape[1], cos.shape[1]
    if width not in (Dc, 2 * Dc) or Dc % 2 or half_rd > Dc // 2 or S == 0 or (width == 2 * Dc and S % 2):
        raise ValueError(f"inconsistent geometry: kv width {width} must be Dc or 2*Dc (Dc = {Dc}, even), "
                         f"rd/2 = {half_rd} <= Dc/2, S = {S} > 0 (even with overlap)")
    fp32 = (torch.float32,)
    for name, x, shape in (("score", score, (T, width)), ("kv", kv, (T, width)), ("sin", sin, (T, half_rd)),
                           ("cos", cos, (T, half_rd)), ("ring_kv", ring_kv, (ring_kv.shape[0], width)),
                           ("ring_score", ring_score, tuple(ring_kv.shape))):
        _check_rows(name, x, shape, fp32)
    _check_rows("out", out, tuple(out.shape), _OUT_DTYPES, contiguous=False)
    _check_rows("norm_weight", norm_weight, (Dc,), _OUT_DTYPES)
    for name, x, shape, dtype in (("src_new", index.src_new, (T, S), torch.int64),
                                  ("src_ring", index.src_ring, (T, S), torch.int64),
                                  ("from_new", index.from_new, (T, S), torch.bool),
                                  ("src_valid", index.src_valid, (T, S), torch.bool),
                                  ("write_slot", index.write_slot, (T,), torch.int64),
                                  ("ring_write", index.ring_write, (T,), torch.int64)):
        if tuple(x.shape) != shape or x.dtype != dtype or not x.is_contiguous():
            raise ValueError(f"index.{name} must be a contiguous {list(shape)} {dtype}; "
                             f"got {list(x.shape)} {x.dtype} strides {x.stride()}")
    tensors = (kv, score, ring_kv, ring_score, norm_weight, cos, sin, out, *index[:6])
    devices = {x.device for x in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(map(str, devices))}")


def default_config(S: int, Dc: int) -> tuple[int, int]:
    """(block_s, num_warps): an untuned first choice (bench_compressor.py --sweep compares alternatives)."""
    block_d = triton.next_power_of_2(Dc)
    block_s = min(triton.next_power_of_2(S), max(1, _TILE_ELEMENTS // block_d))
    return block_s, max(2, min(8, block_s * block_d // _ELEMENTS_PER_WARP))


def triton_compress_cached(kv: torch.Tensor, score: torch.Tensor, ring_kv: torch.Tensor, ring_score: torch.Tensor,
                           index: CompressIndex, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                           sin: torch.Tensor, out: torch.Tensor, *, block_s: int | None = None,
                           num_warps: int | None = None, num_stages: int = 2) -> None:
    """Same contract as `compress_cached` (in place: entries into `out`, this step's rows into the ring).

    kv, score: [T, c*Dc] fp32; ring_kv, ring_score: [N_ring, c*Dc] fp32; index: CompressIndex ([T, S] rows);
    norm_weight: [Dc]; cos, sin: [T, rd/2] fp32; out: [N_out, Dc] bf16 / fp16 / fp32. All contiguous except
    `out` (unit last stride: a row-sliced view of a pool is fine); all on one device. One launch when
    `index.ring_reads_disjoint`, else two (module docstring). Keyword arguments are tuning knobs (benchmark
    sweeps, tests). No host syncs: safe inside CUDA-graph capture.
    """
    _check(kv, score, ring_kv, ring_score, index, norm_weight, cos, sin, out)
    T, width = kv.shape
    if T == 0:
        return
    ratio, overlap = compress_geometry(kv, index, out)
    Dc, S = out.shape[1], index.src_new.shape[1]
    auto_s, auto_w = default_config(S, Dc)
    block_s = block_s or auto_s
    if block_s & (block_s - 1):
        raise ValueError(f"block_s must be a power of two; got {block_s}")
    fused = index.ring_reads_disjoint
    block_w = triton.next_power_of_2(width)
    ring_trash = ring_kv.shape[0] - 1
    _compress_kernel[(T,)](
        kv, score, ring_kv, ring_score, *index[:6], norm_weight, cos, sin, out,
        out.shape[0] - 1, ring_trash, eps,
        kv.stride(0), ring_kv.stride(0), index.src_new.stride(0), cos.stride(0), out.stride(0),
        S=S, RATIO=ratio, DC=Dc, WIDTH=width, ROPE_FIRST=Dc // 2 - cos.shape[1],
        BLOCK_S=block_s, BLOCK_D=triton.next_power_of_2(Dc), BLOCK_W=block_w, OVERLAP=overlap, WRITE_RING=fused,
        num_warps=num_warps or auto_w, num_stages=num_stages,
    )
    if not fused:  # NOTE: after every ring read of the launch above (module docstring)
        _ring_write_kernel[(T,)](kv, score, ring_kv, ring_score, index.ring_write, width, ring_trash,
                                 kv.stride(0), ring_kv.stride(0), BLOCK_W=block_w, num_warps=4)
