"""The experiment-tracker sinks: W&B and MLflow, one tracker run per rlgate run, found again.

Both keep one tracker run per rlgate run open for the life of the worker and
log its config once, when they open it. A restarted worker (or another one)
finds the same tracker run again instead of starting a second: W&B by its run
id, which is the rlgate run id (`resume="allow"`); MLflow by the
`rlgate.run_id` tag on the run. Every step's point is at step = the version the
train step produced; a held-out point at step = the version it scores (W&B: in
a companion run, see `WandbSink`). Their packages are optional extras (`rlgate[wandb]`,
`rlgate[mlflow]`), imported only when a run asks for them.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from core.store.evals import EvalFigures
from trainer.metrics_sinks import (
    DEFAULT_PROJECT,
    MetricsSink,
    MetricsSinkConfig,
    TrackedRun,
    eval_scalars,
)

logger = logging.getLogger(__name__)

MLFLOW_RUN_TAG = "rlgate.run_id"
WANDB_EVAL_SUFFIX = "-eval"  # the W&B id of a run's held-out companion: <run_id>-eval
MLFLOW_BATCH_PARAMS = 100  # MLflow's limit per log_batch call
MLFLOW_BATCH_METRICS = 1000  # likewise for metrics
# MLflow's HTTP client retries 7 times with a 120 s timeout by default: a tracking server
# that is down would hold the worker for minutes after every step. rlgate's defaults bound
# that to about half a minute; a value the worker's environment sets wins.
MLFLOW_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def make_tracker(name: str, cfg: MetricsSinkConfig) -> MetricsSink:
    """The tracker sink `name`; an ImportError saying what to install if its package is missing."""
    if name == "wandb":
        return WandbSink(cfg.wandb_project)
    if name == "mlflow":
        return MlflowSink(cfg.mlflow_tracking_uri, cfg.mlflow_experiment)
    raise ValueError(f"unknown tracker {name!r}")


def _require(package: str, extra: str) -> Any:
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError as exc:
        raise ImportError(f"{package} is not installed (pip install 'rlgate[{extra}]')") from exc


def tracked_config(run: TrackedRun) -> dict[str, Any]:
    """What a tracker logs once per run: the rlgate run's identity and its whole RunConfig."""
    return {"rlgate_run_id": run.id, "model": run.model, **run.config}


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config as MLflow params: dotted keys, string values (JSON for lists and None)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out |= flatten(value, f"{name}.")
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value)
    return out


class WandbSink:
    """One W&B run per rlgate run: W&B id = rlgate run id, `resume="allow"`, config at init.

    Offline (`WANDB_MODE=offline`) each worker process that opens the run writes
    its own `offline-run-*-{run_id}` directory; `wandb sync` uploads them all to
    the one W&B run, whose steps are the versions.

    Held-out points go to a companion W&B run, id `<run_id>-eval`, in the same
    group (the rlgate run id): W&B's step only ever increases, and the train run's
    step is the version, so a point for an older version (its figures revised
    after later steps) has no place there. In the companion each point is a row of
    its own with `eval/version`, the x axis of every `eval/*` chart
    (`define_metric`).
    """

    def __init__(self, default_project: str | None) -> None:
        self.wandb = _require("wandb", "wandb")
        self.default_project = default_project or DEFAULT_PROJECT
        self.runs: dict[str, Any] = {}
        self.eval_runs: dict[str, Any] = {}

    def log(
        self, run: TrackedRun, version: int, metrics: dict[str, float], wall_time: float
    ) -> None:
        handle = self.runs.get(run.id) or self._open(run)
        handle.log({f"train/{k}": v for k, v in metrics.items()}, step=version)

    def log_eval(self, run: TrackedRun, points: list[EvalFigures], wall_time: float) -> None:
        handle = self.eval_runs.get(run.id) or self._open(run, evaluation=True)
        for p in points:
            values = {f"eval/{k}": v for k, v in eval_scalars(p).items()}
            handle.log({"eval/version": p.version, **values})

    def _open(self, run: TrackedRun, evaluation: bool = False) -> Any:
        suffix, kind = (WANDB_EVAL_SUFFIX, "eval") if evaluation else ("", "train")
        handle = self.wandb.init(
            project=run.tracking.wandb_project or self.default_project,
            id=run.id + suffix,
            name=(run.name or run.id) + suffix,
            group=run.id,
            job_type=kind,
            resume="allow",
            reinit="create_new",  # a worker trains several runs: one W&B run each, side by side
            config=tracked_config(run),
            # the worker's own output stays in its log, not in W&B's console capture
            settings=self.wandb.Settings(console="off", silent=True),
        )
        if evaluation:
            handle.define_metric("eval/version")
            handle.define_metric("eval/*", step_metric="eval/version")
            self.eval_runs[run.id] = handle
        else:
            self.runs[run.id] = handle
        logger.info("run %s logs %s to W&B project %s", run.id, kind, handle.project)
        return handle

    def close(self) -> None:
        for handle in [*self.runs.values(), *self.eval_runs.values()]:
            handle.finish()
        self.runs.clear()
        self.eval_runs.clear()


