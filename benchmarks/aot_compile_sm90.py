"""Compile Triton kernels for the H200 (sm_90) without a GPU, and count their SASS instructions.

The interpreter (TRITON_INTERPRET=1) checks what a kernel computes, not whether the GPU compiler
accepts it (e.g. an early `return` inside a constexpr branch still type-checks the code after it).
Compiling ahead of time with the device's Triton (3.6.0 on the lent H200) catches that before
device time is spent, and the static instruction / global-load counts are a first look at a
change's cost:

    pip install --no-deps --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36:src python benchmarks/aot_compile_sm90.py [--kernels moe,topk]

Variants are compiled as the JIT specialises a real launch: every pointer 16-byte aligned (torch
allocations are), and integer arguments whose type carries ":16" divisible by 16 (strides of
power-of-two rows). Without these hints the gathers compile to scalar loads and the counts mislead.

Prints one line per compiled variant (instructions, LDG, HMMA, shared bytes, registers and stack
bytes per thread, and the compile's wall seconds on this machine: which kernels make a cold start
slow); exits 1 on any compile error.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dsv4.kernels.ops import DECODE_BLOCK_N
from dsv4.kernels.triton import pdl

# label, kernel, types, constexprs, options
Variant = tuple[str, Any, dict[str, str], dict[str, Any], dict[str, int]]


def moe_variants() -> Iterator[Variant]:
    """Each (format, distinct inner loop) at the plan's BLOCK_K, as BLOCK_M x BLOCK_N: 16 x 64
    (decode), 16 x 32 (N = 1) and the largest BLOCK_M (big N), 4 warps. The label ends with the
    bytes of one weight matrix a thread decodes per K step: the loop count over it (twice it for
    gate/up, two matrices) is the K loop's instructions per weight byte."""
    from dsv4.kernels.triton import moe_mma, moe_plan

    # "fma", "frag" and "w8a8" have kernels of their own (`moe_fma_variants`, `moe_frag_variants`,
    # `moe_w8a8_variants`)
    loops = {"bf16": ("scaled",), "fp8": ("scaled", "dot_scaled"),
             "fp4": tuple(v for v in moe_plan.VARIANTS if v not in ("fma", "w8a8", "frag"))}
    for fmt, name in ((0, "bf16"), (1, "fp8"), (2, "fp4")):
        w, s = ("*bf16", "*bf16") if fmt == 0 else ("*u8", "*u8")
        types = {"x_ptr": "*bf16", "w1_ptr": w, "w3_ptr": w, "s1_ptr": s, "s3_ptr": s,
                 "h_ptr": "*bf16", "w_ptr": w, "s_ptr": s, "out_ptr": "*fp32", "order_ptr": "*i64",
                 "rw_ptr": "*fp32", "t_start_ptr": "*i32", "t_end_ptr": "*i32",
                 "t_exp_ptr": "*i32", "limit": "fp32", "e_lo": "i32", "e_hi": "i32"}
        # V4-Flash: every dim and stride is a multiple of 16 (the JIT specialises on it)
        types |= {name: "i32:16" for name in ("K", "INTER", "D", "stride_x", "stride_we",
                                              "stride_wn", "stride_se", "stride_sn", "stride_h",
                                              "stride_o")}
        for variant in loops[name]:
            big_m = moe_plan.max_block_m(name, variant)
            for bm, bn in ((16, 64), (16, 32), (big_m, 64)):
                bk = moe_plan.default_block_k(name, variant, bm)
                consts = {"TOPK": 6, "FMT": fmt, "VARIANT": moe_plan.VARIANTS[variant],
                          "FP32_DOT": False, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}
                options = {"num_warps": 4, "num_stages": 3}
                per_thread = bn * bk * (2, 1, 0.5)[fmt] / 128
                label = f"{name} {variant} {bm}x{bn}x{bk} {per_thread:g}B"
                yield (f"moe gate_up {label}", moe_mma._gate_up_kernel, types,
                       {**consts, "LIBDEVICE": True}, options)
                yield (f"moe down {label}", moe_mma._down_kernel, types,
                       {**consts, "ATOMIC": False}, options)
    yield from moe_fma_variants()
    yield from moe_frag_variants()
    yield from moe_w8a8_variants()


def _cap(regs: int | None) -> str:
    return "" if regs is None else f" r{regs}"


def moe_w8a8_variants() -> Iterator[Variant]:
    """The W8A8 loop (`moe_w8a8.py`), FP8 and FP4 weights, at the plan's tiles (BLOCK_M 16 / 64 /
    128; gate/up BLOCK_N 128, down 128 and 64), and the activation quantisation it starts with
    (`act_quant.py`); QGMMA counts the FP8 wgmma."""
    from dsv4.kernels.triton import act_quant, moe_plan, moe_w8a8

    # the dots' operands are float8e4nv pointers (`fp8_dot.py`); FP4 weights stay packed bytes
    types = {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w1_ptr": "*u8", "w3_ptr": "*u8",
             "s1_ptr": "*u8", "s3_ptr": "*u8", "h_ptr": "*fp8e4nv", "hs_ptr": "*fp32",
             "w_ptr": "*u8",
             "s_ptr": "*u8", "out_ptr": "*fp32", "order_ptr": "*i64", "rw_ptr": "*fp32",
             "t_start_ptr": "*i32", "t_end_ptr": "*i32", "t_exp_ptr": "*i32", "limit": "fp32"}
    types |= {name: "i32:16" for name in ("K", "INTER", "D", "stride_x", "stride_xs",
                                          "stride_we", "stride_wn", "stride_se", "stride_sn",
                                          "stride_h", "stride_hs", "stride_o")}
    tiles = [(1, bm, bn, st) for bm, bn, st in ((16, 128, 3), (64, 128, 3), (64, 64, 4),
                                                   (128, 128, 3))]
    tiles += [(2, bm, bn, st) for bm, bn, st in ((16, 128, 3), (64, 128, 3), (128, 128, 3))]
    for fmt, bm, bn, stages in tiles:
        w = "*fp8e4nv" if fmt == 1 else "*u8"
        typed = types | {"w1_ptr": w, "w3_ptr": w, "w_ptr": w}
        consts = {"TOPK": 6, "FMT": fmt, "FP32_DOT": False, "BLOCK_M": bm, "BLOCK_N": bn}
        warps = {"num_stages": stages}
        # the plan's register cap of down at BLOCK_M 64 (two CTAs per SM)
        caps = (None, moe_plan.W8A8_DOWN_REGS if bm == 64 and bn == 128 else None)
        cap = moe_w8a8.maxnreg_option
        label = f"{('fp8', 'fp4')[fmt - 1]} w8a8 {bm}x{bn}x128 s{stages}"
        if bn == 128:
            yield (f"moe gate_up {label}{_cap(caps[0])}", moe_w8a8._w8a8_gate_up_kernel, typed,
                   {**consts, "H_BF16": True, "LIBDEVICE": True},
                   {**warps, "num_warps": 8 if bm >= 32 else 4, **cap(caps[0])})
        yield (f"moe down {label}{_cap(caps[1])}", moe_w8a8._w8a8_down_kernel, typed,
               consts, {**warps, "num_warps": 8 if bm * bn >= 8192 else 4, **cap(caps[1])})
    yield ("act_quant bf16 -> e4m3 block 128", act_quant._act_quant_kernel,
           {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*fp32", "N": "i32", "D": "i32:16",
            "stride_x": "i32:16", "stride_q": "i32:16", "stride_s": "i32"},
           {"BLOCK": 128, "BLOCK_ROWS": act_quant.BLOCK_ROWS, "HALF_ORDER": False},
           {"num_warps": 4})


