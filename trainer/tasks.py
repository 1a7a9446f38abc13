"""The `train_step` Celery task: one optimizer step from version N to N+1, exactly once.

Idempotent by (run, step): a step already done returns at once, and the
version bump is a conditional update (`current_version == step`), so a
retried or duplicated task can never advance the run twice. Each attempt
writes its checkpoint and AdamW state under names of its own
(`core.store.checkpoints.CheckpointLayout`), fsyncs them, and the bump records
them: two live attempts of one step (a resend after `step_timeout_s`, a
redelivery) never write into the same directory, and the one that loses the
bump removes what it wrote, leaving the committed version untouched. The step
itself runs on the run's `StepRunner` (`trainer.step_runner`): inside the
worker for the local engine, on resident torchrun ranks for FSDP and Megatron
(released after every step with `RLGATE_RESIDENT_RANKS=false`).
"""

from __future__ import annotations

import logging
import shutil
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from celery import Celery
from celery.signals import worker_shutdown
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import sessionmaker

from core.settings import Settings
from core.store.checkpoints import CheckpointLayout, fsync_tree
from core.store.db import make_sync_engine
from core.store.episodes import mark_step_trained_sync, release_step_episodes_sync
from core.store.models import PolicyVersion, Run, TrainStep
from core.store.runs import advance_version_sync, lock_run_sync, policy_versions_sync
from core.store.status import StepStatus
from inference.weight_source import offer_path, saved
from trainer.batch import Sample, load_step_samples
from trainer.celery_app import TRAIN_STEP_TASK
from trainer.config import RunConfig
from trainer.engine_check import EngineUnavailable, engine_unavailable
from trainer.eval_metrics import log_eval_figures
from trainer.metrics_sinks import TrackedRun, make_sinks
from trainer.resident_pool import ResidentPool
from trainer.sequences import AssemblyStats
from trainer.step_runner import (
    InProcessRunner,
    ResidentRunner,
    StepJob,
    StepRunner,
    runs_in_process,
)
from trainer.weight_publish import StepWeights, newest_saved

logger = logging.getLogger(__name__)


class StepLost(RuntimeError):
    """Another attempt of the step committed first; this one's files are removed."""


@dataclass(frozen=True)
class Prepared:
    """What the store holds for one step: the job, and what the commit and trackers need."""

    job: StepJob
    rewards: list[float]
    assembly: AssemblyStats
    tracked: TrackedRun


