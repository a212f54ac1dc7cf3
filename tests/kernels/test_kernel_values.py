"""Forward values from the serving kernels, gradients from the reference (`model/kernel_values.py`,
`ForwardMode.values`), and the token-count-invariant launch plans they rely on
(`create_kernels(..., invariant_plans=True)`). Kernels run under the Triton interpreter on CPU."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import random_model
from dsv4.config.engine import EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.kernels.ref.batch_invariant import batch_invariant
from dsv4.kernels.registry import create_kernels
from dsv4.model.forward_mode import INFERENCE, TRAINING
from dsv4.model.kernel_values import kernel_values
from dsv4.model.moe import MLP, Gate
from dsv4.rl.algorithms import logprob_abs_diff
from dsv4.rl.batch import pack
from dsv4.rl.objective import sequence_logprobs
from dsv4.rl.rollout import sample_token_ids

needs_triton = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a CUDA GPU or the Triton interpreter")


def test_values_from_fast_gradients_from_ref() -> None:
    """The value is fast's (deliberately off here), the gradient ref's, for every input that
    needs one; a tuple output whose second part gets no gradient is fine."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, generator=gen, requires_grad=True)
    w = torch.randn(5, generator=gen, requires_grad=True)
    idx = torch.tensor([2, 0, 1])

    def ref(x_: torch.Tensor, w_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = (x_ * w_).sum(-1)
        return y[idx], y.detach() * 0

    def fast(x_: torch.Tensor, w_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, z = ref(x_, w_)
        return y + 0.25, z

    y, _ = kernel_values(fast, ref, x, w)
    assert torch.equal(y, ref(x, w)[0] + 0.25)
    (y * torch.arange(3.0)).sum().backward()
    gx, gw = torch.autograd.grad((ref(x, w)[0] * torch.arange(3.0)).sum(), (x, w))
    assert torch.equal(x.grad, gx) and torch.equal(w.grad, gw)
    with torch.no_grad():                                      # scoring: no graph, same values
        assert torch.equal(kernel_values(fast, ref, x, w)[0], y.detach())


@pytest.mark.slow  # the micro model's forward and backward under the Triton interpreter: ~15 s
@needs_triton
@pytest.mark.parametrize(("base", "batch", "seq_len"), [(INFERENCE, 2, 17), (TRAINING, 1, 12)],
                         ids=["inference", "training-no-hca-entry"])
def test_forward_with_kernel_values_matches_formulation(base, batch: int, seq_len: int) -> None:
    """Logits within fp32 rounding of the formulation's, and gradients of every parameter group
    the kernels cover (attention, compressors, mHC, experts, norms) within rounding too: the ops
    are wired to the right inputs and their gradients flow through the reference. 17 tokens
    complete one HCA window (ratio 16) and leave a CSA tail (ratio 4); 12 complete no HCA window:
    an empty entry set."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = random_model(micro(), torch.float32, device, seed=3)
    ids = torch.randint(2, 512, (batch, seq_len), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    ops = create_kernels("triton", invariant_plans=True)
    grads = {}
    for name, mode in (("ref", base), ("values", base.with_values(ops))):
        model.zero_grad(set_to_none=True)
        logits = model(ids, mode)
        logits.float().logsumexp(-1).mean().backward()
        grads[name] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                         if p.grad is not None})
    (la, ga), (lb, gb) = grads["ref"], grads["values"]
    torch.testing.assert_close(lb, la, rtol=0, atol=1e-4)
    assert ga.keys() == gb.keys()
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], rtol=1e-3, atol=1e-5, msg=n)
    for part in ("attn_sink", "hc_attn.fn", "experts.w2", "attn_norm.weight", "q_norm.weight",
                 "compressor.wkv", "compressor.ape", "kv_norm.weight", "hc_head.fn",
                 "gate.weight", "shared_experts.w1", "shared_experts.w3"):
        assert any(part in n and gb[n].abs().sum() > 0 for n in gb), f"no gradient for {part}"


@needs_triton
@pytest.mark.parametrize("moe_type", ["routed", "hash"])
@pytest.mark.parametrize("replay", [False, True], ids=["live", "replayed"])
def test_gate_and_shared_expert_values_with_reference_gradients(moe_type: str,
                                                                replay: bool) -> None:
    """The MoE gate and the shared expert under `ForwardMode.values` against the reference: the same
    expert ids, the ops' weights and SwiGLU values (within the interpreter's rounding), gradients
    of the shared expert's w1 / w3 equal to the reference's bit for bit (the backward is the
    reference's at the same inputs; the loss is linear in the outputs, so the upstream gradients
    agree exactly too), and of u and the gate weight within 1e-5 (equal today: the logits are
    `F.linear` in both)."""
    config = micro()
    gen = torch.Generator().manual_seed(4)
    gate, mlp = Gate(config, moe_type), MLP(config.hidden_size, config.moe_inter_dim, 1.5)
    E, k, d, N = config.n_routed_experts, config.num_experts_per_tok, config.hidden_size, 9
    with torch.no_grad():
        gate.weight.copy_(torch.randn(E, d, generator=gen) * 0.3)
        if gate.bias is not None:
            gate.bias.copy_(torch.randn(E, generator=gen) * 0.1)
        if gate.tid2eid is not None:
            gate.tid2eid.copy_(torch.stack([torch.randperm(E, generator=gen)[:k]
                                            for _ in range(config.vocab_size)]))
        for lin in (mlp.w1, mlp.w2, mlp.w3):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) * 0.3)
    u = torch.randn(N, d, generator=gen, requires_grad=True)
    ids = torch.randint(0, config.vocab_size, (N,), generator=gen)
    replayed = None
    if replay:
        replayed = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)])
        replayed[3] = -1
    cw, cy = torch.randn(N, k, generator=gen), torch.randn(N, d, generator=gen)
    ops = create_kernels("triton")
    got = {}
    for name, values in (("ref", None), ("values", ops)):
        u.grad = None
        gate.zero_grad(set_to_none=True)
        mlp.zero_grad(set_to_none=True)
        indices, weights = gate(u, ids, replayed, None, values)
        y = mlp(u, None, values)
        ((weights * cw).sum() + (y * cy).sum()).backward()
        got[name] = (indices, weights.detach(), y.detach(), u.grad, gate.weight.grad,
                     mlp.w1.weight.grad, mlp.w3.weight.grad)
    (ia, wa, ya, *ga), (ib, wb, yb, *gb) = got["ref"], got["values"]
    assert torch.equal(ia, ib)
    torch.testing.assert_close(wb, wa, rtol=2e-7, atol=3e-7)
    torch.testing.assert_close(yb, ya, rtol=1e-5, atol=1e-6)
    for i, (a, b) in enumerate(zip(ga, gb, strict=True)):
        assert a is not None and b is not None
        if i < 2:       # u, gate weight: through the gate's logits
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(a, b)


@needs_triton
def test_invariant_plans_do_not_depend_on_the_token_count() -> None:
    """mHC pre / head and sparse attention under the invariant plans: each token's row is the same
    bits alone, in a 70-token call and (attention) with trailing -1 index columns."""
    ops = create_kernels("triton", invariant_plans=True)
    gen = torch.Generator().manual_seed(2)
    T, n, d = 70, 4, 64
    x = torch.randn(T, n, d, generator=gen)
    fn, scale, base = torch.randn(24, n * d, generator=gen) * 0.1, torch.ones(3), torch.zeros(24)
    full = ops.mhc_pre(x, fn, scale, base, n, 3, 1e-6, 1e-6)
    head = ops.mhc_head(x, fn[:n], scale[:1], base[:n], 1e-6, 1e-6)
    for t in (0, 33, 69):
        alone = ops.mhc_pre(x[t:t + 1], fn, scale, base, n, 3, 1e-6, 1e-6)
        assert all(torch.equal(a[0], b[t]) for a, b in zip(alone, full, strict=True))
        assert torch.equal(ops.mhc_head(x[t:t + 1], fn[:n], scale[:1], base[:n], 1e-6, 1e-6)[0],
                           head[t])
    q, kv = torch.randn(T, 4, 32, generator=gen), torch.randn(200, 32, generator=gen)
    idx = torch.randint(-1, 200, (T, 24), generator=gen)
    sink = torch.zeros(4)
    out = ops.sparse_attention(q, [(kv, idx)], sink, 0.2)
    padded = ops.sparse_attention(q, [(kv, torch.nn.functional.pad(idx, (0, 40), value=-1))],
                                  sink, 0.2)
    assert torch.equal(out, padded)
    for t in (0, 69):
        assert torch.equal(ops.sparse_attention(q[t:t + 1], [(kv, idx[t:t + 1])], sink, 0.2)[0],
                           out[t])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("true_on_policy", [True, False], ids=["true-on-policy", "default"])
def test_trainer_with_kernel_values_scores_like_the_engine_cuda(true_on_policy: bool) -> None:
    """bf16 micro model on the GPU, triton backend with invariant plans and CUDA graphs: the
    engine samples with routing and indexer capture; the full-sequence forward with values from
    the same kernels and the recorded selections gives the engine's sampling log-probs exactly
    when both sides also run batch-invariant GEMMs and reductions (`--true-on-policy`), and within
    the cuBLAS GEMMs' last bits without them (the RL default)."""
    model = random_model(micro(), torch.bfloat16, torch.device("cuda"), seed=4)
    engine = LLMEngine(model, EngineConfig(
        page_size=16, max_running_requests=8, max_total_tokens=2048, kernel_backend="triton",
        capture_routing=True, disable_prefix_cache=True, batch_invariant=true_on_policy,
        invariant_plans=True))
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 512, (n,), generator=gen).tolist() for n in (21, 37, 70)]
    numerics = batch_invariant if true_on_policy else contextlib.nullcontext
    with numerics():
        samples = sample_token_ids(engine, prompts, 2, 1.0, 12, seed=0)
    batch = pack(samples, torch.zeros(len(samples)), routing=True, indexer=True).to("cuda")
    assert batch.replay is not None
    mode = INFERENCE.with_replay(batch.replay).with_values(engine.runner.ops)
    with torch.no_grad(), numerics():
        logp, _ = sequence_logprobs(model, batch.inputs, batch.targets, mode, 1.0)
    mean, top = (float(v) for v in logprob_abs_diff(logp, batch.rollout_logp, batch.mask))
    if true_on_policy:
        assert (mean, top) == (0.0, 0.0)
    else:
        assert mean < 5e-3, (mean, top)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_query_values_are_the_serving_rope_op(dtype: torch.dtype) -> None:
    """With `values`, the full-sequence indexer's roped queries are the `rope` op's on per-token
    cos / sin rows, as `Indexer.forward_cached` computes them (bit for bit), and equal the torch
    RoPE (the op is bit-equal to it); gradients flow through the reference."""
    from dsv4.model.indexer import Indexer
    from dsv4.model.layers.rope import RotaryEmbedding, token_rows

    config = micro()
    ops = create_kernels("triton", invariant_plans=True)
    indexer = Indexer(config).to(dtype)
    gen = torch.Generator().manual_seed(6)
    B, S = 2, 5
    x = torch.randn(B, S, config.hidden_size, generator=gen).to(dtype)
    q_lat = torch.randn(B, S, config.q_lora_rank, generator=gen).to(dtype)
    cos, sin = RotaryEmbedding(config, compressed=True)(torch.arange(S))
    q_ref, w_ref = indexer.query(x, q_lat, cos, sin)
    q_val, w_val = indexer.query(x, q_lat, cos, sin, ops)
    H, D = indexer.n_heads, indexer.head_dim
    serving = ops.rope(indexer.wq_b(q_lat).reshape(B * S, H, D), *token_rows(cos, sin, B))
    assert torch.equal(q_val, serving.view(B, S, H, D)) and torch.equal(w_val, w_ref)
    if dtype == torch.float32:       # the interpreter truncates to bf16 where torch rounds
        assert torch.equal(q_val, q_ref)
    probe = torch.randn(q_val.shape, generator=gen)         # a loss linear in q: same gradient
    (q_val.float() * probe).sum().backward()
    grad = indexer.wq_b.weight.grad.clone()
    indexer.zero_grad()
    (q_ref.float() * probe).sum().backward()
    assert torch.equal(grad, indexer.wq_b.weight.grad)
