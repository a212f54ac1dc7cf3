"""The MoE combine: `triton_moe_combine` vs `ref.moe.moe_combine`, and the routed-expert ops with
their `shared` addend, `out_dtype` and `wait_shared` (spec §8).

CPU: the Triton interpreter (fp32 -> bf16 casts rounded to nearest even, as on the GPU): the
kernel is bit-equal to the reference (k 1 / 2 / 6, d with a ragged last block, fp32 / bf16 shared
and out, no shared), the slots are summed in ascending order, validation; the ops add `shared` in
fp32 and cast once, calling `wait_shared` once; the MoE layer's output is the old formula's bit for
bit on the reference path, and under a non-identity `reduce` (tensor parallelism) the reduction
gets the fp32 sum and the cast follows it.
GPU (`-m gpu`): V4-Flash shapes (d 4096, k 6; N = 1, 8, 32), bit-equal to the reference, rows
independent of N, the routed op with its combine inside a CUDA graph.

    PYTHONPATH=src python -m pytest -q tests/kernels/test_moe_combine.py
"""

from __future__ import annotations

import os

import torch

# NOTE: must precede the first `import triton` (tests/kernels/conftest.py may already do this).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
from test_moe_quant import make_weights  # noqa: E402
from torch import nn  # noqa: E402

import dsv4.kernels.triton.moe as triton_moe  # noqa: E402
import dsv4.model.moe as moe_module  # noqa: E402
from dsv4.checkpoint.presets import micro  # noqa: E402
from dsv4.kernels.ref.moe import SharedJoin, add_shared, moe_combine, routed_experts  # noqa: E402
from dsv4.kernels.registry import REF  # noqa: E402
from dsv4.kernels.triton.moe import (  # noqa: E402
    triton_routed_experts,
    triton_routed_experts_quant,
)
from dsv4.kernels.triton.moe_combine import triton_moe_combine  # noqa: E402
from dsv4.model.forward_mode import INFERENCE  # noqa: E402
from dsv4.model.moe import MoE  # noqa: E402

pytestmark = pytest.mark.usefixtures("round_bf16_to_nearest_even")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator(DEVICE).manual_seed(seed), device=DEVICE)


@pytest.mark.parametrize("N,k,d", [(1, 6, 64), (5, 2, 1100), (3, 1, 37)])
@pytest.mark.parametrize("shared", [None, "fp32", "bf16"])
@pytest.mark.parametrize("out", ["fp32", "bf16"])
def test_combine_bit_equal_to_reference(N: int, k: int, d: int, shared: str | None,
                                        out: str) -> None:
    parts = randn(N, k, d, seed=N * k)
    sh = None if shared is None else (randn(N, d, seed=1) * 4).to(DTYPES[shared])
    got = triton_moe_combine(parts, sh, DTYPES[out])
    want = moe_combine(parts, sh, DTYPES[out])
    assert got.dtype == DTYPES[out] and got.shape == (N, d)
    assert torch.equal(got, want)


def test_combine_sums_slots_in_ascending_order() -> None:
    """Slots (1, 2^25, -2^25): ascending order absorbs the 1 ((1 + 2^25) rounds to 2^25) and gives
    0; any order that adds the large pair first gives 1. Shared 0.5 comes last."""
    parts = torch.tensor([1.0, 2.0 ** 25, -(2.0 ** 25)], device=DEVICE).view(1, 3, 1)
    parts = parts.expand(2, 3, 8).contiguous()
    shared = torch.full((2, 8), 0.5, device=DEVICE)
    for fn in (triton_moe_combine, moe_combine):
        assert torch.equal(fn(parts, None, torch.float32), torch.zeros(2, 8, device=DEVICE))
        assert torch.equal(fn(parts, shared, torch.float32), shared)


def test_combine_strided_and_empty() -> None:
    """A parts view with a row stride (the slots of a wider buffer) and a non-contiguous shared
    read the right elements; N = 0 gives an empty result."""
    wide = randn(4, 3, 40, seed=3)
    parts = wide[:, :, :32]
    sh = randn(32, 4, seed=4).t()
    assert torch.equal(triton_moe_combine(parts, sh, torch.float32),
                       moe_combine(parts, sh, torch.float32))
    assert triton_moe_combine(randn(0, 2, 8), None, torch.bfloat16).shape == (0, 8)


def test_combine_validation() -> None:
    parts = randn(2, 3, 8)
    with pytest.raises(ValueError, match="parts must be"):
        triton_moe_combine(parts.double(), None, torch.float32)
    with pytest.raises(ValueError, match="unit stride"):
        triton_moe_combine(randn(2, 8, 3).transpose(1, 2), None, torch.float32)
    with pytest.raises(ValueError, match="shared must be"):
        triton_moe_combine(parts, randn(2, 7), torch.float32)
    with pytest.raises(ValueError, match="out_dtype"):
        triton_moe_combine(parts, None, torch.int32)


