"""Quantised routed experts at prefill: the layer decoded to bf16 a chunk of experts at a time,
beside the bf16 loop's GEMMs on the previous chunk.

At prefill sizes every expert is hit and reads its weights for many rows, and the in-register
decode of the FP4 loop costs more than the MMAs it feeds: a V4-Flash layer at N = 8192 tokens takes
23.2 ms in the FP4 loop against 8.7 ms for the bf16 loop on bf16 weights, and decoding the whole
layer to bf16 8.1 ms (H100, benchmarks/results/quant_moe_h200_202612.md). The decode is
memory-bound and the bf16 GEMMs compute-bound, so here they may overlap (they share the GPU rather
than hide each other, since the GEMMs read the decoded bytes back: the op runs at about decode +
GEMMs, 1.27-1.29x the FP4 loop's speed at N = 8192):

    for chunk c of `chunk` experts [lo, hi):
        decode stream: decode w13[lo:hi], w2[lo:hi] -> bf16 buffer c % 2   (`dequant.py`)
        GEMM stream:   wait for that decode; gate/up and down of the bf16 loop over the experts
                       [lo, hi) alone (`moe_tile_map.py::expert_rows`), reading the buffer

Ordering (no host sync): the decode stream and the GEMM stream (`_Streams`) first wait for the
caller's stream (inputs written, buffers and outputs allocated); a chunk's GEMMs wait for its
decode; a buffer is decoded into again only after the GEMMs that read it; the caller's stream
waits for both streams at the end (the buffers are freed on the caller's stream after that).
Nothing is allocated on the side streams. On a CPU (the interpreter) there are no streams and the
same steps run in order.

Values: the decode is bit-equal to the codec, and every tile of the bf16 loop is computed as in one
launch over the whole decoded layer (the tile map and the plan do not depend on the chunk), so the
result equals the bf16 loop on the dequantised weights bit for bit, whatever `chunk` is; against
the quantised loop it differs by fp32 summation order only.

Scratch: two buffers of `chunk` experts, 2 * chunk * 3 * I * d * 2 bytes (V4-Flash: 100.7 MB per
expert of chunk, 3.2 GB at chunk 32). Test: tests/kernels/test_moe_dequant.py. Benchmark:
benchmarks/kernels/bench_moe_prefill.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from dsv4.kernels.triton.dequant import triton_dequant_fp4_group, triton_dequant_fp8_block

FMTS = ("fp4", "fp8")
_FP8_BLOCK = 128

# (w13 bf16 [n, 2I, d], w2 bf16 [n, d, I], lo, hi): the bf16 GEMMs of experts [lo, hi), n = hi - lo
ChunkGemms = Callable[[torch.Tensor, torch.Tensor, int, int], None]


def check_dequant(fmt: str, inter: int, chunk: int) -> None:
    """Raise unless `fmt` experts with intermediate size `inter` can take this path in chunks of
    `chunk` experts."""
    if fmt not in FMTS:
        raise ValueError(f"dequant_chunk needs quantised experts; allowed fmt: {FMTS}; got {fmt!r}")
    if chunk < 1:
        raise ValueError(f"dequant_chunk must be >= 1 (0: the quantised loop); got {chunk}")
    if fmt == "fp8" and inter % _FP8_BLOCK:
        # w13's scale is cat(s1, s3) by block rows: one block grid over [2I, d] only when I is
        # whole blocks
        raise ValueError(f"fp8 dequant_chunk needs I a multiple of {_FP8_BLOCK}; got I = {inter}")


def scratch_bytes(chunk: int, num_experts: int, inter: int, d: int) -> int:
    """Bytes of the two bf16 buffers (one when a single chunk covers the layer)."""
    chunk = min(chunk, num_experts)
    buffers = 1 if chunk == num_experts else 2
    return buffers * chunk * 3 * inter * d * 2


def dequant_chunks(w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                   fmt: str, chunk: int, gemms: ChunkGemms) -> None:
    """Decode the stacks w13 [E, 2I, *] / w2 [E, d, *] (codes and scales as `moe.py` documents
    them per `fmt`; the caller has run `check_dequant`) to bf16 `chunk` experts at a time,
    calling `gemms` on each decoded chunk while the next chunk decodes (module docstring)."""
    E, i2 = w13.shape[:2]
    d = w2.shape[1]
    chunk = min(chunk, E)
    decode = triton_dequant_fp4_group if fmt == "fp4" else triton_dequant_fp8_block
    n_buf = 1 if chunk == E else 2
    bufs = [(torch.empty(chunk, i2, d, dtype=torch.bfloat16, device=w13.device),
             torch.empty(chunk, d, i2 // 2, dtype=torch.bfloat16, device=w13.device))
            for _ in range(n_buf)]
    with _Streams(w13.device) as streams:
        for c, lo in enumerate(range(0, E, chunk)):
            hi = min(lo + chunk, E)
            b13, b2 = (b[: hi - lo] for b in bufs[c % n_buf])
            with streams.decoding(c % n_buf):
                decode(w13[lo:hi], s13[lo:hi], torch.bfloat16, out=b13)
                decode(w2[lo:hi], s2[lo:hi], torch.bfloat16, out=b2)
            with streams.multiplying(c % n_buf):
                gemms(b13, b2, lo, hi)


class _Streams:
    """The fork / join of `dequant_chunks` (module docstring): decodes on one side stream, GEMMs
    on another of high priority, so that the GEMMs' programs are scheduled first and the decode's
    fill the SMs' room beside them (at equal priority the two grids ran one after the other: H100,
    benchmarks/results/quant_moe_h200_202612.md). Off CUDA every method runs its block in place."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.caller = torch.cuda.current_stream(device) if self.cuda else None
        self.decode = torch.cuda.Stream(device) if self.cuda else None
        self.gemm = torch.cuda.Stream(device, priority=-1) if self.cuda else None
        self.decoded: dict[int, torch.cuda.Event] = {}
        self.released: dict[int, torch.cuda.Event] = {}

    def __enter__(self) -> _Streams:
        if self.caller is not None:
            for s in (self.decode, self.gemm):
                assert s is not None
                s.wait_stream(self.caller)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.caller is not None:
            for s in (self.decode, self.gemm):
                assert s is not None
                self.caller.wait_stream(s)

    @contextmanager
    def decoding(self, buf: int) -> Iterator[None]:
        """Run the block on the decode stream, after the GEMMs that last read buffer `buf`."""
        if self.decode is None:
            yield
            return
        if buf in self.released:
            self.decode.wait_event(self.released[buf])
        with torch.cuda.stream(self.decode):
            yield
        self.decoded[buf] = self.decode.record_event()

    @contextmanager
    def multiplying(self, buf: int) -> Iterator[None]:
        """Run the block on the GEMM stream, after buffer `buf`'s decode; the next decode into
        `buf` waits for what the block issued."""
        if self.gemm is None:
            yield
            return
        self.gemm.wait_event(self.decoded[buf])
        with torch.cuda.stream(self.gemm):
            yield
        self.released[buf] = self.gemm.record_event()
