"""Tests for dsv4.engine.sampler: greedy, seeded reproducibility, the hash RNG, the exact
filtered distributions (chi-square), penalties and raw logprobs.

Expected distributions are written from the definitions in float64 here, independently of
the sampler's implementation.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor

from dsv4.engine.sampler import (
    SamplingBatch,
    apply_penalties,
    argmax_only,
    hash_uniform,
    sample,
)
from dsv4.engine.sampling_params import SamplingParams

# Chi-square critical values at p = 0.001, indexed by degrees of freedom.
CHI2_CRIT_P001 = {
    1: 10.828,
    2: 13.816,
    3: 16.266,
    4: 18.467,
    5: 20.515,
    6: 22.458,
    7: 24.322,
    8: 26.124,
    9: 27.877,
    10: 29.588,
    11: 31.264,
    12: 32.909,
    13: 34.528,
    14: 36.123,
    15: 37.697,
}
NUM_DRAWS = 20_000
VOCAB = 12


def _batch(
    params: list[SamplingParams], steps: list[int] | None = None, seeds: list[int] | None = None
) -> SamplingBatch:
    steps = steps if steps is not None else [0] * len(params)
    seeds = seeds if seeds is not None else list(range(len(params)))
    return SamplingBatch.build(params, steps, seeds, "cpu")


def _small_logits() -> Tensor:
    # [V]; 4-7 tokens survive each filter
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(2)) * 1.5


# --------------------------------------------------------------------------- greedy


def test_greedy_is_argmax() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0)] * 4 + [SamplingParams(temperature=0.7, top_k=1)] * 4
    batch = _batch(params)
    assert batch.all_greedy
    out = sample(logits, batch)
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))


@pytest.mark.parametrize(("kwargs", "plain"), [
    ({"temperature": 0.0}, True),
    ({"temperature": 0.9, "top_k": 1}, True),
    ({"temperature": 0.0, "top_p": 0.5, "min_p": 0.1}, True),     # filters of sampled rows only
    ({"temperature": 0.0, "prompt_logprobs": 2}, True),            # the prompt's rows, not these
    ({"temperature": 0.7}, False),
    ({"temperature": 0.0, "logprobs": 0}, False),
    ({"temperature": 0.0, "repetition_penalty": 1.2}, False),
    ({"temperature": 0.0, "frequency_penalty": 0.5}, False),
    ({"temperature": 0.0, "presence_penalty": 0.5}, False),
    ({"temperature": 0.0, "logit_bias": ((3, 5.0),)}, False),
])
def test_argmax_only_exactly_when_sample_is_the_argmax(kwargs: dict[str, object],
                                                       plain: bool) -> None:
    """`argmax_only` (the engine then skips the sampling batch) holds only where `sample` returns
    the raw logits' argmax and nothing else; a row that breaks it anywhere breaks the batch."""
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(4))
    logits[:, 3] = logits.max(dim=1).values - 0.1   # a bias of +5 on token 3 changes the argmax
    params = [SamplingParams(temperature=0.0), SamplingParams(**kwargs),  # type: ignore[arg-type]
              SamplingParams(temperature=0.0, top_k=1)]
    assert argmax_only(params) is plain
    assert argmax_only([params[0], params[2]])
    counts = torch.zeros(3, 40, dtype=torch.int32)
    counts[:, logits.argmax(dim=-1)] = 1              # the penalties change the argmax too
    out = sample(logits, _batch(params), counts, counts > 0)
    same = torch.equal(out.token_ids, logits.argmax(dim=-1)) and out.logprobs is None
    assert same is plain


def test_greedy_ties_pick_lowest_id() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0]])
    out = sample(logits, _batch([SamplingParams(temperature=0.0)] * 2))
    assert out.token_ids.tolist() == [1, 0]


def test_greedy_rows_in_mixed_batch_stay_argmax() -> None:
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.3)] * 3
    batch = _batch(params)
    assert not batch.all_greedy
    out = sample(logits, batch)
    assert torch.equal(out.token_ids[0::2], logits[0::2].argmax(dim=-1))


# --------------------------------------------------------------------------- reproducibility


