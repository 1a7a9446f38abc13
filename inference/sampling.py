"""Sampling from logits, returning each row's token and its log-probability.

`sample_batch` samples every row of a decode step in one vectorised pass.
Each row's draw is an inverse-CDF lookup of one uniform taken from that row's
own generator, so a row's token depends only on its logits, its params and its
generator: the same seed and logits give the same token alone or in any batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from inference.types import SamplingParams


def sampling_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-softmax of `logits / temperature`; greedy (temperature 0) reports temperature 1.

    This is the distribution the trainer recomputes, so it is taken before
    top-k and top-p truncation (a truncated distribution has -inf where the
    trainer's does not).
    """
    scale = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits.float() / scale, dim=-1)


def sample_row(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[int, float]:
    """Sample one token id from a [vocab] logits row; return (id, logprob)."""
    tokens, logprobs = sample_batch(logits[None], [params], [generator])
    return tokens[0], logprobs[0]


def sample_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> tuple[list[int], list[float]]:
    """Sample one token per row of [B, vocab] logits; return (token ids, logprobs).

    Logprobs are those of `sampling_logprobs` for the row's temperature. Greedy
    rows (temperature 0) take the argmax. Sampled rows draw one uniform from
    their generator (None: torch's default generator) and take the token where
    it falls in the cumulative mass, in token-id order, of what top-k and top-p
    keep.
    """
    if logits.dim() != 2 or len(params) != logits.shape[0] or len(generators) != len(params):
        raise ValueError("sample_batch takes [B, vocab] logits with B params and B generators")
    device = logits.device
    scales = [p.temperature if p.temperature > 0 else 1.0 for p in params]
    temperature = torch.tensor(scales, dtype=torch.float32, device=device)[:, None]
    scaled = logits.float() / temperature
    logprobs = torch.log_softmax(scaled, dim=-1)
    sampled = [i for i, p in enumerate(params) if p.temperature > 0]
    if len(sampled) < len(params):
        tokens = torch.argmax(logprobs, dim=-1)
    else:
        tokens = torch.zeros(len(params), dtype=torch.long, device=device)

    if sampled:
        rows = _index(sampled, len(params), device)
        # Row-wise kernels only (softmax, scans, comparisons): an elementwise exp over the
        # flattened batch may round a row differently by where it falls in the batch.
        probs = torch.softmax(_rows(scaled, rows), dim=-1)
        vocab = probs.shape[1]
        truncated = [j for j, i in enumerate(sampled) if _truncates(params[i], vocab)]
        if truncated:
            at = _index(truncated, len(sampled), device)
            some = _rows(probs, at)
            kept = _kept(some, [params[sampled[j]] for j in truncated])
            some = torch.where(kept, some, 0.0)
            probs = some if at is None else probs.index_put((at,), some)
        uniforms = _uniforms([generators[i] for i in sampled], device)
        drawn = _inverse_cdf(probs.double(), uniforms)
        tokens = drawn if rows is None else tokens.index_put((rows,), drawn)

    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), chosen.tolist()


def _index(picked: list[int], total: int, device: torch.device) -> torch.Tensor | None:
    """Row indices as a tensor, or None when every row is picked (no copy needed)."""
    return None if len(picked) == total else torch.tensor(picked, device=device)


