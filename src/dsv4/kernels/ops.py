"""The signatures of the kernel ops: one Protocol per op of `KernelOps` (`kernels/registry.py`).

Every backend implements each op with exactly this signature (mypy checks `ref` and `triton`
against it), and the `ref` function named in each docstring is its executable specification: a
fast version must return what the reference returns (to rounding where the docstring of its test
says so). Shapes use T tokens of one serving step, H query heads, D head dim, E experts, V
candidates per query.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from dsv4.kernels.ref.compressor import CompressIndex, CompressTarget


class SparseAttentionOp(Protocol):
    """`ref/attention.py::sparse_attention_multi`: one softmax (with a per-head sink) over the union
    of several key buffers; q [T, H, D], sources [(kv [N_i, D], indices [T, K_i])] -> o [T, H, D];
    with `inverse_rope` = (cos, sin) [T, rd/2], o de-rotated (`rope_inverse`) in the same op.
    """

    def __call__(self, q: Tensor, sources: Sequence[tuple[Tensor, Tensor]], sink: Tensor,
                 scale: float, *,
                 inverse_rope: tuple[Tensor, Tensor] | None = None) -> Tensor: ...


class CompressOp(Protocol):
    """`ref/compressor.py::compress_cached`: one serving step of a compressor, in place (entries of
    the windows completed by this step's tokens into `out`, this step's ring rows into the rings).
    `ape`: the gate scores' position embedding, added per source slot as the step pools (raw
    scores and rings); None: the scores and rings include it already."""

    def __call__(self, kv: Tensor, score: Tensor, ring_kv: Tensor, ring_score: Tensor,
                 index: CompressIndex, norm_weight: Tensor, eps: float, cos: Tensor, sin: Tensor,
                 out: Tensor, *, ape: Tensor | None = None) -> None: ...


class CompressPairOp(Protocol):
    """`ref/compressor.py::compress_cached_pair`: a CSA layer's attention and indexer compressors,
    which share one step's index and entry positions, in place."""

    def __call__(self, first: CompressTarget, second: CompressTarget, index: CompressIndex,
                 eps: float, cos: Tensor, sin: Tensor) -> None: ...


class ProjectOp(Protocol):
    """`ref/compressor.py::project`: the compressors' fp32 projections, x [T, k] (any float dtype)
    @ w [n, k]^T (fp32, or bf16 in a checkpoint-format model) -> [T, n] fp32, both operands taken
    as their fp32 values."""

    def __call__(self, x: Tensor, w: Tensor) -> Tensor: ...


class IndexScoresOp(Protocol):
    """`ref/indexer.py::paged_index_scores`: q [T, Ih, Id], weights [T, Ih], keys [N, Id],
    candidates [T, V] pool slots (-1 = none) -> scores [T, V] fp32, -inf where there is no
    candidate. The heads' weights are `weights.float() * weight_scale` (an fp32 multiply, the
    same bits as a caller passing that product with the default 1.0): `weights` of any float
    dtype, any row stride, unit column stride (the raw `weights_proj` output, a column slice of
    the layer's fused GEMM output on the serving path). `key_scales` [N] fp32: the keys are
    FP8 codes (`ref/index_keys.py`), each key's values its codes times its scale; `q_scales`
    [T, Ih] fp32 (with FP8 keys only): q is float8_e4m3fn codes too, each head's values its
    codes times its scale (`rope_fp8`'s output)."""

    def __call__(self, q: Tensor, weights: Tensor, keys: Tensor, candidates: Tensor, *,
                 weight_scale: float = 1.0, key_scales: Tensor | None = None,
                 q_scales: Tensor | None = None) -> Tensor: ...


class TopKOp(Protocol):
    """`ref/topk.py::topk_ragged`: scores [B, N], lengths [B] -> the k best column ids of each row
    among its first lengths[b] columns, ascending, -1 padded ([B, k] int64; lower index wins ties).
    """

    def __call__(self, scores: Tensor, lengths: Tensor, k: int) -> Tensor: ...