def test_same_seed_and_step_gives_same_token() -> None:
    logits = torch.zeros(1, 1000)  # uniform: any RNG difference would show
    p = [SamplingParams(seed=7)]
    first = [sample(logits, _batch(p, [s], [7])).token_ids.item() for s in range(20)]
    again = [sample(logits, _batch(p, [s], [7])).token_ids.item() for s in range(20)]
    other = [sample(logits, _batch(p, [s], [8])).token_ids.item() for s in range(20)]
    assert first == again
    assert first != other
    assert len(set(first)) > 10, "different steps must give different draws"


def _neighbour_rows() -> tuple[list[SamplingParams], Tensor, Tensor]:
    """Five rows with assorted settings (greedy, filters, penalties) to surround the target."""
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(temperature=1.0, top_k=3, frequency_penalty=0.5),
        SamplingParams(temperature=0.5, top_p=0.5, presence_penalty=-0.7),
        SamplingParams(temperature=1.2, min_p=0.3, logprobs=5),
        SamplingParams(temperature=2.0, top_k=10, top_p=0.9, min_p=0.05, repetition_penalty=0.8),
    ]
    gen = torch.Generator().manual_seed(5)
    counts = torch.randint(0, 3, (6, 64), generator=gen, dtype=torch.int32)
    prompt_mask = (counts > 0) | (torch.rand(6, 64, generator=gen) < 0.2)
    return params, counts, prompt_mask


def test_request_samples_identically_alone_and_in_a_batch() -> None:
    target = SamplingParams(temperature=0.9, top_p=0.95, logprobs=2, seed=11)
    others, counts, prompt_mask = _neighbour_rows()
    gen = torch.Generator().manual_seed(2)
    for trial in range(30):
        logits = torch.randn(6, 64, generator=gen) * 2  # [6, V]
        seed, step = 1000 + trial, trial * 3
        alone = sample(logits[3:4], _batch([target], [step], [seed]))
        params = others[:3] + [target] + others[3:]
        steps, seeds = [1, 2, 3, step, 5, 6], [9, 8, 7, seed, 5, 4]
        mixed = sample(logits, _batch(params, steps, seeds), counts, prompt_mask)
        assert mixed.token_ids[3] == alone.token_ids[0]
        torch.testing.assert_close(mixed.logprobs[3], alone.logprobs[0])
        assert mixed.top_ids is not None and alone.top_ids is not None
        assert torch.equal(mixed.top_ids[3, :2], alone.top_ids[0])


# --------------------------------------------------------------------------- hash RNG


def test_hash_uniform_range_mean_and_rows() -> None:
    seeds = torch.arange(64, dtype=torch.int64)
    steps = torch.full((64,), 5, dtype=torch.int64)
    u = hash_uniform(seeds, steps, 4096, "cpu")  # [64, 4096]
    assert u.shape == (64, 4096) and u.dtype == torch.float32
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.005
    for a, b in [(0, 1), (1, 2), (10, 11), (0, 63)]:
        assert not torch.equal(u[a], u[b])
        corr = torch.corrcoef(torch.stack([u[a], u[b]]))[0, 1]
        assert abs(float(corr)) < 0.07
    counts = torch.histc(u, bins=16, min=0.0, max=1.0)
    expected = u.numel() / 16
    assert float(((counts - expected) ** 2 / expected).sum()) < CHI2_CRIT_P001[15]


def test_hash_uniform_row_independent_of_batch() -> None:
    seeds = torch.tensor([5, 9, 2**63 - 1, 0], dtype=torch.int64)
    steps = torch.tensor([1, 2, 3, 2**31 - 1], dtype=torch.int64)
    batch = hash_uniform(seeds, steps, 300, "cpu")
    for row in range(4):
        alone = hash_uniform(seeds[row : row + 1], steps[row : row + 1], 300, "cpu")
        assert torch.equal(alone[0], batch[row])
    assert float(batch.min()) > 0.0 and float(batch.max()) < 1.0
    step_row = hash_uniform(torch.tensor([5]), torch.tensor([2]), 300, "cpu")
    assert not torch.equal(step_row[0], batch[0]), "the step must change the row"


