"""Places the trainer also writes each step's metrics to: JSON lines, TensorBoard, W&B, MLflow.

The store (`train_steps.metrics`) stays the source of truth that the admin API
and dashboard read; these sinks are for the tools people already watch.
JSONL and TensorBoard are set per worker (`MetricsSinkConfig`); the trackers,
W&B and MLflow (`trainer.tracker_sinks`), per worker and per run
(`RunConfig.tracking`, whose fields win over the worker's when set).

Sinks see a step only after it is committed, so a sink never changes what
trained or which version exists. Held-out figures (evaluation episodes scored
per version, `core.store.evals`) reach the same sinks through `log_eval`, one
point per version at x = that version: the trainer logs, after each step it
commits, the versions whose figures changed since it last logged them
(`trainer.eval_metrics`), because evaluation rewards arrive after the step
that made the version. A sink that fails (its package missing, its
server away, a bug) is logged and counted: `MetricsSinks.log` returns the
number that failed and the trainer stores it in the step's metrics as
`sink_errors`. The step stays done.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from core.config import MetricsSinkConfig
from core.store.evals import EvalFigures
from trainer.config import TrackingConfig

logger = logging.getLogger(__name__)

DEFAULT_PROJECT = "rlgate"  # W&B project and MLflow experiment when nothing names one


@dataclass(frozen=True)
class TrackedRun:
    """What a sink knows of an rlgate run: its id, and what a tracker logs once when it opens."""

    id: str
    name: str = ""
    model: str = ""
    config: dict[str, Any] = field(default_factory=dict)  # RunConfig, as stored
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


class MetricsSink(Protocol):
    def log(
        self, run: TrackedRun, version: int, metrics: dict[str, float], wall_time: float
    ) -> None:
        """One point per train step, at x = the version it produced."""

    def log_eval(self, run: TrackedRun, points: list[EvalFigures], wall_time: float) -> None:
        """Held-out figures, one point per version (each has one), at x = that version.

        A version's figures change as rewards arrive: it is logged again at the same x,
        and its newest point is the current one."""

    def close(self) -> None: ...


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }


def eval_scalars(point: EvalFigures) -> dict[str, float]:
    """A version's held-out figures by their bare names (`stderr` only where defined)."""
    values = {"episodes": float(point.episodes), "mean_reward": point.mean_reward}
    if point.stderr is not None:
        values["stderr"] = point.stderr
    return values


