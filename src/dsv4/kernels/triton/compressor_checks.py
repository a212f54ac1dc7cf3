"""Layout checks of the Flash Compressor's launches (`compressor.py::triton_compress_cached`,
`compressor_pair.py::triton_compress_pair`): shapes, dtypes, strides and device of one
compressor's step tensors, each error naming the tensor (ValueError)."""

from __future__ import annotations

import torch

from dsv4.kernels.ref.compressor import CompressIndex

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_rows(name: str, x: torch.Tensor, shape: tuple[int, ...],
                dtypes: tuple[torch.dtype, ...], contiguous: bool = True) -> None:
    if tuple(x.shape) != shape or x.dtype not in dtypes:
        raise ValueError(f"{name} must be {list(shape)} of {[str(d) for d in dtypes]}; "
                         f"got {list(x.shape)} {x.dtype}")
    if not x.is_contiguous() if contiguous else x.stride(-1) != 1:
        raise ValueError(f"{name} must be "
                         f"{'contiguous' if contiguous else 'unit-stride in its last dim'}; "
                         f"got strides {x.stride()} for shape {list(x.shape)}")


def check_inputs(kv: torch.Tensor, score: torch.Tensor, ring_kv: torch.Tensor,
                 ring_score: torch.Tensor, index: CompressIndex, norm_weight: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor,
                 ape: torch.Tensor | None = None, out_scale: torch.Tensor | None = None) -> None:
    """`triton_compress_cached`'s layout checks (ValueError naming the tensor): shapes, dtypes,
    strides, device. `out_scale`: `out` holds FP8 codes, these [N_out] fp32 their scales."""
    if kv.dim() != 2 or out.dim() != 2 or index.src_new.dim() != 2 or cos.dim() != 2:
        raise ValueError(f"expected kv [T, c*Dc], out [N, Dc], index.src_new [T, S], "
                         f"cos [T, rd/2]; got {list(kv.shape)}, {list(out.shape)}, "
                         f"{list(index.src_new.shape)}, {list(cos.shape)}")
    (T, width), Dc, S, half_rd = kv.shape, out.shape[1], index.src_new.shape[1], cos.shape[1]
    if (width not in (Dc, 2 * Dc) or Dc % 2 or half_rd > Dc // 2 or S == 0
            or (width == 2 * Dc and S % 2)):
        raise ValueError(f"inconsistent geometry: kv width {width} must be Dc or 2*Dc "
                         f"(Dc = {Dc}, even), rd/2 = {half_rd} <= Dc/2, S = {S} > 0 "
                         f"(even with overlap)")
    fp32 = (torch.float32,)
    for name, x, shape in (("sin", sin, (T, half_rd)), ("cos", cos, (T, half_rd)),
                           ("ring_kv", ring_kv, (ring_kv.shape[0], width)),
                           ("ring_score", ring_score, tuple(ring_kv.shape))):
        _check_rows(name, x, shape, fp32)
    # kv and score: rows of one stride, e.g. column slices of one fused projection's output
    for name, x in (("score", score), ("kv", kv)):
        _check_rows(name, x, (T, width), fp32, contiguous=False)
    if T > 1 and score.stride(0) != kv.stride(0):
        raise ValueError(f"kv and score must share one row stride; got {kv.stride(0)} and "
                         f"{score.stride(0)}")
    if out_scale is None:
        _check_rows("out", out, tuple(out.shape), _OUT_DTYPES, contiguous=False)
    else:
        _check_rows("out", out, tuple(out.shape), (torch.float8_e4m3fn,), contiguous=False)
        _check_rows("out_scale", out_scale, tuple(out.shape[:1]), fp32)
    _check_rows("norm_weight", norm_weight, (Dc,), _OUT_DTYPES)
    if ape is not None:        # [ratio, width]: ratio = S, or S / 2 with overlap
        _check_rows("ape", ape, (S // 2 if width == 2 * Dc else S, width), fp32)
    for name, x, shape, dtype in (("src_new", index.src_new, (T, S), torch.int64),
                                  ("src_ring", index.src_ring, (T, S), torch.int64),
                                  ("from_new", index.from_new, (T, S), torch.bool),
                                  ("src_valid", index.src_valid, (T, S), torch.bool),
                                  ("write_slot", index.write_slot, (T,), torch.int64),
                                  ("ring_write", index.ring_write, (T,), torch.int64)):
        if tuple(x.shape) != shape or x.dtype != dtype or not x.is_contiguous():
            raise ValueError(f"index.{name} must be a contiguous {list(shape)} {dtype}; "
                             f"got {list(x.shape)} {x.dtype} strides {x.stride()}")
    tensors = (kv, score, ring_kv, ring_score, norm_weight, cos, sin, out, *index[:6],
               *(() if ape is None else (ape,)))
    devices = {x.device for x in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(map(str, devices))}")