# --------------------------------------------------------------------------- distributions


def _expected_probs(
    logits: Tensor, *, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0,
    min_p: float = 0.0
) -> Tensor:
    """Exact filtered distribution from the definitions, in float64 (vLLM order)."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if top_k != -1:
        keep = torch.zeros_like(probs, dtype=torch.bool)
        keep[probs.argsort(descending=True)[:top_k]] = True
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum()
    if top_p < 1:
        order = probs.argsort(descending=True)
        cum = probs[order].cumsum(0)
        num_keep = int((cum < top_p).sum()) + 1  # smallest head with mass >= top_p
        assert abs(float(cum[num_keep - 1]) - top_p) > 1e-3, (
            "test logits too close to the top-p boundary"
        )
        keep = torch.zeros_like(probs, dtype=torch.bool)
        keep[order[:num_keep]] = True
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum()
    if min_p > 0:
        threshold = min_p * probs.max()
        assert bool(((probs - threshold).abs() > 1e-4).all()), (
            "test logits too close to the min-p boundary"
        )
        probs = torch.where(probs >= threshold, probs, 0.0)
        probs = probs / probs.sum()
    return probs


def _chi_square(observed: Tensor, expected_probs: Tensor, num: int) -> tuple[float, int]:
    """Pearson statistic over tokens with nonzero probability; bins expected < 5 are pooled."""
    expected = expected_probs * num
    live = expected > 0
    big = live & (expected >= 5)
    obs = [observed[big].double()]
    exp = [expected[big]]
    small = live & ~big
    if bool(small.any()):
        obs.append(observed[small].double().sum().reshape(1))
        exp.append(expected[small].sum().reshape(1))
    o, e = torch.cat(obs), torch.cat(exp)
    return float(((o - e) ** 2 / e).sum()), int(o.numel()) - 1


SETTINGS = [
    {"temperature": 0.7},
    {"top_k": 4},
    {"top_p": 0.8},
    {"min_p": 0.2},
    {"temperature": 1.3, "top_k": 8, "top_p": 0.9, "min_p": 0.05},
]


@pytest.mark.parametrize("vary", ["seed", "step"])
@pytest.mark.parametrize("setting", SETTINGS, ids=[str(s) for s in SETTINGS])
def test_sampled_distribution_matches_definition(setting: dict[str, float], vary: str) -> None:
    logits = _small_logits()
    expected = _expected_probs(logits, **setting)  # type: ignore[arg-type]
    params = [SamplingParams(**setting)] * NUM_DRAWS  # type: ignore[arg-type]
    draws = list(range(NUM_DRAWS))
    if vary == "seed":
        batch = _batch(params, steps=[3] * NUM_DRAWS, seeds=draws)
    else:
        batch = _batch(params, steps=draws, seeds=[424242] * NUM_DRAWS)
    out = sample(logits.expand(NUM_DRAWS, VOCAB).contiguous(), batch)  # one draw per row
    observed = torch.bincount(out.token_ids, minlength=VOCAB)
    assert int(observed[expected == 0].sum()) == 0, "a filtered-out token was sampled"
    stat, dof = _chi_square(observed, expected, NUM_DRAWS)
    assert dof >= 1
    assert stat < CHI2_CRIT_P001[dof], f"chi2={stat:.1f} dof={dof} observed={observed.tolist()}"


# --------------------------------------------------------------------------- penalties


def test_penalties_follow_formulas() -> None:
    logits = torch.tensor(
        [
            [2.0, -1.0, 0.5, -3.0, 0.0],
            [1.0, 1.0, -2.0, 4.0, -0.5],
            [3.0, -1.5, 2.0, 0.5, -0.5],
        ]
    )
    prompt_mask = torch.tensor(
        [
            [True, True, False, False, True],
            [True, False, True, True, False],
            [True, True, False, True, False],
        ]
    )
    counts = torch.tensor([[0, 0, 0, 0, 0], [2, 0, 1, 0, 3], [1, 0, 0, 2, 0]], dtype=torch.int32)
    params = [
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(repetition_penalty=1.5, frequency_penalty=0.1, presence_penalty=1.0),
    ]
    expected = torch.tensor(
        [
            [2.0 / 2, -1.0 * 2, 0.5, -3.0, 0.0],
            [1.0 - 2 * 0.5 - 0.25, 1.0, -2.0 - 0.5 - 0.25, 4.0, -0.5 - 3 * 0.5 - 0.25],
            [3.0 / 1.5 - 0.1 - 1.0, -1.5 * 1.5, 2.0, 0.5 / 1.5 - 0.2 - 1.0, -0.5],
        ]
    )
    before = logits.clone()
    out = apply_penalties(logits, _batch(params), counts, prompt_mask)
    torch.testing.assert_close(out, expected)
    assert torch.equal(logits, before), "apply_penalties must not mutate its input"


def test_neutral_penalties_skip_work() -> None:
    logits = torch.randn(2, 7)
    batch = _batch([SamplingParams(), SamplingParams(temperature=0.0)])
    assert not batch.do_penalties
    assert apply_penalties(logits, batch, None, None) is logits


def test_missing_penalty_inputs_raise() -> None:
    logits = torch.randn(1, 7)
    with pytest.raises(ValueError, match="prompt_mask"):
        sample(logits, _batch([SamplingParams(repetition_penalty=1.2)]))
    with pytest.raises(ValueError, match="token_counts"):
        sample(logits, _batch([SamplingParams(presence_penalty=1.0)]))


def test_greedy_uses_penalised_logits() -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    counts = torch.tensor([[1, 0, 0]], dtype=torch.int32)
    params = [SamplingParams(temperature=0.0, frequency_penalty=1.0)]
    out = sample(logits, _batch(params), counts, counts > 0)
    assert out.token_ids.tolist() == [1]


# --------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_and_top_n_sorted() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 30, generator=gen) * 3  # [4, 30]
    counts = torch.randint(0, 2, (4, 30), generator=gen, dtype=torch.int32)
    params = [
        SamplingParams(temperature=0.5, frequency_penalty=1.0, logprobs=3),
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(top_k=5, logprobs=5),
        SamplingParams(top_p=0.7, min_p=0.1, logprobs=0),
    ]
    batch = _batch(params)
    assert batch.max_logprobs == 5
    out = sample(logits, batch, counts, counts > 0)
    raw = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids.unsqueeze(1)).squeeze(1))
    assert out.top_logprobs is not None and out.top_ids is not None
    assert out.top_logprobs.shape == (4, 5) and out.top_ids.shape == (4, 5)
    assert bool((out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all())
    torch.testing.assert_close(out.top_logprobs, raw.sort(dim=-1, descending=True).values[:, :5])
    torch.testing.assert_close(out.top_logprobs, raw.gather(1, out.top_ids))


def test_scaled_logprobs_are_of_the_tempered_distribution() -> None:
    """`scaled_logprobs` rows report log_softmax(logits / T) (before top-k / top-p), the others
    raw log-probs; greedy rows stay raw; `token_logprobs` is the same formula, bit for bit."""
    from dsv4.engine.sampler import token_logprobs

    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(4)) * 3
    params = [SamplingParams(temperature=0.7, top_k=5, logprobs=0, scaled_logprobs=True),
              SamplingParams(temperature=0.7, logprobs=0),
              SamplingParams(temperature=0.0, logprobs=0, scaled_logprobs=True),
              SamplingParams(temperature=1.3, top_p=0.5, logprobs=0, scaled_logprobs=True)]
    out = sample(logits, _batch(params))
    temps = torch.tensor([0.7, 1.0, 1.0, 1.3])
    want = torch.log_softmax(logits / temps[:, None], dim=-1).gather(
        1, out.token_ids[:, None])[:, 0]
    torch.testing.assert_close(out.logprobs, want)
    assert torch.equal(out.logprobs, token_logprobs(logits, out.token_ids, temps))
    with pytest.raises(ValueError, match="scaled_logprobs"):
        SamplingParams(scaled_logprobs=1)  # type: ignore[arg-type]


def test_no_logprobs_requested() -> None:
    """No row asks: no log-probs are computed (`do_logprobs` is False), the tokens are the same."""
    logits = torch.randn(2, 9)
    params = [SamplingParams(seed=3), SamplingParams(temperature=0.0)]
    batch = _batch(params)
    assert not batch.do_logprobs
    out = sample(logits, batch)
    assert out.logprobs is None and out.top_logprobs is None and out.top_ids is None
    asked = _batch([dataclasses.replace(p, logprobs=0) for p in params])
    assert asked.do_logprobs
    assert torch.equal(out.token_ids, sample(logits, asked).token_ids)


def test_logprobs_zero_gives_empty_top() -> None:
    out = sample(torch.randn(2, 9), _batch([SamplingParams(logprobs=0)] * 2))
    assert out.top_logprobs is not None and out.top_logprobs.shape == (2, 0)


# --------------------------------------------------------------------------- build validation


def test_build_validates_lengths_and_ranges() -> None:
    p = [SamplingParams()]
    with pytest.raises(ValueError, match="len\\(steps\\)"):
        SamplingBatch.build(p, [0, 1], [0], "cpu")
    with pytest.raises(ValueError, match="seeds"):
        SamplingBatch.build(p, [0], [-1], "cpu")
    with pytest.raises(ValueError, match="steps"):
        SamplingBatch.build(p, [2**31], [0], "cpu")
    with pytest.raises(ValueError, match="params"):
        SamplingBatch.build([], [], [], "cpu")


def test_top_k_larger_than_vocab_is_clamped() -> None:
    logits = torch.randn(3, 5)
    batch = SamplingBatch.build(
        [SamplingParams(top_k=50)] * 3, [0] * 3, [1, 2, 3], "cpu", vocab_size=5
    )
    out = sample(logits, batch)
    assert bool(((out.token_ids >= 0) & (out.token_ids < 5)).all())


@pytest.mark.gpu
def test_cuda_matches_cpu() -> None:
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(16, 1000, generator=gen) * 2
    counts = torch.randint(0, 2, (16, 1000), generator=gen, dtype=torch.int32)
    params = [
        SamplingParams(
            temperature=0.8, top_k=50, top_p=0.9, min_p=0.01, presence_penalty=0.5,
            repetition_penalty=1.1, logprobs=4
        )
    ] * 16
    steps, seeds = list(range(16)), [77] * 16
    cpu = sample(logits, SamplingBatch.build(params, steps, seeds, "cpu"), counts, counts > 0)
    dev = torch.device("cuda")
    gpu = sample(
        logits.to(dev), SamplingBatch.build(params, steps, seeds, dev), counts.to(dev),
        (counts > 0).to(dev)
    )
    assert torch.equal(gpu.token_ids.cpu(), cpu.token_ids)
    assert torch.equal(
        hash_uniform(torch.tensor(seeds), torch.tensor(steps), 1000, dev).cpu(),
        hash_uniform(torch.tensor(seeds), torch.tensor(steps), 1000, "cpu"),
    )


def test_logit_bias_bans_and_forces_tokens() -> None:
    """OpenAI semantics: -100 on the argmax changes a greedy row's token, +100 forces another;
    the reported log-probs stay those of the raw logits; rows without a bias are untouched."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    top = logits.argmax(dim=-1)
    params = [SamplingParams(temperature=0.0, logit_bias=((int(top[0]), -100.0),)),
              SamplingParams(temperature=0.9, logit_bias=((7, 100.0),), logprobs=0),
              SamplingParams(temperature=0.0)]
    out = sample(logits, _batch(params))
    assert int(out.token_ids[0]) != int(top[0])
    assert int(out.token_ids[1]) == 7 and int(out.token_ids[2]) == int(top[2])
    assert out.logprobs is not None
    assert torch.allclose(out.logprobs[1], torch.log_softmax(logits[1], -1)[7])


def test_logit_bias_is_validated() -> None:
    assert SamplingParams.create(logit_bias={3: 1.5}).logit_bias == ((3, 1.5),)
    for bad in ({3: 101.0}, {-1: 1.0}, [(3, 1.0), (3, 2.0)]):
        with pytest.raises(ValueError, match="^logit_bias=.* is invalid; allowed: "):
            SamplingParams.create(logit_bias=bad)
