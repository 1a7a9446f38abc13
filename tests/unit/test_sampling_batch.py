"""sample_batch: one vectorised pass that samples every row as if it were alone."""

from __future__ import annotations

import pytest
import torch

from inference import sampling
from inference.sampling import sample_batch, sample_row, sampling_logprobs
from inference.types import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
PLAIN = SamplingParams(temperature=1.0)
COOL = SamplingParams(temperature=0.7)
TOP_K = SamplingParams(temperature=0.9, top_k=5)
TOP_P = SamplingParams(temperature=1.2, top_p=0.8)
BOTH = SamplingParams(temperature=0.8, top_k=40, top_p=0.9)
KINDS = [GREEDY, PLAIN, COOL, TOP_K, TOP_P, BOTH]


def _logits(rows: int, vocab: int, seed: int, spread: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * spread


def _gens(seeds: list[int]) -> list[torch.Generator | None]:
    return [torch.Generator().manual_seed(s) for s in seeds]


def _reference_kept(probs: torch.Tensor, params: SamplingParams) -> set[int]:
    """The tokens top-k then top-p keep, by a full sort (ties: lower ids first)."""
    vocab = probs.numel()
    probs = probs.double()
    keep = torch.ones(vocab, dtype=torch.bool)
    if 0 < params.top_k < vocab:
        kth = torch.sort(probs, descending=True).values[params.top_k - 1]
        keep = probs >= kth
    if params.top_p < 1.0:
        masked = torch.where(keep, probs, 0.0)
        if 0 < params.top_k < vocab:
            masked = masked / masked.sum()
        values, order = torch.sort(masked, descending=True, stable=True)
        in_nucleus = torch.cumsum(values, dim=0) - values < params.top_p
        in_nucleus[0] = True
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[order[in_nucleus]] = True
    return set(torch.nonzero(keep)[:, 0].tolist())


def test_greedy_rows_take_the_argmax_and_report_temperature_one() -> None:
    logits = _logits(4, 50, seed=0)
    tokens, logprobs = sample_batch(logits, [GREEDY] * 4, [None] * 4)
    assert tokens == torch.argmax(logits, dim=-1).tolist()
    full = torch.log_softmax(logits, dim=-1)
    assert logprobs == [float(full[r, t]) for r, t in enumerate(tokens)]


def test_logprobs_are_those_of_sampling_logprobs_for_each_row() -> None:
    params = [*KINDS, SamplingParams(temperature=0.05), SamplingParams(temperature=3.0)]
    logits = _logits(len(params), 301, seed=1).to(torch.bfloat16)
    tokens, logprobs = sample_batch(logits, params, _gens(list(range(len(params)))))
    for row, (p, token) in enumerate(zip(params, tokens, strict=True)):
        assert logprobs[row] == float(sampling_logprobs(logits[row], p.temperature)[token])


@pytest.mark.parametrize("vocab", [257, 4099])
def test_a_rows_token_does_not_depend_on_its_batch(vocab: int) -> None:
    logits = _logits(24, vocab, seed=2)
    params = [KINDS[i % len(KINDS)] for i in range(24)]
    seeds = [100 + i for i in range(24)]
    batched, _ = sample_batch(logits, params, _gens(seeds))
    alone = [
        sample_batch(logits[i : i + 1], [params[i]], _gens([seeds[i]]))[0][0] for i in range(24)
    ]
    assert batched == alone
    # other mates and sizes: every third row, reversed, with fresh rows around it
    picked = list(range(0, 24, 3))[::-1]
    mates = _logits(3, vocab, seed=3)
    mixed = torch.cat([mates[:1], logits[picked], mates[1:]])
    mixed_params = [PLAIN, *(params[i] for i in picked), TOP_P, GREEDY]
    mixed_gens = [None, *_gens([seeds[i] for i in picked]), None, None]
    tokens, _ = sample_batch(mixed, mixed_params, mixed_gens)
    assert tokens[1:-2] == [alone[i] for i in picked]


def test_same_seed_same_token_different_seeds_vary() -> None:
    logits = _logits(1, 1000, seed=4, spread=1.0).expand(64, -1)
    first, _ = sample_batch(logits, [PLAIN] * 64, _gens([7] * 64))
    assert len(set(first)) == 1
    varied, _ = sample_batch(logits, [PLAIN] * 64, _gens(list(range(64))))
    assert len(set(varied)) > 32


def test_top_k_one_and_a_tiny_top_p_are_greedy() -> None:
    logits = _logits(16, 3001, seed=5)
    greedy, _ = sample_batch(logits, [GREEDY] * 16, [None] * 16)
    for params in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6, temperature=1.5)):
        tokens, _ = sample_batch(logits, [params] * 16, _gens(list(range(16))))
        assert tokens == greedy