class PickSlotsOp(Protocol):
    """`ref/indexer.py::pick_slots`: top-k picks [T, K] and candidates [T, V] -> (entry ids,
    pool slots), each [T, K] int64, -1 = none."""

    def __call__(self, picks: Tensor, candidates: Tensor) -> tuple[Tensor, Tensor]: ...


class MoeGateLogitsOp(Protocol):
    """`ref/moe.py::moe_gate_logits`: u [N, d] times the gate weight [E, d]^T -> [N, E] fp32
    (products exact for 16-bit operands). `counters`: the call site's zeroed int32 split-K
    arrival counters (>= E / 16 words, left zero), ignored by the reference; without them every
    backend runs the reference."""

    def __call__(self, u: Tensor, weight: Tensor, *, counters: Tensor | None = None) -> Tensor: ...


class RoutedExpertsOp(Protocol):
    """`ref/moe.py::routed_experts`: x [N, d] through the experts `indices` [N, k] picks (weights
    [N, k]) of the float stacks w1, w3 [E, I, d] and w2 [E, d, I], plus the optional `shared`
    addend [N, d] in fp32 -> [N, d] `out_dtype`; `wait_shared` is called once before `shared` is
    read (the caller's stream join)."""

    def __call__(self, x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, indices: Tensor,
                 weights: Tensor, limit: float, *, shared: Tensor | None = None,
                 out_dtype: torch.dtype = torch.float32,
                 wait_shared: Callable[[], None] | None = None) -> Tensor: ...


class RoutedExpertsQuantOp(Protocol):
    """`ref/moe.py::routed_experts_quant`: `routed_experts` on checkpoint-format experts (w13 / w2
    codes and UE8M0 scales in format `fmt`: "fp4", "fp8" or "bf16") -> [N, d] `out_dtype`
    (`shared`, `wait_shared`: as `RoutedExpertsOp`'s)."""

    def __call__(self, x: Tensor, w13: Tensor, w13_scale: Tensor | None, w2: Tensor,
                 w2_scale: Tensor | None, indices: Tensor, weights: Tensor, limit: float,
                 fmt: str, *, shared: Tensor | None = None,
                 out_dtype: torch.dtype = torch.float32,
                 wait_shared: Callable[[], None] | None = None) -> Tensor: ...


class MhcPreOp(Protocol):
    """`ref/mhc.py::mhc_pre`: x [T, n, d] -> (block input h [T, d], post [T, n], comb [T, n, n])."""

    def __call__(self, x: Tensor, fn: Tensor, scale: Tensor, base: Tensor, n: int, iters: int,
                 hc_eps: float, norm_eps: float) -> tuple[Tensor, Tensor, Tensor]: ...


class MhcPostOp(Protocol):
    """`ref/mhc.py::mhc_post`: block output f [T, d] and old streams x [T, n, d] -> new streams."""

    def __call__(self, f: Tensor, x: Tensor, post: Tensor, comb: Tensor) -> Tensor: ...


class MhcPostPreOp(Protocol):
    """`ref/mhc.py::mhc_post_pre`: a post step, then the next site's pre on the new streams ->
    (X' [T, n, d], h [T, d], post' [T, n], comb' [T, n, n])."""

    def __call__(self, f: Tensor, x: Tensor, post: Tensor, comb: Tensor, fn: Tensor,
                 scale: Tensor, base: Tensor, n: int, iters: int, hc_eps: float,
                 norm_eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]: ...


class MhcHeadOp(Protocol):
    """`ref/mhc.py::mhc_head`: the final collapse of the streams x [T, n, d] -> [T, d]."""

    def __call__(self, x: Tensor, fn: Tensor, scale: Tensor, base: Tensor, hc_eps: float,
                 norm_eps: float) -> Tensor: ...