def _experts(E: int, d: int, inter: int, N: int, k: int) -> tuple[torch.Tensor, ...]:
    w1, w3 = randn(E, inter, d, seed=1) * d ** -0.5, randn(E, inter, d, seed=2) * d ** -0.5
    w2 = randn(E, d, inter, seed=3) * inter ** -0.5
    x = randn(N, d, seed=4)
    g = torch.Generator(DEVICE).manual_seed(5)
    idx = torch.stack([torch.randperm(E, generator=g, device=DEVICE)[:k] for _ in range(N)]
                      ) if N else torch.zeros(0, k, dtype=torch.int64, device=DEVICE)
    rw = torch.rand(N, k, generator=g, device=DEVICE)
    return x, w1, w2, w3, idx, rw


@pytest.mark.parametrize("out", ["fp32", "bf16"])
def test_routed_ops_add_shared_and_cast(out: str) -> None:
    """Each op with `shared` and `out_dtype` equals its own fp32 result + shared, cast once (the
    Triton combine bit for bit: its fp32 slot sum is the op's plain result); `wait_shared` runs
    once per call."""
    x, w1, w2, w3, idx, rw = _experts(5, 32, 48, 7, 3)
    sh = (randn(7, 32, seed=9) * 2).to(torch.bfloat16)
    calls: list[int] = []
    kw = {"shared": sh, "out_dtype": DTYPES[out], "wait_shared": lambda: calls.append(1)}
    plain = triton_routed_experts(x, w1, w2, w3, idx, rw, 1.5)
    assert torch.equal(triton_routed_experts(x, w1, w2, w3, idx, rw, 1.5, **kw),
                       add_shared(plain, sh, DTYPES[out]))
    ref = routed_experts(x, w1, w2, w3, idx, rw, 1.5)
    assert torch.equal(routed_experts(x, w1, w2, w3, idx, rw, 1.5, **kw),
                       (ref + sh.float()).to(DTYPES[out]))
    w13 = torch.cat((w1, w3), dim=1).contiguous()
    atomic = triton_routed_experts_quant(x, w13, None, w2, None, idx, rw, 1.5, "bf16", **kw)
    torch.testing.assert_close(atomic, (ref + sh.float()).to(DTYPES[out]), rtol=1e-2, atol=1e-2)
    assert calls == [1, 1, 1]


def test_routed_op_no_tokens_adds_shared() -> None:
    x, w1, w2, w3, idx, rw = _experts(4, 16, 32, 0, 2)
    sh = randn(0, 16)
    out = triton_routed_experts(x, w1, w2, w3, idx, rw, 1.0, shared=sh, out_dtype=torch.bfloat16)
    assert out.shape == (0, 16) and out.dtype == torch.bfloat16