def _rows(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return x if index is None else x[index]


def _truncates(params: SamplingParams, vocab: int) -> bool:
    return 0 < params.top_k < vocab or params.top_p < 1.0


def _uniforms(generators: Sequence[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One U[0, 1) per generator, in float64 (None: torch's default generator)."""
    draws = []
    for g in generators:
        where = g.device if g is not None else torch.device("cpu")
        draws.append(float(torch.rand((), generator=g, dtype=torch.float64, device=where)))
    return torch.tensor(draws, dtype=torch.float64, device=device)


def _kept(probs: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Mask, in token-id order, of the tokens that top-k and then top-p keep.

    Top-k keeps every token at least as likely as the k-th (ties included) and
    renormalises; top-p keeps the shortest run of the likeliest tokens whose
    mass before each token is below p (the first token always); among tokens
    tied at that cut, the lowest ids are kept.

    Both cuts need only the largest probabilities, so rows are not sorted: the
    `width` largest values come from topk, and a row whose cut does not fall
    inside them is searched again, eight times wider, up to the whole
    vocabulary. The mask depends only on a row's values, never on the width
    that found its cut.
    """
    rows, vocab = probs.shape
    device = probs.device
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else 0 for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
    cut = torch.zeros(rows, dtype=probs.dtype, device=device)
    room = torch.zeros(rows, dtype=torch.long, device=device)
    partial = torch.zeros(rows, dtype=torch.bool, device=device)
    todo = torch.arange(rows, device=device)
    # Top-k alone needs one value past the k-th (to see that no tie runs on); top-p likely more.
    width = min(vocab, max(int(top_k.max()) + 1, 256 if bool((top_p < 1.0).any()) else 1))
    while todo.numel():
        some = probs if todo.numel() == rows else probs[todo]
        found = _cut_within(some, top_k[todo], top_p[todo], width)
        done = todo[found.closed]
        cut[done], room[done] = found.cut[found.closed], found.room[found.closed]
        partial[done] = found.partial[found.closed]
        todo = todo[~found.closed]
        width = min(vocab, width * 8)
    kept = probs >= cut[:, None]
    ties = torch.nonzero(partial)[:, 0]
    if ties.numel():  # keep only the lowest ids of the tokens tied at the cut
        tied = probs[ties] == cut[ties, None]
        rank = torch.cumsum(tied.int(), dim=-1)
        kept[ties] &= ~tied | (rank <= room[ties, None])
    return kept


class _Cut(NamedTuple):
    cut: torch.Tensor  # [R] the smallest kept probability
    room: torch.Tensor  # [R] how many tokens tied at the cut are kept
    partial: torch.Tensor  # [R] whether some tokens tied at the cut may be left out
    closed: torch.Tensor  # [R] whether the largest `width` values sufficed to find the cut


def _cut_within(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, width: int) -> _Cut:
    """Each row's cut, found among its `width` largest probabilities.

    Sums are read off sequential scans (not reductions, which may split a lone
    row across threads), so a row's cut does not depend on its batch-mates.
    """
    vocab = probs.shape[1]
    whole = width == vocab
    largest = torch.topk(probs, width, dim=-1).values  # descending; tie order cannot matter
    k_on = top_k > 0
    kth = largest.gather(1, (torch.where(k_on, top_k, 1) - 1)[:, None])
    kth = torch.where(k_on[:, None], kth, 0.0)
    in_top_k = largest >= kth  # a prefix
    top_k_count = in_top_k.sum(dim=-1, keepdim=True)
    # Every top-k token must lie inside the width for its mass to be known.
    closed = ~k_on | (largest[:, -1] < kth[:, 0]) | whole
    through = torch.cumsum(largest, dim=-1)
    # Without top-k the probabilities are used as they are, not renormalised.
    mass = torch.where(k_on[:, None], through.gather(1, top_k_count - 1), 1.0)
    before = through.roll(1, dims=-1)
    before[:, 0] = 0.0
    # top_p = 1 is off outright: float32 mass can reach 1 before the tail.
    in_nucleus = (before / mass < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep = in_top_k & in_nucleus
    keep[:, 0] = True
    count = keep.sum(dim=-1, keepdim=True)  # a prefix of the descending values
    closed &= (count[:, 0] < width) | whole
    cut = largest.gather(1, count - 1)
    room = count - (largest > cut).sum(dim=-1, keepdim=True)
    ties_seen = (largest == cut).sum(dim=-1, keepdim=True)
    partial = (ties_seen > room) | ((largest[:, -1:] == cut) & (not whole))
    return _Cut(cut[:, 0], room[:, 0], partial[:, 0], closed)


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index where each row's uniform falls in its cumulative (unnormalised) float64 mass.

    The target stays strictly below the row's total, so the first index whose
    cumulative mass exceeds it holds a token of positive mass; the clamp only
    guards against rounding in the scan.
    """
    cdf = torch.cumsum(probs, dim=-1)
    total = cdf[:, -1:]
    below_total = torch.nextafter(total, torch.zeros_like(total))
    target = torch.minimum(uniforms[:, None] * total, below_total)
    index = torch.searchsorted(cdf, target, right=True)[:, 0]
    return index.clamp(max=probs.shape[1] - 1)
