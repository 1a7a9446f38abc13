"""top_k on the local sampler: only the k likeliest tokens are drawn; logprobs stay untruncated."""

from __future__ import annotations

import pytest
import torch

from inference.sampling import sample_row, sampling_logprobs
from inference.types import SamplingParams


def test_top_k_draws_only_the_k_likeliest_and_reports_full_logprobs() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0, 2.5, -1.0])
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, top_k=2)
    full = sampling_logprobs(logits, 1.0)
    drawn = set()
    for _ in range(200):
        token, logprob = sample_row(logits, params, gen)
        drawn.add(token)
        assert logprob == pytest.approx(float(full[token]))
    assert drawn == {1, 3}


def test_top_k_zero_or_past_the_vocabulary_is_off() -> None:
    logits = torch.zeros(4)
    for k in (0, 4, 10):
        gen = torch.Generator().manual_seed(1)
        drawn = {sample_row(logits, SamplingParams(top_k=k), gen)[0] for _ in range(200)}
        assert drawn == {0, 1, 2, 3}


def test_negative_top_k_is_refused() -> None:
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-1)


def test_top_k_keeps_every_token_tied_with_the_kth() -> None:
    logits = torch.tensor([3.0, 3.0, 3.0, 0.0, 3.0, -1.0])
    gen = torch.Generator().manual_seed(2)
    drawn = {sample_row(logits, SamplingParams(top_k=2), gen)[0] for _ in range(300)}
    assert drawn == {0, 1, 2, 4}