class QNormRopeOp(Protocol):
    """`ref/rope_norm.py::q_norm_rope`: q [T, H, D] -> RoPE(q / rms(q)) per head."""

    def __call__(self, q: Tensor, cos: Tensor, sin: Tensor, eps: float) -> Tensor: ...


class KvNormRopeStoreOp(Protocol):
    """`ref/rope_norm.py::kv_norm_rope_store`: in place, pool[slots] = RoPE(weight*kv / rms(kv))."""

    def __call__(self, kv: Tensor, weight: Tensor, eps: float, cos: Tensor, sin: Tensor,
                 pool: Tensor, slots: Tensor) -> None: ...


class QkvNormRopeOp(Protocol):
    """`ref/rope_norm.py::qkv_norm_rope`: `q_norm_rope` of q [T, H, D] (returned) and
    `kv_norm_rope_store` of kv [T, D] into pool[slots], as one op (one launch in Triton)."""

    def __call__(self, q: Tensor, eps: float, kv: Tensor, weight: Tensor, kv_eps: float,
                 cos: Tensor, sin: Tensor, pool: Tensor, slots: Tensor) -> Tensor: ...


class RmsNormOp(Protocol):
    """`ref/rope_norm.py::rms_norm`: weight * x / rms(x) over the last dim, in x's dtype."""

    def __call__(self, x: Tensor, weight: Tensor, eps: float) -> Tensor: ...


class CompressSpec(NamedTuple):
    """The host integers of one compress ratio's step plan (`StepMetadataOp`).

    `ring`: compressor ring rows per SWA page; `ring_trash`, `entry_trash`: the trash rows of the
    ring and of the compressed-entry pool; `num_visible`: V, the candidate columns per token."""

    ratio: int
    overlap: bool
    ring: int
    ring_trash: int
    entry_trash: int
    num_visible: int


class CompressRows(NamedTuple):
    """One ratio's index rows (the fields of `model/forward_context.py::CompressPlan`); int64 but
    `from_new` / `src_valid` (bool). S = 2 * ratio (overlap) or ratio."""

    src_new: Tensor      # [T, S]
    src_ring: Tensor     # [T, S]
    from_new: Tensor     # [T, S] bool
    src_valid: Tensor    # [T, S] bool
    write_slot: Tensor   # [T]
    entry_pos: Tensor    # [T]
    ring_write: Tensor   # [T]
    candidates: Tensor   # [T, V]
    visible: Tensor      # [T]


class StepRows(NamedTuple):
    """A step's device metadata: positions, SWA write slots and windows, one `CompressRows` per
    `CompressSpec` (same order). int64."""

    positions: Tensor    # [T]
    swa_write: Tensor    # [T]
    window: Tensor       # [T, W]
    plans: tuple[CompressRows, ...]


class StepMetadataOp(Protocol):
    """`ref/metadata.py::step_metadata`: a step's index rows from the request rows `slots`,
    `starts`, `lens` [B] int64 (request b feeds positions [starts[b], starts[b] + lens[b]), T =
    `num_tokens` = sum of lens) and the paged tables `page_table` [R, max_pages] and `full_to_swa`
    [N] (int64); no host sync, CUDA-graph capturable. Bit-equal across backends."""

    def __call__(self, slots: Tensor, starts: Tensor, lens: Tensor, page_table: Tensor,
                 full_to_swa: Tensor, page_size: int, num_tokens: int, window: int,
                 specs: Sequence[CompressSpec]) -> StepRows: ...


class RopeOp(Protocol):
    """`ref/rope_norm.py::rope`: x [T, H, D] -> RoPE on the trailing rd channels of each head, no
    norm (the indexer's queries); cos / sin [T, rd/2] fp32. Bit-equal across backends."""

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor: ...