def moe_fma_variants() -> Iterator[Variant]:
    """The "fma" loop (`moe_fma.py`) of FP4 / FP8 at BLOCK_M 1, 2, 4 on the plan's tiles with and
    without the register prefetch, and FP4 at BLOCK_N 64 / BLOCK_K 512 / 2 stages; labels as
    `moe_variants`' (bytes of one matrix a thread decodes per K step)."""
    from dsv4.kernels.triton import moe_fma, moe_plan

    types = {"x_ptr": "*fp32", "w1_ptr": "*u8", "w3_ptr": "*u8", "s1_ptr": "*u8", "s3_ptr": "*u8",
             "h_ptr": "*fp32", "w_ptr": "*u8", "s_ptr": "*u8", "out_ptr": "*fp32",
             "order_ptr": "*i64", "rw_ptr": "*fp32", "t_start_ptr": "*i32", "t_end_ptr": "*i32",
             "t_exp_ptr": "*i32", "limit": "fp32"}
    types |= {name: "i32:16" for name in ("K", "INTER", "D", "stride_x", "stride_we",
                                          "stride_wn", "stride_se", "stride_sn", "stride_h",
                                          "stride_o")}
    bn0, warps = moe_plan.FMA_BLOCK_N, moe_plan.FMA_WARPS
    for fmt, name in ((1, "fp8"), (2, "fp4")):
        bk0 = moe_plan.FMA_BLOCK_K[name]
        tiles = [(bm, bn0, bk0, 1, pf) for bm in (1, 2, 4) for pf in (False, True)]
        if fmt == 2:
            tiles += [(1, 64, bk0, 1, True), (1, bn0, 2 * bk0, 1, False), (1, bn0, bk0, 2, False)]
        for bm, bn, bk, stages, pf in tiles:
            consts = {"TOPK": 6, "FMT": fmt, "SHIFT": moe_fma.act_shift(fmt), "ASM": True,
                      "EVEN_K": True, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
                      "NUM_STAGES": stages, "PREFETCH": pf, "SLOTS": bm == 1}
            per_thread = bn * bk * (1, 0.5)[fmt - 1] / (32 * warps)
            label = f"{name} fma {bm}x{bn}x{bk} s{stages}{' pf' if pf else ''} {per_thread:g}B"
            options = {"num_warps": warps}
            yield (f"moe gate_up {label}", moe_fma._gate_up_fma_kernel, types,
                   {**consts, "H_DTYPE": tl.bfloat16, "LIBDEVICE": True}, options)
            yield (f"moe down {label}", moe_fma._down_fma_kernel, types,
                   {**consts, "ATOMIC": False}, options)


