"""Held-out figures of a run: per policy version, its scored evaluation episodes' mean reward.

An evaluation episode (`EpisodeStatus.EVAL`) is scored by its episode reward when one
was posted (the newest post), else by the sum of its completions' posted rewards, else
it is unscored and not counted. It counts for the version that sampled every one of its
tokens, over all its completions (`Completion.token_versions()`); an episode whose
tokens came from more than one version spans a swap and is reported apart, in one row
with `version=None`, because its reward says nothing about any single version.

The standard error is the sample standard deviation (n - 1) over sqrt(n): null for fewer
than two episodes, where it is not defined. The async query serves the admin API, its
sync twin the trainer's metrics; both share the arithmetic below.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Select, func, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from core.store.models import Completion, Episode
from core.store.status import EpisodeStatus

# Bytes per stored output token id (`core.store.types.IntArray` packs int32).
_TOKEN_BYTES = 4

# (episode id, policy version, version starts, output bytes, reward): a row of `_completions`.
CompletionRow = tuple[str, int, Sequence[Sequence[int]] | None, int | None, float | None]


@dataclass(frozen=True)
class EvalFigures:
    """One row of a run's held-out figures."""

    version: int | None  # None: the episodes whose tokens span a swap
    episodes: int  # scored evaluation episodes counted here
    mean_reward: float
    stderr: float | None  # sample std / sqrt(n); None when episodes < 2


def _episodes(run_id: str) -> Select[str, float | None]:
    return select(Episode.id, Episode.reward).where(
        Episode.run_id == run_id, Episode.status == EpisodeStatus.EVAL
    )


def _completions(run_id: str) -> Select[Any]:
    # The output length (not the ids themselves) is all that placing a swap needs.
    return (
        select(
            Completion.episode_id,
            Completion.policy_version,
            Completion.version_starts,
            func.length(Completion.output_token_ids),
            Completion.reward,
        )
        .join(
            Episode,
            (Episode.run_id == Completion.run_id) & (Episode.id == Completion.episode_id),
        )
        .where(Completion.run_id == run_id, Episode.status == EpisodeStatus.EVAL)
    )


def sampling_versions(
    policy_version: int, version_starts: Sequence[Sequence[int]] | None, n_tokens: int
) -> set[int]:
    """The versions that sampled at least one of a completion's `n_tokens` output tokens
    (as `Completion.token_versions()`, without loading the ids)."""
    spans = [(int(i), int(v)) for i, v in version_starts] if version_starts else []
    if not spans:
        return {int(policy_version)} if n_tokens > 0 else set()
    out = set()
    for k, (start, version) in enumerate(spans):
        end = spans[k + 1][0] if k + 1 < len(spans) else n_tokens
        if end > start:
            out.add(version)
    return out


def summarize(scores: Sequence[float], version: int | None) -> EvalFigures:
    """The figures of one group of episode scores (at least one)."""
    n = len(scores)
    stderr = statistics.stdev(scores) / math.sqrt(n) if n >= 2 else None
    return EvalFigures(version, n, statistics.fmean(scores), stderr)


def figures_from_rows(
    episodes: Iterable[tuple[str, float | None]],
    completions: Iterable[CompletionRow],
) -> list[EvalFigures]:
    """Per-version figures (ascending), then the spanning row if any, from the rows of
    `_episodes` (id, reward) and `_completions` (episode id, policy version, version
    starts, output bytes, reward).

    An episode none of whose completions sampled a token (every output empty) counts for
    its completions' `policy_version`s, the versions that served it.
    """
    versions: dict[str, set[int]] = {}
    served: dict[str, set[int]] = {}
    turn_sum: dict[str, float] = {}
    for ep_id, policy_version, starts, n_bytes, reward in completions:
        n_tokens = int(n_bytes or 0) // _TOKEN_BYTES
        versions.setdefault(ep_id, set()).update(
            sampling_versions(policy_version, starts, n_tokens)
        )
        served.setdefault(ep_id, set()).add(int(policy_version))
        if reward is not None:
            turn_sum[ep_id] = turn_sum.get(ep_id, 0.0) + float(reward)
    by_version: dict[int, list[float]] = {}
    spanning: list[float] = []
    for ep_id, reward in episodes:
        score = float(reward) if reward is not None else turn_sum.get(ep_id)
        sampled = versions.get(ep_id) or served.get(ep_id)
        if score is None or not sampled:
            continue  # unscored, or never served (no completion): nothing to count
        if len(sampled) == 1:
            by_version.setdefault(next(iter(sampled)), []).append(score)
        else:
            spanning.append(score)
    rows = [summarize(by_version[v], v) for v in sorted(by_version)]
    if spanning:
        rows.append(summarize(spanning, None))
    return rows


async def eval_figures(session: AsyncSession, run_id: str) -> list[EvalFigures]:
    """The run's held-out figures: one row per version, ascending, the spanning row last."""
    episodes = (await session.execute(_episodes(run_id))).tuples().all()
    completions = (await session.execute(_completions(run_id))).tuples().all()
    return figures_from_rows(episodes, completions)


def eval_figures_sync(session: Session, run_id: str) -> list[EvalFigures]:
    """`eval_figures` for the trainer's sync session."""
    episodes = session.execute(_episodes(run_id)).tuples().all()
    completions = session.execute(_completions(run_id)).tuples().all()
    return figures_from_rows(episodes, completions)