class RopeFp8Op(Protocol):
    """`ref/rope_norm.py::rope_fp8`: `rope` of x [T, H, D], then each head quantised as an FP8
    indexer key is (`ref/index_keys.py`) -> (float8_e4m3fn codes [T, H, D], power-of-two scales
    [T, H] fp32): the indexer's queries over FP8 keys (`index_scores`' `q_scales`). Bit-equal
    across backends."""

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]: ...


# (cache, positions) pairs one `rope_rows` call takes: a V4 step's main and compress tables at the
# step's positions and the compress table at each of its (at most two) ratios' entry positions
ROPE_ROWS_MAX_PAIRS = 4


class RopeRowsOp(Protocol):
    """`ref/rope_rows.py::rope_rows`: per (cache [2, P, R] fp32 contiguous, positions [*S] int64)
    pair, at most `ROPE_ROWS_MAX_PAIRS` of them, (cos, sin) [*S, R] fp32, each contiguous: the
    cache rows `RotaryEmbedding.lookup` gathers. No host sync, CUDA-graph capturable. Bit-equal
    across backends."""

    def __call__(self, pairs: Sequence[tuple[Tensor, Tensor]]
                 ) -> tuple[tuple[Tensor, Tensor], ...]: ...


class ArgmaxOp(Protocol):
    """`ref/argmax.py::argmax`: x [B, V] float -> [B] int64, each row's first (lowest-index)
    maximum, a NaN counting as the largest value (`torch.argmax(x, dim=-1)`); bit-equal across
    backends. The greedy sampler's token choice."""

    def __call__(self, x: Tensor) -> Tensor: ...
class MoeGateSelectOp(Protocol):
    """`ref/moe.py::moe_gate_select`: the gate's fp32 logits [N, E], bias [E] or None, hashed /
    replayed ids [N, k] or None, k, route_scale -> (expert ids [N, k] int64, weights [N, k] fp32).
    """

    def __call__(self, logits: Tensor, bias: Tensor | None, hashed: Tensor | None,
                 replayed: Tensor | None, k: int,
                 route_scale: float) -> tuple[Tensor, Tensor]: ...


class SwigluOp(Protocol):
    """`ref/moe.py::swiglu`: silu(min(gate, limit)) * clamp(up, -limit, limit), gate and up of one
    shape and dtype (the shared expert's [N, I])."""

    def __call__(self, gate: Tensor, up: Tensor, limit: float) -> Tensor: ...


class SwigluLinearOp(Protocol):
    """`ref/moe.py::swiglu_linear`: the shared expert's w2 projection of its SwiGLU, gate, up
    [N, I] (one shape and dtype; e.g. the two column halves of a fused w1 | w3 output) and w
    [d, I] -> `linear(swiglu(gate, up, limit), w)` [N, d] in gate's dtype. `counters`: w's call
    site's zeroed int32 split-K arrival counters (>= d / 16 words, left zero), ignored by the
    reference; without them every backend runs its `swiglu` op, then `F.linear`."""

    def __call__(self, gate: Tensor, up: Tensor, limit: float, w: Tensor, *,
                 counters: Tensor | None = None) -> Tensor: ...


class QuantLinearOp(Protocol):
    """`ref/fp8_linear.py::fp8_linear`: x [..., K] through a checkpoint-format FP8 linear (w
    [N, K] e4m3 codes, scale [ceil(N/128), ceil(K/128)] UE8M0 codes) -> [..., N] in x's dtype.
    `groups` g > 1: the block-diagonal product (attention `wo_a`), x [..., g, K] -> [..., g, N /
    g], group i through weight rows [i N / g, (i + 1) N / g) (whole scale blocks for the kernel).
    `counters`: the call site's zeroed int32 split-K arrival counters (>= N / 16 words, left zero;
    the kernel's, so that no call pays a memset), ignored by the reference. `up` (SwiGLU mode,
    the shared expert's w2; groups 1): x is the gate and the input `swiglu(x, up, limit)`, the
    values of the `swiglu` op then this op (the triton kernel computes it as it loads x)."""

    def __call__(self, x: Tensor, w: Tensor, scale: Tensor, *, groups: int = 1,
                 counters: Tensor | None = None, up: Tensor | None = None,
                 limit: float = 0.0) -> Tensor: ...