def test_ties_at_the_top_p_cut_keep_the_lowest_ids() -> None:
    logits = torch.zeros(1, 10)  # ten equal tokens, 0.1 each: top_p 0.25 keeps three
    params = SamplingParams(top_p=0.25)
    tokens, _ = sample_batch(logits.expand(300, -1), [params] * 300, _gens(list(range(300))))
    assert set(tokens) == {0, 1, 2}


@pytest.mark.parametrize(
    "params",
    [
        PLAIN,
        COOL,
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=0.8, top_p=0.7),
        SamplingParams(temperature=1.3, top_k=5, top_p=0.85),
    ],
)
def test_draws_follow_the_truncated_softmax(params: SamplingParams) -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    draws = 8000
    probs = torch.softmax(logits / params.temperature, dim=-1).double()
    support = sorted(_reference_kept(probs, params))
    expected = torch.zeros_like(probs)
    expected[support] = probs[support] / probs[support].sum()
    tokens, _ = sample_batch(
        logits.expand(draws, -1), [params] * draws, _gens([1000 + i for i in range(draws)])
    )
    counts = torch.bincount(torch.tensor(tokens), minlength=8).double()
    assert set(tokens) <= set(support)
    observed, wanted = counts[support], expected[support] * draws
    chi2 = float(((observed - wanted) ** 2 / wanted).sum())
    # at most 7 degrees of freedom: 24.3 is the 0.001 quantile; the seeds are fixed
    assert chi2 < 24.3


def test_the_kept_set_matches_a_full_sort() -> None:
    # flat rows push the nucleus past the first topk width; rounded logits make ties
    gen = torch.Generator().manual_seed(6)
    logits = torch.cat(
        [
            torch.randn(6, 5000, generator=gen) * 3,
            torch.randn(6, 5000, generator=gen) * 0.3,
            torch.round(torch.randn(6, 5000, generator=gen) * 2),
        ]
    )
    cases = [
        SamplingParams(top_k=300),
        SamplingParams(top_p=0.9),
        SamplingParams(top_p=0.5, top_k=2000),
        SamplingParams(top_k=7, top_p=0.6),
        SamplingParams(top_k=1),
        SamplingParams(top_p=0.999),
    ]
    params = [cases[i % len(cases)] for i in range(len(logits))]
    probs = torch.softmax(logits, dim=-1)
    batched = sampling._kept(probs, params)  # one search width for all: the largest top_k
    for row, p in enumerate(params):
        alone = sampling._kept(probs[row : row + 1], [p])[0]  # widens from 256 as needed
        expected = _reference_kept(probs[row], p)
        assert set(torch.nonzero(batched[row])[:, 0].tolist()) == expected
        assert set(torch.nonzero(alone)[:, 0].tolist()) == expected


def test_mixed_rows_in_one_batch() -> None:
    logits = _logits(12, 2000, seed=7)
    params = [KINDS[i % len(KINDS)] for i in range(12)]
    tokens, logprobs = sample_batch(logits, params, _gens(list(range(12))))
    for row, (p, token) in enumerate(zip(params, tokens, strict=True)):
        probs = torch.softmax(logits[row] / (p.temperature or 1.0), dim=-1)
        if p.temperature == 0:
            assert token == int(torch.argmax(logits[row]))
        else:
            assert token in _reference_kept(probs, p)
        assert logprobs[row] == float(sampling_logprobs(logits[row], p.temperature)[token])


def test_masked_tokens_are_never_drawn() -> None:
    logits = _logits(64, 100, seed=8)
    logits[:, 50:] = float("-inf")
    tokens, logprobs = sample_batch(logits, [PLAIN] * 64, _gens(list(range(64))))
    assert max(tokens) < 50 and all(lp > float("-inf") for lp in logprobs)


def test_unseeded_rows_use_the_default_generator() -> None:
    logits = _logits(8, 500, seed=9, spread=0.5)
    params = [PLAIN, TOP_P, GREEDY, BOTH] * 2
    torch.manual_seed(123)
    first, _ = sample_batch(logits, params, [None] * 8)
    torch.manual_seed(123)
    again, _ = sample_batch(logits, params, [None] * 8)
    assert first == again
    assert all(0 <= t < 500 for t in first)


def test_sample_row_is_a_batch_of_one() -> None:
    logits = _logits(1, 700, seed=10)[0]
    for p in KINDS:
        row = sample_row(logits, p, torch.Generator().manual_seed(3))
        batch = sample_batch(logits[None], [p], _gens([3]))
        assert row == (batch[0][0], batch[1][0])


def test_mismatched_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="B params"):
        sample_batch(torch.zeros(2, 5), [PLAIN], [None, None])