class _Double(nn.Module):
    """A stand-in for the tensor-parallel all-reduce: records its input dtype, returns 2 x."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.dtype)
        return 2 * x


def _moe(dtype: torch.dtype) -> tuple[MoE, torch.Tensor, torch.Tensor]:
    config = micro()
    torch.manual_seed(0)
    moe = MoE(config, "routed", layer_id=2).to(DEVICE)
    for p in moe.parameters():
        nn.init.normal_(p, std=config.hidden_size ** -0.5)
    moe = moe.to(dtype)
    x = randn(2, 5, config.hidden_size, seed=6).to(dtype)
    ids = torch.randint(0, config.vocab_size, (2, 5), device=DEVICE)
    return moe, x, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_reference_path_unchanged(dtype: torch.dtype) -> None:
    """The reference path gives what the layer computed before the combine moved into the op:
    (routed + shared.float()).to(x.dtype), bit for bit; under a non-identity reduce the reduction
    sees the fp32 sum and the cast comes after it."""
    moe, x, ids = _moe(dtype)
    with torch.no_grad():
        u = x.reshape(-1, x.shape[-1])
        idx, w = moe.gate(u, ids.reshape(-1))
        routed = moe.experts(u, idx, w, mode=INFERENCE)
        total = routed + moe.shared_experts(u).float()
        assert routed.dtype == torch.float32
        assert torch.equal(moe(x, ids, mode=INFERENCE), total.to(dtype).view_as(x))
        moe.reduce = _Double()
        assert torch.equal(moe(x, ids, mode=INFERENCE), (2 * total).to(dtype).view_as(x))
        assert moe.reduce.seen == [torch.float32]


@pytest.mark.parametrize("fmt", ["bf16", "fp4"])
def test_triton_op_joins_where_told(monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    """A `SharedJoin` runs before the expert GEMMs, or with `beside_gemms` after them and before
    the combine (a plain callable: before the GEMMs); the values are the same either way. One
    token, k 1 (FP4: the frag loop's one-slot programs), d = I = 32."""
    events: list[str] = []
    for name in ("mma_launches", "frag_launches", "fma_launches"):
        launch = getattr(triton_moe, name)
        monkeypatch.setattr(triton_moe, name, lambda *a, _f=launch, **k: (
            events.append("gemms"), _f(*a, **k))[1])
    combine = triton_moe.triton_moe_combine
    monkeypatch.setattr(triton_moe, "triton_moe_combine", lambda *a, **k: (
        events.append("combine"), combine(*a, **k))[1])
    x, w1, w2, w3, idx, rw = _experts(8, 32, 32, 1, 1)
    sh = randn(1, 32, seed=9).to(torch.bfloat16)
    kw = {"shared": sh, "out_dtype": torch.bfloat16}
    if fmt == "bf16":
        def run(**k: object) -> torch.Tensor:
            return triton_routed_experts(x, w1, w2, w3, idx, rw, 1.5, **kw, **k)
    else:
        codes = make_weights(8, 32, 32, "fp4", seed=31)

        def run(**k: object) -> torch.Tensor:
            return triton_routed_experts_quant(x.to(torch.bfloat16), *codes, idx, rw, 1.5, "fp4",
                                               deterministic=True, **kw, **k)
    plain = run()
    for beside in (False, True):
        events.clear()
        joined = run(wait_shared=SharedJoin(lambda: events.append("join"), beside))
        want = ["gemms", "join", "combine"] if beside else ["join", "gemms", "combine"]
        assert events == want and torch.equal(joined, plain), beside
    events.clear()
    run(wait_shared=lambda: events.append("join"))
    assert events == ["join", "gemms", "combine"]


@pytest.mark.parametrize("beside", [None, False, True])
def test_moe_forks_the_shared_expert_where_told(monkeypatch: pytest.MonkeyPatch,
                                                beside: bool | None) -> None:
    """With a side stream the shared expert is forked before the gate (its join called before
    the expert GEMMs) or, in forwards within `shared_beside_max_tokens`, after the gate (a
    `SharedJoin` with
    `beside_gemms`); without one (None) it runs first in program order. Same output always."""
    events: list[str] = []

    @contextlib.contextmanager
    def side(stream: object) -> Iterator[None]:
        events.append("fork" if stream is not None else "inline")
        yield

    monkeypatch.setattr(moe_module, "side", side)
    monkeypatch.setattr(moe_module, "join", lambda stream: events.append("join"))
    moe, x, ids = _moe(torch.float32)
    for part in ("gate", "shared_experts"):
        forward = getattr(moe, part).forward
        monkeypatch.setattr(getattr(moe, part), "forward", lambda *a, _f=forward, _p=part, **k: (
            events.append(_p), _f(*a, **k))[1])
    joins: list[object] = []

    def routed(*a: object, wait_shared: object = None, **k: object) -> torch.Tensor:
        joins.append(wait_shared)
        return REF.routed_experts(*a, wait_shared=wait_shared, **k)  # type: ignore[arg-type]

    ctx = SimpleNamespace(ops=SimpleNamespace(**{n: getattr(REF, n) for n in (
        "moe_gate_logits", "moe_gate_select", "swiglu")}, routed_experts=routed),
        side_stream=None if beside is None else "side",
        shared_beside_max_tokens=x.shape[0] * x.shape[1] if beside else x.shape[0] * x.shape[1] - 1,
        captured=None)
    with torch.no_grad():
        want = moe(x, ids, mode=INFERENCE)
        events.clear()
        got = moe(x, ids, ctx)  # type: ignore[arg-type]
    assert torch.equal(got, want)
    order = {None: ["inline", "shared_experts", "gate"],
             False: ["fork", "shared_experts", "gate", "join"],
             True: ["gate", "fork", "shared_experts", "join"]}[beside]
    assert events == order
    assert joins[0] is None if beside is None else (
        isinstance(joins[0], SharedJoin) and joins[0].beside_gemms is beside)


# ---- GPU: V4-Flash shapes ------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 8, 32])
def test_flash_combine(N: int) -> None:
    parts = randn(32, 6, 4096, seed=11)
    sh = randn(32, 4096, seed=12).to(torch.bfloat16)
    batch = triton_moe_combine(parts, sh, torch.bfloat16)
    got = triton_moe_combine(parts[:N], sh[:N], torch.bfloat16)
    assert torch.equal(got, moe_combine(parts[:N], sh[:N], torch.bfloat16))
    assert torch.equal(got, batch[:N])


@pytest.mark.gpu
def test_flash_routed_combine_graph() -> None:
    """The routed op with its combine (and a wait that joins a side stream) captured in a CUDA
    graph replays to the eager result of new routing."""
    x, w1, w2, w3, idx, rw = _experts(256, 4096, 256, 8, 6)
    x, w1, w2, w3 = (t.to(torch.bfloat16) for t in (x, w1, w2, w3))
    sh = randn(8, 4096, seed=13).to(torch.bfloat16)
    side = torch.cuda.Stream()

    def run() -> torch.Tensor:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            shared = sh * 2
        return triton_routed_experts(
            x, w1, w2, w3, idx, rw, 10.0, shared=shared, out_dtype=torch.bfloat16,
            wait_shared=lambda: torch.cuda.current_stream().wait_stream(side))

    eager = run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    idx.copy_(torch.flip(idx, dims=(0,)))
    graph.replay()
    want = run()
    assert torch.equal(out, want) and not torch.equal(out, eager)