# the `linear` op's output columns per program on its skinny-GEMM path: a call site's counters
# hold one word per DECODE_BLOCK_N rows of the weight (`model/decode_gemv.py` sizes them)
DECODE_BLOCK_N = 16


class LinearOp(Protocol):
    """`ref/fp8_linear.py::dense_linear`: x [..., K] @ w [N, K]^T -> [..., N] in x's dtype (the
    serving path's bf16 projections). `counters`: the call site's zeroed int32 split-K arrival
    counters (>= N / 16 words, left zero), ignored by the reference; without them every backend
    runs `F.linear`."""

    def __call__(self, x: Tensor, w: Tensor, *, counters: Tensor | None = None) -> Tensor: ...


class HotPlanOp(Protocol):
    """`ref/hot_plan.py::hot_plan_ref`: HiSparse's plan of one C4 layer, in place on its maps
    e2s [R + 1, M + 1] int32, s2e / stamp [R + 1, E + 1] int32 / int64 and the clock [] int64
    (incremented): the picks [T, k] of request slots slot_ids [T] made hot (LRU); returns (hot
    rows [T, k], host rows src [T * k], hot rows dst [T * k]) int64 of the copies to make, -1 for
    none. `strict` adds (picks, placed misses, unplaced misses) to counters [3] int64. The Triton
    op needs distinct slots (but the pad slot R) and distinct picks per row."""

    def __call__(self, e2s: Tensor, s2e: Tensor, stamp: Tensor, clock: Tensor, slot_ids: Tensor,
                 picks: Tensor, page_table: Tensor, page_entries: int, counters: Tensor,
                 strict: bool) -> tuple[Tensor, Tensor, Tensor]: ...


class HotWriteOp(Protocol):
    """`ref/hot_plan.py::hot_write_ref`: HiSparse's write of new entries in one call, in place:
    the plan of one pick per row (entries [T] of request slots slot_ids [T], strict off) on the
    maps and clock as `HotPlanOp`, then values [T, D] stored into host_pool [N_host, D] at each
    entry's mirror row and into device_pool [N_dev, D] at its hot row, if placed; pad-slot rows
    store nothing. The host pool may be pinned CPU memory beside CUDA values. The Triton op needs
    distinct slots (but the pad slot R)."""

    def __call__(self, e2s: Tensor, s2e: Tensor, stamp: Tensor, clock: Tensor, slot_ids: Tensor,
                 entries: Tensor, page_table: Tensor, page_entries: int, values: Tensor,
                 host_pool: Tensor, device_pool: Tensor) -> None: ...


class SwapInOp(Protocol):
    """`ref/hisparse.py::swap_in_ref`: HiSparse's swap-in, in place: device_pool [N_dev + 1, D]
    row dst_slots[i] = host_pool [N_host, D] row src_entries[i] for every dst_slots[i] >= 0
    (src ignored where dst is -1; the non-negative dst distinct), cast to the device pool's dtype.
    The host pool may be pinned CPU memory beside a CUDA device pool."""

    def __call__(self, host_pool: Tensor, device_pool: Tensor, src_entries: Tensor,
                 dst_slots: Tensor) -> None: ...


class WriteRowsOp(Protocol):
    """`ref/hisparse.py::write_rows_ref`: HiSparse's write to the host mirror, in place: pool
    [N, D] row rows[i] = values [n, D] row i for every rows[i] >= 0 (repeated rows with equal
    values), cast to the pool's dtype. The pool may be pinned CPU memory beside CUDA values."""

    def __call__(self, pool: Tensor, rows: Tensor, values: Tensor) -> None: ...