class Trainer:
    """Holds the store connection and the step runners inside a worker process."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.sessions = sessionmaker(make_sync_engine(settings.resolved_database_url))
        self.layout = CheckpointLayout(settings.checkpoints_dir)
        # run -> the checkpoint directory of the attempt in progress in this worker
        self.pending: dict[str, Path] = {}
        self.sinks = make_sinks(settings.metrics_sinks())  # optional JSONL/TB/W&B/MLflow
        self.tracked: dict[str, TrackedRun] = {}  # runs this worker trained: held-out at close
        # weight_sync: when checkpoints are written; collective: the newest weights, offered
        weights = StepWeights(host=settings.weight_sync_host, secret=settings.weight_sync_secret)
        weights.watch(self._run_active)
        self.in_process = InProcessRunner(self, weights)
        self.resident = ResidentRunner(
            self,
            ResidentPool(settings.node(), settings.resident_idle_s, self._run_active),
            threads_per_rank=self._threads_per_rank,
            optimizer_for=self._optimizer_for,
            weight_host=settings.weight_sync_host,
            timeout_s=settings.step_timeout_s,
            per_step=not settings.resident_ranks,
        )

    def runner_for(self, cfg: RunConfig) -> StepRunner:
        """The local engine runs inside the worker; FSDP and Megatron on torchrun ranks."""
        return self.in_process if runs_in_process(cfg) else self.resident

    def train_step(self, run_id: str, step: int) -> dict[str, Any]:
        with self.sessions.begin() as s:
            row = s.get(TrainStep, (run_id, step))
            run = s.get(Run, run_id)
            if row is None or run is None:
                raise RuntimeError(f"no step {step} for run {run_id}")
            if row.status == StepStatus.DONE or run.current_version > step:
                return {"run_id": run_id, "step": step, "version": step + 1, "skipped": True}
            row.status = StepStatus.RUNNING
        try:
            return self._train(run_id, step)
        except StepLost as exc:
            logger.warning("%s", exc)
            self._discard(run_id)  # the runner holds the lost attempt's weights
            return {"run_id": run_id, "step": step, "version": step + 1, "skipped": True}
        except OperationalError:
            # The store itself is unreachable: nothing to mark. Celery retries the task with
            # backoff (see register_tasks); the step stays "running" until then.
            self._discard(run_id)
            raise
        except Exception as exc:
            logger.exception("step %d of run %s failed", step, run_id)
            self._discard(run_id)
            self._fail(run_id, step, exc)
            raise

    def _train(self, run_id: str, step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        prepared = self._prepare(run_id, step)
        job, cfg = prepared.job, prepared.job.cfg
        job.out.parent.mkdir(parents=True, exist_ok=True)
        self.pending[run_id] = job.out
        committing = False  # past this point a failure may come after the commit landed
        try:
            metrics, threads = self.runner_for(cfg).run_step(job)
            metrics |= _batch_figures(step, job.samples, prepared.assembly)
            metrics["torch_threads"] = float(threads)  # per rank under torchrun
            for written in (job.out, job.optimizer_out):  # on disk before the commit records them
                if written is not None and written.exists():
                    fsync_tree(written)
            duration = time.perf_counter() - t0
            committing = True
            logged = self._commit(job, prepared.rewards, metrics, duration)
        except BaseException as exc:
            # Only this attempt's own files, and never once its commit may have landed (an
            # error at COMMIT): those stay, and the sweep removes them if they are unrecorded.
            if not committing or isinstance(exc, StepLost):
                _remove_attempt(job.out)
            raise
        finally:
            self.pending.pop(run_id, None)
        self._prune(run_id, step + 1, cfg.keep_checkpoints)
        logger.info("run %s step %d -> version %d in %.1fs", run_id, step, step + 1, duration)
        # after the commit: trackers only ever see a step that counted, and never fail it
        failed = self.sinks.log(prepared.tracked, step + 1, logged | {"duration_s": duration})
        # then the held-out figures that changed since they were last logged, any version
        self.tracked[run_id] = prepared.tracked
        if failed := failed + self._log_evals(prepared.tracked):
            self._record_sink_errors(run_id, step, failed)
        return {"run_id": run_id, "step": step, "version": step + 1, "loss": metrics["loss"]}

    def _prepare(self, run_id: str, step: int) -> Prepared:
        """The run's config and the step's samples from the store, and a fresh attempt name."""
        with self.sessions() as s:
            run = s.get(Run, run_id)
            if run is None:
                raise RuntimeError(f"no run {run_id}")
            cfg = RunConfig.model_validate(run.config)
            tracked = TrackedRun(run.id, run.name, run.model, dict(run.config), cfg.tracking)
            if reason := engine_unavailable(cfg.engine):
                raise EngineUnavailable(reason)  # the step fails with this message
            samples, rewards, _groups, assembly = load_step_samples(s, run_id, step, cfg)
            if not samples:
                raise RuntimeError(f"step {step} of run {run_id} has no samples")
            model_path = Path(run.model_path)
        out = self.layout.attempt_dir(run_id, step + 1)
        optimizer_out = self.layout.optimizer_dir(out) if cfg.save_optimizer_state else None
        job = StepJob(run_id, step, cfg, samples, out, optimizer_out, model_path)
        return Prepared(job, rewards, assembly, tracked)

    def _commit(
        self, job: StepJob, rewards: list[float], metrics: dict[str, Any], duration: float
    ) -> dict[str, Any]:
        """Record version `job.step + 1` and finish the step, if the run is still at
        `job.step` (else `StepLost`); returns the metrics the trackers get."""
        run_id, step, out = job.run_id, job.step, job.out
        with self.sessions.begin() as s:
            if not advance_version_sync(s, run_id, step):
                raise StepLost(
                    f"run {run_id} moved past version {step} during this attempt of step "
                    f"{step}: another attempt committed v{step + 1}; {out.name} is removed"
                )
            optimizer = str(job.optimizer_out) if job.optimizer_out else None
            s.add(
                PolicyVersion(
                    run_id=run_id,
                    version=step + 1,
                    checkpoint_path=str(out),
                    optimizer_path=optimizer,
                )
            )
            mark_step_trained_sync(s, run_id, step)
            row = s.get(TrainStep, (run_id, step))
            if row is None:
                raise RuntimeError(f"no step {step} for run {run_id}")
            row.status = StepStatus.DONE
            row.loss = metrics["loss"]
            row.reward_mean = statistics.fmean(rewards)
            row.reward_std = statistics.pstdev(rewards)
            row.tokens = int(metrics["tokens"])
            row.duration_s = duration
            row.metrics = {"attempts": 1, **(row.metrics or {}), **metrics}  # keeps "resent"
            row.finished_at = datetime.now(UTC)
            return {**row.metrics, "reward_mean": row.reward_mean, "reward_std": row.reward_std}

    # --- VersionSource: what a runner reads of the store to start a fresh engine or group

    def checkpoint(self, run_id: str, version: int) -> Path:
        """The newest saved checkpoint at or below `version` (collective: maybe older)."""
        with self.sessions() as s:
            pv = newest_saved(s, run_id, version)
        if pv is None:
            raise RuntimeError(f"run {run_id} has no checkpoint for version {version}")
        return Path(pv.checkpoint_path)

    def optimizer(self, run_id: str, version: int, sharded: bool) -> Path | None:
        """Where the AdamW state of committed `version` is: the recorded path, or the layout
        before attempt directories for a version recorded without one (None: version 0)."""
        with self.sessions() as s:
            pv = s.get(PolicyVersion, (run_id, version))
            if pv is not None and pv.optimizer_path:
                return Path(pv.optimizer_path)
        if version == 0:
            return None
        return self.layout.legacy_optimizer_dir(run_id, version, sharded)

    def _optimizer_for(self, run_id: str, version: int) -> Path:
        """A resident group's AdamW destination for `version`: the attempt in progress
        when it is the version being trained, else the committed version's recorded one."""
        pending = self.pending.get(run_id)
        if pending is not None and self.layout.attempt_version(pending) == version:
            return self.layout.optimizer_dir(pending)
        found = self.optimizer(run_id, version, sharded=True)
        return found or self.layout.legacy_optimizer_dir(run_id, version, True)

    def _run_active(self, run_id: str) -> bool:
        """Whether `run_id` still trains (the reaper releases the ranks of one that does not)."""
        with self.sessions() as s:
            run = s.get(Run, run_id)
            return run is not None and run.status == "active"

    def _discard(self, run_id: str) -> None:
        """A failed or lost attempt: no runner keeps anything of the run."""
        self.in_process.discard(run_id)
        self.resident.discard(run_id)

    def close(self) -> None:
        """Worker shutdown: release every resident group, save what is unsaved, log the
        held-out figures that changed since each run's last step here, then close the
        trackers."""
        self.resident.close()
        self.in_process.close()
        for tracked in self.tracked.values():  # rewards posted since the run's last step
            self._log_evals(tracked)
        self.sinks.close()

    def _log_evals(self, tracked: TrackedRun) -> int:
        """The run's changed held-out figures to the sinks (`trainer.eval_metrics`); how many
        sinks failed, a failure to read or remember them counting as one. Never raises."""
        try:
            return log_eval_figures(self.sessions, self.sinks, tracked)
        except Exception:
            logger.exception("logging the held-out figures of run %s failed", tracked.id)
            return 1

    def _record_sink_errors(self, run_id: str, step: int, failed: int) -> None:
        """`sink_errors` into a done step's metrics; the step stays done whatever happens here."""
        try:
            with self.sessions.begin() as s:
                row = s.get(TrainStep, (run_id, step))
                if row is not None:
                    row.metrics = {**(row.metrics or {}), "sink_errors": failed}
        except Exception:
            logger.exception("storing sink_errors of %s step %d failed", run_id, step)

    def _threads_per_rank(self, world_size: int) -> int:
        """The trainer's thread budget split over torchrun ranks (OMP_NUM_THREADS of each)."""
        return max(1, self.settings.threads().trainer // max(1, world_size))

    def _fail(self, run_id: str, step: int, exc: Exception) -> None:
        """Mark the step failed and hand its episodes back, so the scheduler can retry it."""
        with self.sessions.begin() as s:
            # the run row first, like the scheduler's claim: a claim sees this failure whole
            lock_run_sync(s, run_id)
            row = s.get(TrainStep, (run_id, step))
            if row is not None and row.status != StepStatus.DONE:
                row.status = StepStatus.FAILED
                row.error = f"{type(exc).__name__}: {exc}"[:2000]
                row.metrics = {"attempts": (row.metrics or {}).get("attempts", 1)}
                release_step_episodes_sync(s, run_id, step)

    def _prune(self, run_id: str, newest: int, keep: int) -> None:
        """Delete checkpoints but the newest `keep` saved ones (version 0 is the base model),
        the offers of every version but the newest, and what lost or killed attempts left.

        Only recorded paths are removed (and the attempt files no version records, which
        can never be committed: `CheckpointLayout.garbage`)."""
        with self.sessions() as s:
            versions = [pv for pv in policy_versions_sync(s, run_id) if 0 < pv.version <= newest]
        paths = {pv.version: Path(pv.checkpoint_path) for pv in versions}
        kept = [v for v in sorted(paths, reverse=True) if saved(paths[v])][:keep]
        for pv in versions:
            if pv.version == newest:
                continue
            offer_path(paths[pv.version]).unlink(missing_ok=True)
            if pv.version in kept:
                continue
            shutil.rmtree(paths[pv.version], ignore_errors=True)
            shutil.rmtree(
                pv.optimizer_path or self.layout.legacy_optimizer_dir(run_id, pv.version, True),
                ignore_errors=True,
            )
        recorded = set(paths.values()) | {
            Path(pv.optimizer_path) for pv in versions if pv.optimizer_path
        }
        for path in self.layout.garbage(run_id, recorded, newest):
            _remove(path)


def _batch_figures(step: int, samples: list[Sample], assembly: AssemblyStats) -> dict[str, Any]:
    """How the batch was assembled and how stale its samples were, for the step's metrics."""
    versions = [s.min_version for s in samples]
    return {
        "sequences": float(assembly.sequences),
        "drift_segments": float(assembly.drift_segments),
        "orphans_excluded": float(assembly.orphans_excluded),
        "staleness_max": float(step - min(versions)),
        "staleness_histogram": dict(sorted(Counter(step - v for v in versions).items())),
        "staleness_mean": float(step - statistics.fmean(versions)),
    }


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _remove_attempt(out: Path) -> None:
    """Every file an uncommitted attempt wrote under its own names."""
    for path in CheckpointLayout.attempt_files(out):
        _remove(path)


def register_tasks(app: Celery, settings: Settings) -> Trainer:
    trainer = Trainer(settings)
    # Resident ranks are released (AdamW saved if the run keeps it) and W&B and MLflow runs
    # are closed (finished) when the worker stops; a new worker resumes both
    worker_shutdown.connect(lambda **_: trainer.close(), weak=False)

    @app.task(
        name=TRAIN_STEP_TASK,
        bind=True,
        acks_late=True,
        autoretry_for=(OperationalError,),  # database briefly away: retry, with backoff
        retry_backoff=2,
        retry_backoff_max=60,
        max_retries=8,
    )
    def train_step(self, run_id: str, step: int) -> dict[str, Any]:
        return trainer.train_step(run_id, step)

    return trainer