class JsonlSink:
    """`{dir}/{run_id}/metrics.jsonl`: one object per step; `evals.jsonl`: one per held-out
    point; appended and flushed."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def log(
        self, run: TrackedRun, version: int, metrics: dict[str, float], wall_time: float
    ) -> None:
        folder = self.root / run.id
        folder.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"version": version, "time": wall_time, **metrics})
        with (folder / "metrics.jsonl").open("a") as f:
            f.write(line + "\n")

    def log_eval(self, run: TrackedRun, points: list[EvalFigures], wall_time: float) -> None:
        folder = self.root / run.id
        folder.mkdir(parents=True, exist_ok=True)
        lines = [
            json.dumps({"version": p.version, "time": wall_time, **eval_scalars(p)}) for p in points
        ]
        with (folder / "evals.jsonl").open("a") as f:
            f.write("".join(line + "\n" for line in lines))

    def close(self) -> None:
        pass


class TensorBoardSink:
    """`{dir}/tensorboard/{run_id}/`: scalars tagged `train/<name>`, step = version."""

    def __init__(self, root: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self._writer_cls = SummaryWriter
        self.root = root / "tensorboard"
        self.writers: dict[str, Any] = {}

    def log(
        self, run: TrackedRun, version: int, metrics: dict[str, float], wall_time: float
    ) -> None:
        writer = self._writer(run)
        for name, value in metrics.items():
            writer.add_scalar(f"train/{name}", value, global_step=version, walltime=wall_time)
        writer.flush()

    def log_eval(self, run: TrackedRun, points: list[EvalFigures], wall_time: float) -> None:
        """Tagged `eval/<name>`, step = the version."""
        writer = self._writer(run)
        for p in points:
            for name, value in eval_scalars(p).items():
                writer.add_scalar(f"eval/{name}", value, global_step=p.version, walltime=wall_time)
        writer.flush()

    def _writer(self, run: TrackedRun) -> Any:
        if run.id not in self.writers:
            self.writers[run.id] = self._writer_cls(log_dir=str(self.root / run.id))
        return self.writers[run.id]

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()
        self.writers.clear()


def trackers_for(run: TrackingConfig, worker: MetricsSinkConfig) -> list[str]:
    """The trackers a run logs to: its own choice where set, else the worker's.

    Per tracker, in order: the run's `wandb` / `mlflow` (true or false); else a
    project / experiment named by the run (on); else on when the worker names one.
    """
    chosen = []
    for name, on, named, default in (
        ("wandb", run.wandb, run.wandb_project, worker.wandb_project),
        ("mlflow", run.mlflow, run.mlflow_experiment, worker.mlflow_experiment),
    ):
        wanted = on if on is not None else (named is not None or default is not None)
        if wanted:
            chosen.append(name)
    return chosen


class MetricsSinks:
    """The worker's sinks and the trackers runs ask for, behind one `log` that never raises."""

    def __init__(self, cfg: MetricsSinkConfig, sinks: list[MetricsSink]) -> None:
        self.cfg = cfg
        self.sinks = sinks  # every run's steps
        self.trackers: dict[str, MetricsSink] = {}  # opened on first use, shared by runs

    def log(self, run: TrackedRun, version: int, metrics: dict[str, Any]) -> int:
        """Write one step everywhere it goes; returns how many sinks failed (0: all wrote it)."""
        values, now = scalars(metrics), time.time()
        return self._each(run, lambda sink: sink.log(run, version, values, now))

    def log_eval(self, run: TrackedRun, points: list[EvalFigures]) -> int:
        """Write held-out points (versioned rows only) everywhere the run's steps go;
        returns how many sinks failed."""
        now = time.time()
        return self._each(run, lambda sink: sink.log_eval(run, points, now))

    def wanted(self, run: TrackedRun) -> bool:
        """Whether anything at all logs this run (else nothing need be read for it)."""
        return bool(self.sinks or trackers_for(run.tracking, self.cfg))

    def _each(self, run: TrackedRun, write: Callable[[MetricsSink], None]) -> int:
        """`write` on the run's trackers, then on the worker's sinks; how many failed."""
        failed = 0
        for name in trackers_for(run.tracking, self.cfg):
            try:
                sink = self._tracker(name)
            except ImportError as exc:
                logger.warning("run %s logs to %s, but %s; skipped", run.id, name, exc)
                failed += 1
                continue
            except Exception:  # e.g. a store it cannot open: tried again at the next step
                logger.exception("metrics sink %s could not start for run %s", name, run.id)
                failed += 1
                continue
            failed += not self._write(sink, run, write)
        for sink in self.sinks:
            failed += not self._write(sink, run, write)
        return failed

    def close(self) -> None:
        for sink in [*self.sinks, *self.trackers.values()]:
            try:
                sink.close()
            except Exception:
                logger.exception("closing metrics sink %s failed", type(sink).__name__)
        self.trackers.clear()

    def _tracker(self, name: str) -> MetricsSink:
        if name not in self.trackers:
            from trainer import tracker_sinks  # their packages are optional extras

            self.trackers[name] = tracker_sinks.make_tracker(name, self.cfg)
        return self.trackers[name]

    @staticmethod
    def _write(sink: MetricsSink, run: TrackedRun, write: Callable[[MetricsSink], None]) -> bool:
        try:
            write(sink)
        except Exception:
            logger.exception("metrics sink %s failed for run %s", type(sink).__name__, run.id)
            return False
        return True


def make_sinks(cfg: MetricsSinkConfig) -> MetricsSinks:
    sinks: list[MetricsSink] = []
    if cfg.dir is not None:
        sinks.append(JsonlSink(cfg.dir))
        if cfg.tensorboard:
            try:
                sinks.append(TensorBoardSink(cfg.dir))
            except ImportError:
                logger.warning("TensorBoard logging asked for, but tensorboard is not installed")
    elif cfg.tensorboard:
        logger.warning("TensorBoard logging needs a metrics dir; skipped")
    return MetricsSinks(cfg, sinks)