class MlflowSink:
    """One MLflow run per rlgate run, tagged `rlgate.run_id`; params once, metrics at version."""

    def __init__(self, tracking_uri: str, default_experiment: str | None) -> None:
        mlflow = _require("mlflow", "mlflow")
        for name, value in MLFLOW_HTTP_DEFAULTS.items():
            os.environ.setdefault(name, value)
        self.entities = mlflow.entities
        self.client = mlflow.MlflowClient(tracking_uri=tracking_uri or None)
        self.default_experiment = default_experiment or DEFAULT_PROJECT
        self.experiments: dict[str, str] = {}  # name -> experiment id
        self.runs: dict[str, str] = {}  # rlgate run id -> MLflow run id

    def log(
        self, run: TrackedRun, version: int, metrics: dict[str, float], wall_time: float
    ) -> None:
        mlflow_run = self.runs.get(run.id) or self._open(run)
        ms = int(wall_time * 1000)
        points = [self.entities.Metric(f"train/{k}", v, ms, version) for k, v in metrics.items()]
        self.client.log_batch(mlflow_run, metrics=points)

    def log_eval(self, run: TrackedRun, points: list[EvalFigures], wall_time: float) -> None:
        """In the run's own MLflow run: MLflow takes any step, in any order."""
        mlflow_run = self.runs.get(run.id) or self._open(run)
        ms = int(wall_time * 1000)
        metrics = [
            self.entities.Metric(f"eval/{k}", v, ms, p.version)
            for p in points
            for k, v in eval_scalars(p).items()
        ]
        for i in range(0, len(metrics), MLFLOW_BATCH_METRICS):
            self.client.log_batch(mlflow_run, metrics=metrics[i : i + MLFLOW_BATCH_METRICS])

    def _open(self, run: TrackedRun) -> str:
        experiment = self._experiment(run.tracking.mlflow_experiment or self.default_experiment)
        found = self.client.search_runs(
            [experiment], filter_string=f"tags.`{MLFLOW_RUN_TAG}` = '{run.id}'", max_results=1
        )
        if found:
            mlflow_run = found[0].info.run_id
            self.client.update_run(mlflow_run, status="RUNNING")
        else:
            mlflow_run = self.client.create_run(experiment, run_name=run.name or run.id).info.run_id
            params = [self.entities.Param(k, v) for k, v in flatten(tracked_config(run)).items()]
            for i in range(0, len(params), MLFLOW_BATCH_PARAMS):
                self.client.log_batch(mlflow_run, params=params[i : i + MLFLOW_BATCH_PARAMS])
            # tagged last: a run without its params is never the one found again
            self.client.set_tag(mlflow_run, MLFLOW_RUN_TAG, run.id)
        self.runs[run.id] = mlflow_run
        how = "resumed" if found else "new"
        logger.info("run %s logs to MLflow run %s (%s)", run.id, mlflow_run, how)
        return mlflow_run

    def _experiment(self, name: str) -> str:
        if name not in self.experiments:
            found = self.client.get_experiment_by_name(name)
            if found is None:
                try:
                    self.experiments[name] = self.client.create_experiment(name)
                except Exception:  # another worker created it in between
                    found = self.client.get_experiment_by_name(name)
                    if found is None:
                        raise
            if found is not None:
                self.experiments[name] = found.experiment_id
        return self.experiments[name]

    def close(self) -> None:
        for mlflow_run in self.runs.values():
            self.client.set_terminated(mlflow_run, status="FINISHED")
        self.runs.clear()
