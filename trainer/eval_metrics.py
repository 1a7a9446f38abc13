"""Held-out figures to the metrics sinks: each version's, again whenever they change.

Evaluation rewards arrive after the step that made a version (an agent
evaluates version N while N+1 trains), and revisions or retention change a
version's figures later still. So the train worker, after each step it commits
(and when it shuts down), reads the run's current figures
(`core.store.evals.eval_figures_sync`) and logs every version whose figures
differ from what was last logged for the run, each at x = its version. The
spanning row (episodes sampled by several versions) belongs to no version and
is not logged; the admin API and the dashboard show it.

What was logged is kept in the run's `counters` under `eval_logged` (version ->
[episodes, mean_reward, stderr]), so a restarted worker, or another one taking
the run's next step, logs only what changed since. It is written after the
sinks: a worker that dies in between logs those points again (the same values
at the same x), never skips one.
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from core.store.evals import EvalFigures, eval_figures_sync
from core.store.models import Run
from core.store.runs import set_counter_sync
from trainer.metrics_sinks import MetricsSinks, TrackedRun

logger = logging.getLogger(__name__)

LOGGED = "eval_logged"  # the run counter that remembers what the sinks were given


def _entry(figures: EvalFigures) -> list[Any]:
    return [figures.episodes, figures.mean_reward, figures.stderr]


def changed(figures: list[EvalFigures], logged: dict[str, Any]) -> list[EvalFigures]:
    """The versioned rows of `figures` whose values differ from `logged` (or are new)."""
    return [f for f in figures if f.version is not None and logged.get(str(f.version)) != _entry(f)]


def remembered(figures: list[EvalFigures]) -> dict[str, list[Any]]:
    """What `changed` compares with next time: every versioned row as it is now (a version
    retention emptied drops out)."""
    return {str(f.version): _entry(f) for f in figures if f.version is not None}


def log_eval_figures(sessions: sessionmaker[Session], sinks: MetricsSinks, run: TrackedRun) -> int:
    """Log the run's changed held-out figures; returns how many sinks failed (0: none, or
    nothing to log)."""
    if not sinks.wanted(run):
        return 0
    with sessions() as s:
        figures = eval_figures_sync(s, run.id)
        counters = s.scalar(select(Run.counters).where(Run.id == run.id)) or {}
    points = changed(figures, counters.get(LOGGED) or {})
    if not points:
        return 0
    failed = sinks.log_eval(run, points)
    versions = [p.version for p in points]
    logger.info("run %s: held-out figures of versions %s logged", run.id, versions)
    with sessions.begin() as s:
        set_counter_sync(s, run.id, LOGGED, remembered(figures))
    return failed