def moe_frag_variants() -> Iterator[Variant]:
    """The "frag" loop (`moe_frag.py`, FP4 decoded into mma.sync fragments) at WK x WN warps =
    (2, 1), (4, 1), (2, 2), (2, 4) and BLOCK_M 1 (slots), 8 or 16 (tile map), as BLOCK_M x
    BLOCK_N (WK 2: two virtual K splits per warp, two 32-byte steps per loop iteration); the
    label ends with the bytes of one matrix a thread decodes per K step."""
    from dsv4.kernels.triton import moe_frag

    types = {"x_ptr": "*bf16", "w1_ptr": "*u8", "w3_ptr": "*u8", "s1_ptr": "*u8", "s3_ptr": "*u8",
             "h_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*u8", "out_ptr": "*fp32",
             "rw_ptr": "*fp32", "exp_ptr": "*i64", "order_ptr": "*i64", "t_start_ptr": "*i32",
             "t_end_ptr": "*i32", "limit": "fp32"}
    types |= {name: "i32:16" for name in ("K", "INTER", "D", "stride_x", "stride_we",
                                          "stride_wn", "stride_se", "stride_sn", "stride_h",
                                          "stride_o")}
    # the plan's launches (moe_plan.FRAG_LAUNCHES) and their neighbours
    # (na: the weights' loads skip L1, the plan's stream_weights knob)
    for wk, wn, bm, na in ((2, 1, 1, False), (4, 1, 1, False), (2, 2, 1, False), (4, 1, 8, False),
                           (2, 2, 8, False), (4, 1, 16, False), (2, 2, 16, False),
                           (2, 4, 16, False), (4, 1, 1, True)):
        # the plan's launches also with e4m3 codes (FP8, BLOCK_M 1)
        for fp8 in (False, True) if (wk, wn, bm) in ((2, 1, 1), (4, 1, 1)) else (False,):
            consts = {"TOPK": 6, "WK": wk, "WN": wn, "SLOTS": bm == 1, "NT": max(1, bm // 8),
                      "ASM": True, "L2PF": 128 if bm == 1 else 256, "FP8": fp8, "WNA": na}
            label = (f"{'fp8' if fp8 else 'fp4'} frag {bm}x{16 * wn} wk{wk}{' na' if na else ''} "
                     f"{64 if fp8 else 32}B")
            options = {"num_warps": wk * wn}
            yield (f"moe gate_up {label}", moe_frag._gate_up_frag_kernel, types,
                   {**consts, "LIBDEVICE": True}, options)
            yield (f"moe down {label}", moe_frag._down_frag_kernel, types,
                   {**consts, "ATOMIC": False}, options)


def topk_variants() -> Iterator[Variant]:
    from dsv4.kernels.triton import topk, topk_compact

    types = {"scores_ptr": "*fp32", "lengths_ptr": "*i32", "out_ptr": "*i64", "slots_ptr": "*i32",
             "state_ptr": "*i32", "cand_ptr": "*i64", "scr_ptr": "*i64", "probe_ptr": "*i64"}
    for block in (1024, 2048, 4096):     # the row path (decode up to 16K context)
        yield (f"topk row {block}", topk._topk_row_kernel, types,
               {"BLOCK": block, "PAD_BLOCK": 1024}, {"num_warps": topk.row_warps(block)})
    tail = {"TBLOCK": 2048, "LIST_BLOCK": 1024, "FINISH_BLOCK": 1024, "PAD_BLOCK": 1024}
    for exact in (True, False):
        mode = "exact" if exact else "bound"
        pows = {"P1_POW2": 64 if exact else 16, "P2_POW2": 64 if exact else 32}
        yield (f"topk hist {mode}", topk_compact._hist_kernel, types,
               {"GROUP": 1 if exact else 4, "BLOCK": 4096, "ZERO_BLOCK": 1024,
                "SAMPLE": 1 if exact else 8},
               {"num_warps": 8})
        for probe in (False, True):
            consts = {"EXACT": exact, "CBLOCK": 2048 if exact else 1024, "SMALL_BLOCK": 256,
                      "PROBE": probe, **tail, **pows, "CHUNK_TILE": 0}
            yield f"topk compact {mode}{' probe' if probe else ''}", \
                topk_compact._compact_kernel, types, consts, {"num_warps": 8}
    for chunk_tile in (0, 8192):
        yield (f"topk tail bound {chunk_tile}", topk_compact._tail_kernel, types,
               {**tail, "P2_POW2": 32, "PROBE": False, "CHUNK_TILE": chunk_tile},
               {"num_warps": 8})
    from dsv4.kernels.triton import topk_coop
    coop_types = {"scores_ptr": "*fp32", "lengths_ptr": "*i32", "out_ptr": "*i64", "ws_ptr": "*i32",
                  "probe_ptr": "*i64"}
    # B 1 / 2 / 4; a stage
    for chunk, warps, stage in ((2048, 8, 0), (4096, 8, 0), (8192, 16, 0), (2048, 8, 3)):
        consts = {"CHUNK": chunk, "CAP": 32, "P_POW2": 128, "ZERO_BLOCK": 128, "PAD_BLOCK": 1024,
                  "STAGE": stage, "PROBE": False}
        yield (f"topk coop {chunk} stage {stage}", topk_coop._coop_kernel, coop_types, consts,
               {"num_warps": warps})


def compressor_variants() -> Iterator[Variant]:
    """The Flash Compressor's kernels at V4-Flash's geometries, each with the gate scores' ape
    added per slot (the serving path's form) and without it ("no ape": scores that include it)."""
    for ape in (True, False):
        yield from _compressor_variants(ape)


def _compressor_variants(ape: bool) -> Iterator[Variant]:
    import triton.language as tl

    from dsv4.kernels.triton import compressor

    f32, i64 = "*fp32", "*i64"
    types = {"kv_ptr": f32, "score_ptr": f32, "ring_kv_ptr": f32, "ring_score_ptr": f32,
             "src_new_ptr": i64, "src_ring_ptr": i64, "from_new_ptr": "*i1", "valid_ptr": "*i1",
             "write_slot_ptr": i64, "ring_write_ptr": i64, "w_ptr": "*bf16", "cos_ptr": f32,
             "sin_ptr": f32, "out_ptr": "*bf16", "out_trash": "i64", "ring_trash": "i64",
             "eps": "fp32", "stride_kv": "i32:16", "stride_ring": "i32:16", "stride_cs": "i32:16",
             "stride_out": "i32:16", "ape_ptr": f32, "stride_ape": "i32:16"}
    tag = "" if ape else " no ape"
    for name, S, ratio, Dc, overlap in (("c4-attn", 8, 4, 512, True),
                                        ("c4-indexer", 8, 4, 128, True),
                                        ("c128-attn", 128, 128, 512, False)):
        block_s, warps, stages = compressor.default_config(S, Dc)
        width = (2 if overlap else 1) * Dc
        consts = {"S": S, "RATIO": ratio, "DC": Dc, "WIDTH": width, "ROPE_FIRST": Dc // 2 - 32,
                  "BLOCK_S": block_s, "BLOCK_D": Dc, "BLOCK_W": width, "OVERLAP": overlap,
                  "WRITE_RING": True, "PREFETCH": False, "HAS_APE": ape}
        yield (f"compress {name} {block_s}/{warps}/{stages}{tag}", compressor._compress_kernel,
               types, consts, {"num_warps": warps, "num_stages": stages})
    from dsv4.kernels.triton import compressor_group
    group_types = types | {"T": "i32"}
    for name, Dc, tokens, warps in (("c4-indexer", 128, 4, 4), ("c4-indexer", 128, 8, 8),
                                    ("c4-indexer", 128, 2, 2), ("c4-attn", 512, 2, 8)):
        consts = {"S": 8, "RATIO": 4, "DC": Dc, "WIDTH": 2 * Dc, "ROPE_FIRST": Dc // 2 - 32,
                  "G": tokens, "BLOCK_S": 8, "BLOCK_D": Dc, "BLOCK_W": 2 * Dc, "OVERLAP": True,
                  "WRITE_RING": True, "HAS_APE": ape}
        yield (f"compress {name} x{tokens} {warps}w{tag}", compressor_group._compress_group_kernel,
               group_types, consts, {"num_warps": warps, "num_stages": 2})
    pair_types = {f"{k}_{ab}": f32 for k in ("kv", "score", "ring_kv", "ring_score") for ab in "ab"}
    pair_types |= {"w_a": "*bf16", "w_b": "*bf16", "out_a": "*bf16", "out_b": "*bf16",
                   "ape_a": f32, "ape_b": f32, "scale_b": f32}
    pair_types |= {k: v for k, v in types.items()
                   if k.startswith(("src_", "from_", "valid", "write_", "ring_write", "cos", "sin",
                                    "out_trash", "ring_trash", "eps"))}
    pair_types |= ({f"stride_{k}_{ab}": "i32:16" for k in ("kv", "ring", "out") for ab in "ab"}
                   | {"stride_cs": "i32:16"})
    pair_consts = {"S": 8, "RATIO": 4, "DC_A": 512, "DC_B": 128, "ROPE_FIRST_A": 256 - 32,
                   "ROPE_FIRST_B": 64 - 32, "BLOCK_S": 8, "BLOCK_DA": 512, "BLOCK_DB": 128,
                   "WRITE_RING": True, "HAS_APE": ape, "FP8_B": False, "KEY_DTYPE": tl.float32}
    from dsv4.kernels.triton import compressor_pair
    for warps in (2, 4, 8):
        yield (f"compress c4-pair {warps} warps{tag}", compressor_pair._compress_pair_kernel,
               pair_types, pair_consts, {"num_warps": warps, "num_stages": 2})
    # FP8 indexer keys: codes (bytes) and a scale per key, entries rounded to bf16 first
    yield (f"compress c4-pair fp8 keys 4 warps{tag}", compressor_pair._compress_pair_kernel,
           pair_types | {"out_b": "*u8"}, pair_consts | {"FP8_B": True, "KEY_DTYPE": tl.bfloat16},
           {"num_warps": 4, "num_stages": 2})


def attention_variants() -> Iterator[Variant]:
    from dsv4.kernels.triton import index_scores, sparse_attention, split_combine

    hint = "i32:16"
    # the serving path's weights: the raw bf16 weights_proj columns of the fused x GEMM output,
    # scaled in the kernel; fp32: callers that pass weights already scaled
    # FP8 keys (their scales) widened to bf16 q, or FP8 q (codes and head scales, `rope_fp8`) and
    # an FP8 dot
    for w, even, keys in (("bf16", True, "bf16"), ("bf16", False, "bf16"), ("fp32", True, "bf16"),
                          ("bf16", True, "fp8"), ("bf16", True, "fp8q")):
        k_type = "*bf16" if keys == "bf16" else "*fp8e4nv"
        types = {"q_ptr": "*fp8e4nv" if keys == "fp8q" else "*bf16", "qs_ptr": "*fp32",
                 "w_ptr": f"*{w}", "k_ptr": k_type,
                 "ks_ptr": "*fp32", "cand_ptr": "*i64", "out_ptr": "*fp32",
                 "weight_scale": "fp32",
                 **{f"stride_{k}": hint for k in ("qt", "qh", "wt", "kn", "ct", "ot")}}
        # EVEN_D: 16-byte loads and a cp.async key gather; else 2-byte loads
        consts = {"BLOCK_V": 64, "BLOCK_H": 64, "BLOCK_D": 128,
                  "FP32_DOT": False, "EVEN_D": even, "FP8_KEYS": keys != "bf16",
                  "FP8_Q": keys == "fp8q"}
        yield (f"index scores w {w} even_d={even} keys {keys}", index_scores._index_scores_kernel,
               types, consts, {"num_warps": 4, "num_stages": 3 if keys == "fp8q" else 2})
    types = {"q_ptr": "*bf16", "kv1_ptr": "*bf16", "idx1_ptr": "*i64", "kv2_ptr": "*bf16",
             "idx2_ptr": "*i64", "sink_ptr": "*fp32", "out_ptr": "*bf16", "part_ptr": "*fp32",
             "lse_ptr": "*fp32", "qk_scale": "fp32", "log2e": "fp32", "cos_ptr": "*fp32",
             "sin_ptr": "*fp32",
             **{f"stride_{k}": hint for k in ("qt", "qh", "kv1", "i1", "kv2", "i2", "ot", "oh")}}
    # the serving path's: de-rotated in the store (`inverse_rope`)
    for even, terms, derotate in ((True, 1, True), (True, 2, True), (True, 3, True),
                                  (False, 3, True), (True, 3, False)):
        consts = {"BLOCK_H": 16, "BLOCK_N": 32, "BLOCK_D": 512, "FP32_DOT": False, "SPLIT": False,
                  "EVEN_D": even, "P_TERMS": terms, "DEROTATE": derotate}
        yield (f"sparse attn even_d={even} p_terms={terms} derotate={derotate}",
               sparse_attention._sparse_attention_kernel, types, consts,
               {"num_warps": 4, "num_stages": 2})
    for derotate in (True, False):
        yield (f"sparse attn combine derotate={derotate}", split_combine._combine_kernel,
               {**types, "part_ptr": "*fp32"},
               {"BLOCK_S": 64, "BLOCK_C": 128, "EVEN_C": True, "DEROTATE": derotate},
               {"num_warps": 4})


def metadata_variants() -> Iterator[Variant]:
    """The one launch of V4-Flash (page 256, window 128): both specs (C4 with overlap, ring 8;
    C128, ring 128), one spec (a model with CSA or HCA layers only), none (the MTP draft's
    context)."""
    from dsv4.kernels.triton import metadata

    types = {name: "*i64" for name in metadata._metadata_kernel.arg_names if name.endswith("_ptr")}
    types.update({f"{name}{i}_ptr": "*u8" for name in ("from_new", "valid") for i in (0, 1)})
    base = {"P": 256, "W": 128, "BLOCK_T": metadata.BLOCK_T, "BLOCK_B": metadata.BLOCK_B,
            "BLOCK_W": metadata.MAX_BLOCK_W, "BLOCK_V": metadata.BLOCK_V}
    c4, c128, unused = (4, 8, 8), (128, 128, 128), (1, 1, 1)     # RATIO, S, RING
    for label, slots in (("c4 + c128", (c4, c128)), ("c4", (c4, unused)),
                         ("c128", (c128, unused)), ("tokens only", (unused, unused))):
        consts = {**base, "NSPEC": sum(s != unused for s in slots)}
        for i, (ratio, S, ring) in enumerate(slots):
            consts |= {f"RATIO{i}": ratio, f"S{i}": S, f"RING{i}": ring, f"BLOCK_S{i}": S}
        yield f"metadata {label}", metadata._metadata_kernel, types, consts, {"num_warps": 4}


def small_variants() -> Iterator[Variant]:
    """The decode step's small kernels: the MoE tile map, the indexer picks' slots, the
    sampler's two argmax stages (fp32 logits, the default block), HiSparse's two copies, the MoE
    combine, the MoE gate's logits and the step's RoPE rows."""
    from dsv4.kernels.triton import argmax, moe_tile_map, pick_slots
    from dsv4.kernels.triton import rope_rows as rr

    yield ("tile map (E 256, 6 slots)", moe_tile_map._tile_map_kernel,
           {"idx_ptr": "*i64", "order_ptr": "*i64", "ts_ptr": "*i32", "te_ptr": "*i32",
            "tx_ptr": "*i32"},
           {"E": 256, "BM": 16, "BLOCK_NK": 32, "BLOCK_E": 256, "CHUNK": 32},
           {"num_warps": 4})
    # its chunked form (from moe_tile_map.SPLIT_MIN_SLOTS slots): V4-Flash routing
    chunk = moe_tile_map.SPLIT_CHUNK
    yield ("tile map chunk histograms (E 256)", moe_tile_map._chunk_hist_kernel,
           {"idx_ptr": "*i64", "hist_ptr": "*i32"}, {"C": chunk, "BLOCK_E": 256},
           {"num_warps": 4})
    yield ("tile map chunk order (E 256)", moe_tile_map._chunk_order_kernel,
           {"idx_ptr": "*i64", "hist_ptr": "*i32", "order_ptr": "*i64", "ts_ptr": "*i32",
            "te_ptr": "*i32", "tx_ptr": "*i32"},
           {"E": 256, "BM": 16, "C": chunk, "ROWS": 16, "BLOCK_E": 256, "CHUNK": 32},
           {"num_warps": 8})
    yield ("pick slots (K 512)", pick_slots._pick_slots_kernel,
           {name: "*i64" for name in pick_slots._pick_slots_kernel.arg_names
            if name.endswith("_ptr")},
           {"BLOCK_T": 4, "BLOCK_K": 512}, {"num_warps": 4})
    yield ("argmax partials (fp32)", argmax._argmax_partial_kernel,
           {"x_ptr": "*fp32", "part_ptr": "*i64", "V": "i32:16", "stride_x": "i32:16"},
           {"BLOCK_V": argmax.BLOCK_V}, {"num_warps": 4})
    yield ("argmax final (32 chunks)", argmax._argmax_final_kernel,
           {"part_ptr": "*i64", "out_ptr": "*i64"}, {"BLOCK_C": 32}, {"num_warps": 4})
    # the indexer's queries over FP8 keys (Id 128, rd 64): RoPE, then e4m3 codes and a scale per
    # head, compiled as it launches (no FMA contraction)
    from dsv4.kernels.triton import rope_fp8
    yield ("rope fp8 (indexer q, D 128)", rope_fp8._rope_fp8_kernel,
           {"x_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "codes_ptr": "*fp8e4nv",
            "scales_ptr": "*fp32", "stride_xt": "i32:16", "stride_xh": "i32:16",
            "stride_cs": "i32:16"}, {"BLOCK_D": 128},
           {"num_warps": 1, "enable_fp_fusion": False})
    # a V4 step's four RoPE-row lookups (rd / 2 = 32) in one launch
    block_t, block_r = rr.rope_rows_blocks([32] * 4)
    yield ("rope rows (4 pairs, R 32)", rr._rope_rows_kernel,
           {name: "*i64" if name.startswith("pos") else "*fp32"
            for name in rr._rope_rows_kernel.arg_names if name.endswith("_ptr")},
           {"NPAIRS": 4, "R0": 32, "R1": 32, "R2": 32, "R3": 32, "BLOCK_T": block_t,
            "BLOCK_R": block_r}, {"num_warps": rr.NUM_WARPS})
    from dsv4.kernels.triton import hisparse as hs

    # HiSparse's copies of V4-Flash entries (D 512 bf16, one program per row): the swap-in reads
    # the pinned host mirror, the write stores into it (UVA pointers compile as any global)
    rows16 = {"D": "i32:16", "stride_host": "i32:16", "stride_dev": "i32:16",
              "stride_pool": "i32:16", "stride_val": "i32:16"}
    yield ("hisparse swap-in (D 512 bf16)", hs._swap_in_kernel,
           {"host_ptr": "*bf16", "dev_ptr": "*bf16", "src_ptr": "*i64", "dst_ptr": "*i64",
            **rows16}, {"BLOCK_D": 512, "EVEN_D": True}, {"num_warps": 2})
    yield ("hisparse write rows (D 512 bf16)", hs._write_rows_kernel,
           {"pool_ptr": "*bf16", "rows_ptr": "*i64", "val_ptr": "*bf16", **rows16},
           {"BLOCK_D": 512, "EVEN_D": True}, {"num_warps": 2})
    from dsv4.kernels.triton import hot_plan as hp

    # HiSparse's plan of V4-Flash (E 1024 hot slots): a select (k 512 picks) and the write of a
    # step's new entries (one pick, the D 512 bf16 values stored into the mirror and hot pool)
    plan_types = {name: "*i64" for name in hp._hot_plan_kernel.arg_names if name.endswith("_ptr")}
    plan_types |= {"e2s_ptr": "*i32", "s2e_ptr": "*i32", "val_ptr": "*bf16", "host_ptr": "*bf16",
                   "dev_ptr": "*bf16", "D": "i32:16", "stride_val": "i32:16",
                   "stride_host": "i32:16", "stride_dev": "i32:16"}
    for label, k, write in (("select k 512", 512, False), ("write (one pick, D 512)", 1, True)):
        yield (f"hot plan E 1024 {label}", hp._hot_plan_kernel, plan_types,
               {"BLOCK_K": max(16, k), "BLOCK_E": 1024, "STRICT": not write, "ONE_PICK": k == 1,
                "WRITE": write, "BLOCK_D": 512},
               {"num_warps": hp.plan_warps(1024, k == 1)})
    from dsv4.kernels.triton import moe_combine as mc

    # the MoE combine: 6 slots + bf16 shared -> bf16 (one process) / fp32 (before a TP reduce);
    # the atomic path's k = 1 form
    for topk, shared, out in ((6, True, "bf16"), (6, True, "fp32"), (6, False, "fp32"),
                              (1, True, "bf16")):
        yield (f"moe combine k{topk}{' +shared' if shared else ''} -> {out}",
               mc._combine_kernel,
               {"parts_ptr": "*fp32", "shared_ptr": "*bf16" if shared else "*fp32",
                "out_ptr": f"*{out}", "D": "i32:16", "stride_pn": "i32:16", "stride_pk": "i32:16",
                "stride_s": "i32:16", "stride_o": "i32:16"},
               {"TOPK": topk, "HAS_SHARED": shared, "BLOCK": mc.BLOCK_D},
               {"num_warps": mc.NUM_WARPS})
    from dsv4.kernels.triton import gemv
    from dsv4.kernels.triton import moe_gate_logits as gl

    # the gate's logits at decode: the GEMV on bf16 operands with fp32 sums out, E 256, d 4096
    block_n, splits = gl.gate_plan(256, 4096)
    for M in (1, 4):
        plan = gemv.plan_gemv(M, 256, 4096, torch.bfloat16, torch.bfloat16, 132,
                              block_n=block_n, split_k=splits, dot=False)
        split = gemv.even_split(4096 // plan.block_k, plan.split_k)[0]
        yield (f"moe gate logits bf16 -> fp32 E 256 d 4096 M={M}", gemv._gemv_kernel,
               gemv_types("bf16", "fp32"),
               {"BLOCK_M": gemv.block_m(M, False), "BLOCK_N": plan.block_n,
                "BLOCK_K": plan.block_k, "SPLIT_K": split, "NUM_STAGES": plan.num_stages,
                "DOT": False, "ROWS": M, "UPCAST": False, "PRECISION": plan.precision,
                "EVEN_K": True, "SWIGLU": False, "LIBDEVICE": True},
               {"num_warps": plan.num_warps, "num_stages": plan.num_stages})


def gemv_types(dt: str, out: str) -> dict[str, str]:
    """`gemv._gemv_kernel`'s argument types: x (and up) / w of `dt`, y of `out`; K, the row
    strides and the split length divisible by 16 (V4-Flash)."""
    return {"x_ptr": f"*{dt}", "u_ptr": f"*{dt}", "w_ptr": f"*{dt}", "y_ptr": f"*{out}",
            "part_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32:16",
            "stride_xm": "i32:16", "stride_um": "i32:16", "stride_wn": "i32:16",
            "k_per_split": "i32:16", "limit": "fp32"}


def gemv_variants() -> Iterator[Variant]:
    """The decode projections' skinny GEMM at its default plans (bf16 and fp32 weights; the FMA
    path at M 1 / 4, the tl.dot path at M 8 / 32; split-K on and off), then the shared expert's
    w2 at the `linear` op's decode plan (V4-Flash: I 2048 -> d 4096, bf16, M 1 / 4) plain and in
    the SwiGLU mode (`swiglu_linear`: the gate / up loads and the SwiGLU in the K loop)."""
    from dsv4.kernels.triton import gemv

    for dt, N, K in (("bf16", 4096, 4096), ("bf16", 32768, 1024), ("fp32", 2560, 4096)):
        torch_dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dt]
        for M in (1, 4, 8, 32):
            plan = gemv.plan_gemv(M, N, K, torch_dt, torch_dt, 132)
            consts = {"BLOCK_M": gemv.block_m(M, plan.dot), "BLOCK_N": plan.block_n,
                      "BLOCK_K": plan.block_k, "SPLIT_K": plan.split_k,
                      "NUM_STAGES": plan.num_stages, "DOT": plan.dot,
                      "ROWS": 0 if plan.dot else M, "UPCAST": dt == "fp32",
                      "PRECISION": plan.precision, "EVEN_K": K % plan.block_k == 0,
                      "SWIGLU": False, "LIBDEVICE": True}
            path = "dot" if plan.dot else "fma"
            options = {"num_warps": plan.num_warps, "num_stages": plan.num_stages}
            yield (f"gemv {dt} {N}x{K} M={M} {path} s{plan.split_k}", gemv._gemv_kernel,
                   gemv_types(dt, dt), consts, options)
            if M == 1:      # PDL's EARLY mode (pdl.py)
                yield (f"gemv {dt} {N}x{K} M={M} {path} s{plan.split_k} early",
                       gemv._gemv_kernel, gemv_types(dt, dt), {**consts, "PDL": pdl.EARLY},
                       {**options, "launch_pdl": True})
    N, K = 4096, 2048
    for M in (1, 4):
        plan = gemv.plan_gemv(M, N, K, torch.bfloat16, torch.bfloat16, 132,
                              block_n=DECODE_BLOCK_N, split_k=K // gemv.DECODE_SPLIT_K, dot=False)
        for swiglu in (False, True):
            consts = {"BLOCK_M": gemv.block_m(M, False), "BLOCK_N": plan.block_n,
                      "BLOCK_K": plan.block_k, "SPLIT_K": plan.split_k,
                      "NUM_STAGES": plan.num_stages, "DOT": False, "ROWS": M, "UPCAST": False,
                      "PRECISION": plan.precision, "EVEN_K": True, "SWIGLU": swiglu,
                      "LIBDEVICE": True}
            label = "swiglu+gemv" if swiglu else "gemv"
            yield (f"{label} w2 bf16 {N}x{K} M={M} fma s{plan.split_k}", gemv._gemv_kernel,
                   gemv_types("bf16", "bf16"), consts,
                   {"num_warps": plan.num_warps, "num_stages": plan.num_stages})
    yield from project_variants()


def project_variants() -> Iterator[Variant]:
    """The compressors' `project` op (`project.py`) at its pinned plans on a checkpoint-format
    model's bf16 weights (V4-Flash CSA group: 2560 x 4096; bf16 x, fp32 y): FMA at M 1 / 4, the
    tl.dot path at M 8 / 32 (bf16 operands: exact MMA products, tf32x3 unused)."""
    from dsv4.kernels.triton import gemv, project

    N, K = 2560, 4096
    for M in (1, 4, 8, 32):
        fma = M <= gemv.FMA_MAX_M
        block_n, splits = ((project.PROJECT_BLOCK_N, project.PROJECT_SPLITS) if fma
                           else (project.PROJECT_DOT_BLOCK_N, project.PROJECT_DOT_SPLITS))
        plan = gemv.plan_gemv(M, N, K, torch.bfloat16, torch.bfloat16, 132, block_n=block_n,
                              split_k=splits, dot=not fma,
                              precision=None if fma else "tf32x3")
        consts = {"BLOCK_M": gemv.block_m(M, plan.dot), "BLOCK_N": plan.block_n,
                  "BLOCK_K": plan.block_k, "SPLIT_K": plan.split_k, "NUM_STAGES": plan.num_stages,
                  "DOT": plan.dot, "ROWS": 0 if plan.dot else M, "UPCAST": False,
                  "PRECISION": plan.precision, "EVEN_K": K % plan.block_k == 0, "SWIGLU": False,
                  "LIBDEVICE": True}
        yield (f"project bf16 w {N}x{K} M={M} {'fma' if fma else 'dot'} s{plan.split_k}",
               gemv._gemv_kernel, gemv_types("bf16", "fp32"), consts,
               {"num_warps": plan.num_warps, "num_stages": plan.num_stages})


def fp8_linear_variants() -> Iterator[Variant]:
    """The checkpoint-format FP8 linears at their default plans (bf16 x; the FMA path at M 1 / 4,
    swap-AB tl.dot at M 8 / 32, tiled tl.dot at M 512), and the shared expert's w2 (4096 x 2048)
    in the SwiGLU mode on the FMA path (M 1 / 4)."""
    from dsv4.kernels.triton import fp8_linear as f8
    from dsv4.kernels.triton import fp8_plan

    shapes = [(N, K, M, False) for N, K in ((1536, 4096), (32768, 1024), (4096, 8192))
              for M in (1, 4, 8, 32, 512)] + [(4096, 2048, M, True) for M in (1, 4)]
    for N, K, M, swiglu in shapes:
        plan = fp8_plan.plan_fp8_linear(M, N, K, 132)
        if swiglu:          # the SwiGLU mode runs unpipelined (`triton_fp8_linear`)
            plan = dataclasses.replace(plan, num_stages=1)
        splits, per = f8.even_split(triton.cdiv(K, fp8_plan.BLOCK * plan.kb), plan.split_k)
        types = {"x_ptr": "*bf16", "u_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*u8",
                 "y_ptr": "*bf16", "part_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32",
                 "K": "i32:16", "stride_xm": "i32:16", "stride_xg": "i32:16",
                 "stride_um": "i32:16", "rows_g": "i32:16", "stride_wn": "i32:16",
                 "stride_sn": "i32", "k_per_split": "i32:16", "limit": "fp32"}
        consts = {"BLOCK_M": plan.block_m, "BLOCK_N": plan.block_n, "KB": plan.kb,
                  "SPLIT_K": splits, "NUM_STAGES": plan.num_stages, "DOT": plan.dot,
                  "ROWS": 0 if plan.dot else M, "FP32_DOT": False,
                  "EVEN_K": K % (fp8_plan.BLOCK * plan.kb) == 0, "SWIGLU": swiglu,
                  "LIBDEVICE": True}
        path = "dot" if plan.dot else "fma swiglu" if swiglu else "fma"
        options = {"num_warps": plan.num_warps, "num_stages": plan.num_stages}
        yield (f"fp8_linear {N}x{K} M={M} {path} s{splits}", f8._fp8_linear_kernel, types,
               consts, options)
        if M == 1 and not swiglu:   # PDL's EARLY mode (pdl.py)
            yield (f"fp8_linear {N}x{K} M={M} {path} s{splits} early", f8._fp8_linear_kernel,
                   types, {**consts, "PDL": pdl.EARLY}, {**options, "launch_pdl": True})
    yield from fp8_frag_variants()
    yield from fp8_linear_a8_variants()


def fp8_frag_variants() -> Iterator[Variant]:
    """The FP8 linear's tensor-core decode path (`fp8_frag.py`, M <= 8) at BLOCK_N 16 / 32 / 64
    (1 / 2 / 4 warps), split-K on."""
    from dsv4.kernels.triton import fp8_frag

    types = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*u8", "y_ptr": "*bf16",
             "part_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32:16",
             "stride_xm": "i32:16", "stride_xg": "i32:16", "rows_g": "i32:16",
             "stride_wn": "i32:16", "stride_sn": "i32", "steps_per_split": "i32"}
    for wn in (1, 2, 4):
        yield (f"fp8_linear frag {16 * wn} rows s4", fp8_frag._fp8_frag_kernel, types,
               {"WN": wn, "SPLIT_K": 4, "ASM": True}, {"num_warps": wn})


def fp8_linear_a8_variants() -> Iterator[Variant]:
    """The W8A8 linear (`fp8_linear_a8.py`) at its default tiles (BLOCK_M 64 / 128 x BLOCK_N 128:
    QGMMA) and a BLOCK_M 16 tile (mma.sync), bf16 out."""
    from dsv4.kernels.triton import fp8_linear_a8 as a8

    types = {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "s_ptr": "*u8",
             "y_ptr": "*bf16",
             "M": "i32", "N": "i32", "K": "i32:16", "stride_x": "i32:16", "stride_xs": "i32",
             "stride_w": "i32:16", "stride_s": "i32", "stride_y": "i32:16"}
    for bm, bn, warps in ((64, 128, 4), (128, 128, 8), (16, 128, 4)):
        consts = {"FP32_DOT": False, "Y_BF16": True, "BLOCK_M": bm, "BLOCK_N": bn,
                  "GROUP_M": a8.GROUP_M}
        yield (f"fp8_linear_a8 {bm}x{bn}x128", a8._fp8_linear_a8_kernel, types, consts,
               {"num_warps": warps, "num_stages": 3})


def mhc_variants() -> Iterator[Variant]:
    """mHC pre / head at decode (V4-Flash: n 4, d 4096; T 1 on 132 SMs): the one-launch split-K
    kernel (bf16 / fp32 x pre, bf16 head; a knob, `one_launch=True`), the default two-launch
    pair (bf16 pre), and the post + projection launch of `mhc_post_pre` at each BLOCK_D its plan
    picks for T = 1..8."""
    from dsv4.kernels.triton import mhc, mhc_post_pre, mhc_split

    T, n, d, warps = 1, 4, 4096, 4
    cpu = torch.device("cpu")                   # the plans below are the H200's at T = 1
    bt, S, _ = mhc.plan_pre(T, n * d, cpu, splits=2 * 132)
    tiles = mhc_split.plan_one_launch(T, d, 4, S, warps, cpu, one_launch=True)
    assert tiles is not None, "a split-K decode plan"
    fbt, _, bd, bs = tiles
    ints = {"T": "i32", "K": "i32:16", "D": "i32:16", "S": "i32", "k_per_split": "i32:16",
            "iters": "i32", "hc_eps": "fp32", "norm_eps": "fp32", "stride_xt": "i32:16",
            "stride_fn": "i32:16", "stride_ht": "i32:16", "d_span": "i32:16"}
    for dt, head in (("bf16", False), ("fp32", False), ("bf16", True)):
        types = {**ints, "x_ptr": f"*{dt}", "h_ptr": f"*{dt}", "cnt_ptr": "*i32",
                 **{p: "*fp32" for p in ("fn_ptr", "ws_ptr", "sq_ptr", "scale_ptr", "base_ptr",
                                         "post_ptr", "comb_ptr")}}
        geo = {"N": n, "NP": 4, "HEAD": head}
        dot = {"BLOCK_K": 64, "EVEN_K": True, "INTERPRET": False,
               "DOT": "bf16x3" if dt == "bf16" else "tf32x3"}
        label = f"mhc {'head' if head else 'pre'} {dt} T={T} s{S}"
        yield (f"{label} one launch", mhc_split._mhc_one_launch_kernel, types,
               {**geo, **dot, "BLOCK_T": bt, "FINISH_T": fbt, "BLOCK_S": bs, "BLOCK_D": bd,
                "EVEN_D": True}, {"num_warps": warps, "num_stages": 3})
        if dt == "bf16" and not head:
            yield (f"{label} partial", mhc_split._mhc_partial_kernel, types,
                   {**geo, **dot, "BLOCK_T": bt}, {"num_warps": warps, "num_stages": 3})
            fbt, _, fbd, fbs = mhc_split.plan_finish(T, d, 4, S, cpu, spans=16)
            for apart in (False, True):
                yield (f"{label} finish{' apart' if apart else ''}",
                       mhc_split._mhc_finish_kernel, types,
                       {**geo, "BLOCK_T": fbt, "BLOCK_S": fbs, "BLOCK_D": fbd, "EVEN_D": True,
                        "APART": apart}, {"num_warps": mhc_split.finish_warps(fbt, 4, fbd)})
    yield from mhc_prefill_finish_variants(ints)
    post_types = {**ints, **{p: "*bf16" for p in ("f_ptr", "x_ptr", "out_ptr")},
                  **{p: "*fp32" for p in ("post_ptr", "comb_ptr", "fn_ptr", "ws_ptr", "sq_ptr")},
                  "stride_ft": "i32:16"}
    for bd in (32, 64, 128):
        yield (f"mhc post+project bf16 BLOCK_D={bd}", mhc_post_pre._post_project_kernel,
               post_types, {"N": n, "NP": 4, "BLOCK_D": bd, "EVEN_D": True},
               {"num_warps": mhc_post_pre._warps(bd)})


def mhc_prefill_finish_variants(ints: dict[str, str]) -> Iterator[Variant]:
    """The bf16 pre's finish as its plans launch it on 132 SMs (H100 / H200) at short prefills
    (one-token tiles of 64 splits, BLOCK_D 512..2048, weights apart: a [BLOCK_T] stream weight
    converted at every multiply once took minutes to compile there) and at a full chunk."""
    from dsv4.kernels.triton import mhc, mhc_split

    n, d = 4, 4096
    types = {**ints, "x_ptr": "*bf16", "h_ptr": "*bf16",
             **{p: "*fp32" for p in ("ws_ptr", "sq_ptr", "scale_ptr", "base_ptr", "post_ptr",
                                     "comb_ptr")}}
    cpu = torch.device("cpu")
    with mock.patch.object(mhc, "sms", lambda _: 132), \
            mock.patch.object(mhc_split, "sms", lambda _: 132):
        plans = [(T, *_finish_plan(T, n, d, cpu)) for T in (40, 100, 200, 8192)]
    for T, S, tiles, apart in plans:
        fbt, _, bd, bs = tiles
        yield (f"mhc pre bf16 T={T} s{S} finish t{fbt} d{bd} s{bs}{' apart' if apart else ''}",
               mhc_split._mhc_finish_kernel, types,
               {"N": n, "NP": 4, "HEAD": False, "BLOCK_T": fbt, "BLOCK_S": bs, "BLOCK_D": bd,
                "EVEN_D": True, "APART": apart},
               {"num_warps": mhc_split.finish_warps(fbt, 4, bd)})


def _finish_plan(T: int, n: int, d: int, device: torch.device
                 ) -> tuple[int, tuple[int, int, int, int], bool]:
    """(splits, finish tiles, weights apart) of the pre's default plan at T tokens."""
    from dsv4.kernels.triton import mhc, mhc_split

    S = mhc.plan_pre(T, n * d, device)[1]
    tiles = mhc_split.plan_finish(T, d, 4, S, device)
    return S, tiles, mhc_split.plan_apart(False, d, tiles)


KERNELS: dict[str, Callable[[], Iterator[Variant]]] = {"moe": moe_variants,
                                                       "topk": topk_variants,
                                                       "compressor": compressor_variants,
                                                       "attention": attention_variants,
                                                       "metadata": metadata_variants,
                                                       "small": small_variants,
                                                       "gemv": gemv_variants,
                                                       "fp8_linear": fp8_linear_variants,
                                                       "mhc": mhc_variants}
# parts of a KERNELS group, to compile alone
PARTS: dict[str, Callable[[], Iterator[Variant]]] = {"moe_frag": moe_frag_variants}


def distinct_paths(variants: Iterator[Variant]) -> Iterator[Variant]:
    """The first variant of each code path: variants that differ only in tile sizes (`BLOCK_*`
    constexprs but BLOCK_M, of which only "16-bit wgmma possible" (>= 64) or not is kept), warps,
    stages or register caps compile the same code for other shapes, and the CPU test compiles one
    of them (the full list is the script's default)."""
    seen: set[tuple[Any, ...]] = set()
    for variant in variants:
        _, kernel, types, consts, options = variant
        path = {k: v for k, v in consts.items() if not k.startswith("BLOCK_") or k == "BLOCK_M"}
        if "BLOCK_M" in path:
            path["BLOCK_M"] = path["BLOCK_M"] >= 64
        key = (kernel, tuple(sorted(types.items())), tuple(sorted(map(repr, path.items()))),
               tuple(sorted((k, v) for k, v in options.items()
                            if k not in ("num_warps", "num_stages", "maxnreg"))))
        if key not in seen:
            seen.add(key)
            yield variant


def sass_counts(cubin: bytes) -> dict[str, int]:
    """Static SASS instruction / LDG / HMMA (mma.sync) / HGMMA (16-bit wgmma) / QGMMA (FP8 wgmma)
    counts, the instructions of the longest loop body (the K loop of a GEMM: its cost per step;
    -1 without a loop), and registers and spill bytes per thread.

    Read with the `nvdisasm` and `cuobjdump` that ship with Triton's NVIDIA backend.
    """
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        lines = subprocess.run([str(tools / "nvdisasm"), "-c", f.name], capture_output=True,
                               text=True, check=True).stdout
        usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
    instr = [line for line in lines.splitlines() if line.strip().startswith("/*") and "*/" in line]
    regs = re.search(r"REG:(\d+)", usage)
    spill = re.search(r"STACK:(\d+)", usage)
    return {"instr": len(instr), "LDG": sum("LDG" in x for x in instr),
            "HMMA": sum("HMMA" in x for x in instr), "HGMMA": sum("HGMMA" in x for x in instr),
            "QGMMA": sum("QGMMA" in x for x in instr),
            "loop": longest_loop(lines.splitlines()),
            "regs": int(regs.group(1)) if regs else -1,
            "stack": int(spill.group(1)) if spill else -1}


def longest_loop(lines: list[str]) -> int:
    """Instructions between a label and the furthest backward branch to it (nvdisasm -c text)."""
    index: dict[str, int] = {}
    branches: list[tuple[int, str]] = []
    count = 0
    for line in lines:
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            index[label.group(1)] = count
        elif line.strip().startswith("/*") and "*/" in line:
            target = re.search(r"BRA.*`\((\.L_x_\d+)\)", line)
            if target:
                branches.append((count, target.group(1)))
            count += 1
    # NOTE: `index < at`: a branch to itself is the trap loop after EXIT, not a loop body
    spans = [at - index[name] + 1 for at, name in branches if index.get(name, at) < at]
    return max(spans, default=-1)


def compile_variant(kernel: Any, types: dict[str, str], consts: dict[str, Any],
                    options: dict[str, int]) -> Any:
    """Compile for sm_90 with the JIT's divisibility hints.

    Pointers and ":16"-typed integers are marked divisible by 16 (see the module docstring). A
    kernel with the `PDL` constexpr compiles as it launches on the H200 by default: PDL in WAIT
    mode (`kernels/triton/pdl.py`), unless the variant sets it.
    """
    if "PDL" in kernel.arg_names and "PDL" not in consts:
        consts, options = {**consts, "PDL": pdl.WAIT}, {**options, "launch_pdl": True}
    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, name in enumerate(kernel.arg_names):
        if name in consts:
            signature[name] = "constexpr"
            continue
        kind, _, hint = types.get(name, "i32").partition(":")
        signature[name] = kind
        if kind.startswith("*") or hint == "16":
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", default=",".join(KERNELS),
                   help=f"comma-separated, of {sorted(KERNELS)} or a part: {sorted(PARTS)} "
                   "(moe_frag: moe's frag loop)")
    p.add_argument("--distinct", action="store_true",
                   help="one variant per code path (`distinct_paths`: the CPU test's selection)")
    args = p.parse_args()
    sys.stdout.write(f"triton {triton.__version__}, target sm_90\n")
    failed = 0
    for group in args.kernels.split(","):
        variants = {**KERNELS, **PARTS}[group]()
        for label, kernel, types, consts, options in (
                distinct_paths(variants) if args.distinct else variants):
            start = time.perf_counter()
            try:
                compiled = compile_variant(kernel, types, consts, options)
            except Exception as exc:  # noqa: BLE001 — report every variant, then fail
                failed += 1
                sys.stdout.write(f"{label:<44} COMPILE ERROR: "
                                 f"{str(exc).splitlines()[0] if str(exc) else exc!r}\n")
                continue
            seconds = time.perf_counter() - start
            c = sass_counts(compiled.asm["cubin"])
            sys.stdout.write(f"{label:<44} instr {c['instr']:>6}  LDG {c['LDG']:>4}  "
                             f"HMMA {c['HMMA']:>3}  HGMMA {c['HGMMA']:>3}  QGMMA {c['QGMMA']:>3}  "
                             f"loop {c['loop']:>5}  "
                             f"shared {compiled.metadata.shared:>6} B  "
                             f"regs {c['regs']:>3}  stack {c['stack']:>4} B  "
                             f"compile {seconds:>5.1f} s\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
