"""Optional places the trainer also writes each step's metrics to: JSON lines, TensorBoard, W&B.

The store (`train_steps.metrics`) stays the source of truth that the admin API
and dashboard read; these sinks are for the tools people already watch. Each
is configured in `MetricsSinkConfig` and import-guarded: TensorBoard needs the
`tensorboard` package, W&B the `wandb` package, and a sink whose package is
missing is skipped with a warning, never an import error in the worker. A
sink that fails while writing is logged and the train step still counts.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, Field

logger = logging.getLogger(__name__)


class MetricsSinkConfig(BaseModel):
    dir: Path | None = Field(None, description="root of the JSONL (and TensorBoard) logs")
    tensorboard: bool = Field(False, description="also write TensorBoard events under dir")
    wandb_project: str | None = Field(None, description="also log to this W&B project")


class MetricsSink(Protocol):
    def log(self, run_id: str, version: int, metrics: dict[str, float], wall_time: float) -> None:
        """One point per train step, at x = the version it produced."""

    def close(self) -> None: ...


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }


class JsonlSink:
    """`{dir}/{run_id}/metrics.jsonl`: one object per step, appended and flushed."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def log(self, run_id: str, version: int, metrics: dict[str, float], wall_time: float) -> None:
        folder = self.root / run_id
        folder.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"version": version, "time": wall_time, **metrics})
        with (folder / "metrics.jsonl").open("a") as f:
            f.write(line + "\n")

    def close(self) -> None:
        pass


class TensorBoardSink:
    """`{dir}/tensorboard/{run_id}/`: scalars tagged `train/<name>`, step = version."""

    def __init__(self, root: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self._writer_cls = SummaryWriter
        self.root = root / "tensorboard"
        self.writers: dict[str, Any] = {}

    def log(self, run_id: str, version: int, metrics: dict[str, float], wall_time: float) -> None:
        if run_id not in self.writers:
            self.writers[run_id] = self._writer_cls(log_dir=str(self.root / run_id))
        writer = self.writers[run_id]
        for name, value in metrics.items():
            writer.add_scalar(f"train/{name}", value, global_step=version, walltime=wall_time)
        writer.flush()

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()
        self.writers.clear()


class WandbSink:
    """One W&B run per rlgate run (id = run id, resumed across worker restarts)."""

    def __init__(self, project: str) -> None:
        import wandb

        self.wandb = wandb
        self.project = project
        self.runs: dict[str, Any] = {}

    def log(self, run_id: str, version: int, metrics: dict[str, float], wall_time: float) -> None:
        if run_id not in self.runs:
            self.runs[run_id] = self.wandb.init(
                project=self.project, id=run_id, name=run_id, resume="allow", reinit=True
            )
        self.runs[run_id].log({f"train/{k}": v for k, v in metrics.items()}, step=version)

    def close(self) -> None:
        for run in self.runs.values():
            run.finish()
        self.runs.clear()


class MetricsSinks:
    """All configured sinks behind one `log`; a failing sink never fails a train step."""

    def __init__(self, sinks: list[MetricsSink]) -> None:
        self.sinks = sinks

    def log(self, run_id: str, version: int, metrics: dict[str, Any]) -> None:
        values, now = scalars(metrics), time.time()
        for sink in self.sinks:
            try:
                sink.log(run_id, version, values, now)
            except Exception:
                logger.exception("metrics sink %s failed", type(sink).__name__)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


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
    if cfg.wandb_project:
        try:
            sinks.append(WandbSink(cfg.wandb_project))
        except ImportError:
            logger.warning("W&B logging asked for, but wandb is not installed")
    return MetricsSinks(sinks)
