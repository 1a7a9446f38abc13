"""A run's metric time series (one point per finished train step) and its counters."""

from __future__ import annotations

from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from core.store.completions import call_stats
from core.store.episodes import episodes_by_status
from core.store.models import Run, TrainStep, as_utc
from core.store.steps import done_steps
from gateway.errors import NotFound
from gateway.protocol_admin import CountersPublic, MetricPoint, MetricSeries

# name in the series -> where it comes from in a step's metrics, first present wins
SERIES: dict[str, tuple[str, ...]] = {
    "reward_mean": ("reward_mean",),
    "reward_std": ("reward_std",),
    "loss": ("loss",),
    # KL to the frozen base model when kl_coef > 0, else the approximate KL to the behaviour
    "kl": ("kl_ref", "approx_kl"),
    "entropy": ("entropy",),
    "clip_frac": ("clip_frac",),
    "staleness_mean": ("staleness_mean",),
    "staleness_max": ("staleness_max",),
    "tokens_per_s": ("tokens_per_s",),
    "grad_norm": ("grad_norm",),
    "duration_s": ("duration_s",),
}

# Run counters that say a sample was not trained on, and why.
DROP_COUNTERS = (
    "dropped_stale_episodes",
    "dropped_incomplete_groups",
    "skipped_zero_variance_groups",
    "expired_episodes",
    "trained_incomplete_groups",
)


def _point(row: TrainStep) -> MetricPoint:
    source: dict[str, Any] = {
        **(row.metrics or {}),
        "loss": row.loss,
        "reward_mean": row.reward_mean,
        "reward_std": row.reward_std,
        "duration_s": row.duration_s,
    }
    values: dict[str, float | None] = {}
    for name, keys in SERIES.items():
        found = next((source[k] for k in keys if isinstance(source.get(k), int | float)), None)
        values[name] = float(found) if found is not None else None
    when = row.finished_at or row.created_at
    return MetricPoint(
        step=row.step,
        version=row.step + 1,
        time=as_utc(when).isoformat() if when else None,
        values=values,
    )


class MetricsAdmin:
    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self.sessions = sessions

    async def series(self, run_id: str, since_step: int = -1) -> MetricSeries:
        """Finished steps after `since_step`, oldest first (poll with the last step seen)."""
        async with self.sessions() as s:
            if await s.get(Run, run_id) is None:
                raise NotFound(f"no run {run_id!r}", param="run_id")
            points = [_point(r) for r in await done_steps(s, run_id, after=since_step)]
        return MetricSeries(run_id=run_id, names=list(SERIES), points=points)

    async def counters(self, run_id: str) -> CountersPublic:
        async with self.sessions() as s:
            run = await s.get(Run, run_id)
            if run is None:
                raise NotFound(f"no run {run_id!r}", param="run_id")
            _links, drift = await call_stats(s, run_id)
            by_status = await episodes_by_status(s, run_id)
        counters = run.counters or {}
        return CountersPublic(
            run_id=run_id,
            template_drift=drift,
            dropped={k: int(counters.get(k, 0)) for k in DROP_COUNTERS},
            episodes_by_status=by_status,
            counters=counters,
        )
