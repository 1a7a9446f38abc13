"""The `train_step` Celery task: one optimizer step from version N to N+1, exactly once.

Idempotent by (run, step): a step already done returns at once, and the
version bump is a conditional update (`current_version == step`), so a
retried or duplicated task can never advance the run twice. Each attempt
writes its checkpoint and AdamW state under names of its own
(`core.store.checkpoints`), fsyncs them, and the bump records them: two
live attempts of one step (a resend after `step_timeout_s`, a redelivery)
never write into the same directory, and the one that loses the bump removes
what it wrote, leaving the committed version untouched. A torchrun engine
(FSDP, Megatron) runs on the run's resident ranks (`trainer.resident_pool`),
or, with `RLGATE_RESIDENT_RANKS=false`, on a fresh torchrun group per step.
"""

from __future__ import annotations

import logging
import shutil
import statistics
import tempfile
import time
from collections import Counter
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import torch
from celery import Celery
from celery.signals import worker_shutdown
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings
from core.store.checkpoints import (
    attempt_dir,
    fsync_tree,
    garbage,
    legacy_optimizer_dir,
    optimizer_dir,
    run_dir,
)
from core.store.db import make_sync_engine
from core.store.episodes import mark_step_trained_sync, release_step_episodes_sync
from core.store.models import PolicyVersion, Run, TrainStep
from core.store.runs import advance_version_sync, lock_run_sync, policy_versions_sync
from core.store.status import StepStatus
from inference.weight_sync import offer_path, saved
from trainer.batch import Sample, load_step_samples
from trainer.celery_app import TRAIN_STEP_TASK
from trainer.config import RunConfig
from trainer.engine_base import Engine
from trainer.engine_check import EngineUnavailable, engine_unavailable
from trainer.engines import engine_class, engine_entry
from trainer.launch import run_fsdp_step, write_samples
from trainer.metrics_sinks import TrackedRun, make_sinks
from trainer.resident_pool import ResidentPool
from trainer.resident_protocol import Init
from trainer.weight_sync import hf_state
from trainer.weight_sync_steps import StepWeights, newest_saved, save_due

logger = logging.getLogger(__name__)


class StepLost(RuntimeError):
    """Another attempt of the step committed first; this one's files are removed."""


class Trainer:
    """Holds the store connection and one warm engine per run inside a worker process."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.sessions = sessionmaker(make_sync_engine(settings.resolved_database_url))
        self.engines: dict[str, Engine] = {}  # in-process engines only (not torchrun)
        # run -> the checkpoint directory of the attempt in progress in this worker
        self.pending: dict[str, Path] = {}
        self.sinks = make_sinks(settings.metrics_sinks())  # optional JSONL/TB/W&B/MLflow
        # torchrun engines: each run's ranks stay up between steps (trainer.resident_pool)
        self.resident = ResidentPool(settings.node(), settings.resident_idle_s, self._run_active)
        # weight_sync: when checkpoints are written; collective: the newest weights, offered
        self.weights = StepWeights(
            host=settings.weight_sync_host, secret=settings.weight_sync_secret
        )
        self.weights.watch(self._run_active)

    def engine_for(self, run: Run, cfg: RunConfig, session: Session) -> Engine:
        """The cached engine if it is at the run's version, else a fresh one from the checkpoint.

        A fresh engine takes the weights of version N and, when the run saves
        optimizer state (`save_optimizer_state`) and the saved state is for
        version N, the AdamW moments too; otherwise AdamW starts fresh.
        """
        engine = self.engines.get(run.id)
        if engine is not None and engine.version == run.current_version:
            return engine
        pv = newest_saved(session, run.id, run.current_version)  # collective: maybe older
        if pv is None:
            raise RuntimeError(f"run {run.id} has no checkpoint for version {run.current_version}")
        engine = engine_class(cfg.engine)(
            Path(pv.checkpoint_path), run.current_version, cfg, reference_dir=Path(run.model_path)
        )
        if cfg.save_optimizer_state:  # a restarted worker resumes the moments saved on disk
            engine.load_optimizer(self._optimizer_of(session, run.id, run.current_version))
        self.engines[run.id] = engine
        return engine

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
            self.engines.pop(run_id, None)  # it holds the lost attempt's weights
            self.resident.discard(run_id)
            self.weights.forget(run_id)
            return {"run_id": run_id, "step": step, "version": step + 1, "skipped": True}
        except OperationalError:
            # The store itself is unreachable: nothing to mark. Celery retries the task with
            # backoff (see register_tasks); the step stays "running" until then.
            self.engines.pop(run_id, None)
            self.resident.discard(run_id)
            self.weights.forget(run_id)
            raise
        except Exception as exc:
            logger.exception("step %d of run %s failed", step, run_id)
            self.engines.pop(run_id, None)
            self.resident.discard(run_id)
            self.weights.forget(run_id)
            self._fail(run_id, step, exc)
            raise

    def _train(self, run_id: str, step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        engine: Engine | None = None  # in-process engines; torchrun ones start from `checkpoint`
        checkpoint = optimizer_in = None
        with self.sessions() as s:
            run = s.get(Run, run_id)
            cfg = RunConfig.model_validate(run.config)
            tracked = TrackedRun(run.id, run.name, run.model, dict(run.config), cfg.tracking)
            if reason := engine_unavailable(cfg.engine):
                raise EngineUnavailable(reason)  # the step fails with this message
            samples, rewards, _groups, assembly = load_step_samples(s, run_id, step, cfg)
            if not samples:
                raise RuntimeError(f"step {step} of run {run_id} has no samples")
            model_path = Path(run.model_path)
            torchrun = engine_entry(cfg.engine).torchrun
            if torchrun:
                pv = newest_saved(s, run.id, run.current_version)
                if pv is None:
                    raise RuntimeError(f"run {run.id} has no checkpoint for v{run.current_version}")
                checkpoint = Path(pv.checkpoint_path)
                optimizer_in = self._optimizer_of(s, run_id, step, sharded=True)
            else:
                engine = self.engine_for(run, cfg, s)
        out = attempt_dir(self.settings.checkpoints_dir, run_id, step + 1)
        out.parent.mkdir(parents=True, exist_ok=True)
        optimizer_out = optimizer_dir(out) if cfg.save_optimizer_state else None
        self.pending[run_id] = out
        committing = False  # past this point a failure may come after the commit landed
        try:
            metrics, threads = self._run_engine(
                run_id, step, cfg, samples, out, optimizer_out, model_path,
                engine=engine, checkpoint=checkpoint, optimizer_in=optimizer_in,
            )  # fmt: skip
            versions = [s.min_version for s in samples]
            metrics |= {
                "sequences": float(assembly.sequences),
                "drift_segments": float(assembly.drift_segments),
                "orphans_excluded": float(assembly.orphans_excluded),
                "staleness_max": float(step - min(versions)),
                "staleness_histogram": dict(sorted(Counter(step - v for v in versions).items())),
                "staleness_mean": float(step - statistics.fmean(versions)),
                "torch_threads": float(threads),  # per rank under torchrun
            }
            for written in (out, optimizer_out):  # on disk before the commit records them
                if written is not None and written.exists():
                    fsync_tree(written)
            duration = time.perf_counter() - t0
            committing = True
            with self.sessions.begin() as s:
                if not advance_version_sync(s, run_id, step):
                    raise StepLost(
                        f"run {run_id} moved past version {step} during this attempt of step "
                        f"{step}: another attempt committed v{step + 1}; {out.name} is removed"
                    )
                s.add(
                    PolicyVersion(
                        run_id=run_id,
                        version=step + 1,
                        checkpoint_path=str(out),
                        optimizer_path=str(optimizer_out) if optimizer_out else None,
                    )
                )
                mark_step_trained_sync(s, run_id, step)
                row = s.get(TrainStep, (run_id, step))
                row.status = StepStatus.DONE
                row.loss = metrics["loss"]
                row.reward_mean = statistics.fmean(rewards)
                row.reward_std = statistics.pstdev(rewards)
                row.tokens = int(metrics["tokens"])
                row.duration_s = duration
                row.metrics = {"attempts": 1, **(row.metrics or {}), **metrics}  # keeps "resent"
                row.finished_at = datetime.now(UTC)
                logged = {
                    **row.metrics, "reward_mean": row.reward_mean, "reward_std": row.reward_std
                }  # fmt: skip
        except BaseException as exc:
            # Only this attempt's own files, and never once its commit may have landed (an
            # error at COMMIT): those stay, and the sweep removes them if they are unrecorded.
            if not committing or isinstance(exc, StepLost):
                _remove_attempt(out)
            raise
        finally:
            self.pending.pop(run_id, None)
        self._prune(run_id, step + 1, cfg.keep_checkpoints)
        logger.info("run %s step %d -> version %d in %.1fs", run_id, step, step + 1, duration)
        # after the commit: trackers only ever see a step that counted, and never fail it
        if failed := self.sinks.log(tracked, step + 1, logged | {"duration_s": duration}):
            self._record_sink_errors(run_id, step, failed)
        return {"run_id": run_id, "step": step, "version": step + 1, "loss": metrics["loss"]}

    def _run_engine(
        self,
        run_id: str,
        step: int,
        cfg: RunConfig,
        samples: list[Sample],
        out: Path,
        optimizer_out: Path | None,
        model_path: Path,
        *,
        engine: Engine | None,
        checkpoint: Path | None,
        optimizer_in: Path | None,
    ) -> tuple[dict[str, Any], int]:
        """One step on the run's engine, the new version written under `out` and its AdamW
        state under `optimizer_out`: (the step's metrics, torch threads per rank).

        `engine`: the in-process engine; None for a torchrun engine, whose ranks start from
        `checkpoint` and `optimizer_in` (version `step`)."""
        if engine is None and self.settings.resident_ranks:
            threads = self._threads_per_rank(cfg.world_size)
            metrics = self._resident_step(
                run_id, cfg, checkpoint, step, samples, out, model_path, optimizer_in
            )
        elif engine is None:  # torchrun ranks in a subprocess: this worker may be a child
            threads = self._threads_per_rank(cfg.world_size)
            with tempfile.TemporaryDirectory(prefix="rlgate-samples-") as tmp:
                metrics = run_fsdp_step(
                    checkpoint,
                    step,
                    cfg.model_dump(mode="json"),
                    write_samples(samples, Path(tmp) / "samples.pt"),
                    out,
                    model_path,
                    cfg.world_size,
                    parallel=cfg.parallel.model_dump(),
                    reference_dir=model_path if cfg.kl_coef > 0 or cfg.lora else None,
                    # the state recorded with the previous version, whichever worker ran it
                    optimizer_in=optimizer_in if cfg.save_optimizer_state else None,
                    optimizer_out=optimizer_out,
                    threads_per_rank=threads,
                )
        else:
            with self.weights.lock(run_id):  # the pause watcher may save this engine meanwhile
                metrics = engine.step(samples)
                metrics |= self.weights.after_step(
                    run_id,
                    cfg,
                    step + 1,
                    out,
                    partial(engine.save, out, model_path),
                    partial(hf_state, engine.model),
                )
            if optimizer_out is not None:
                engine.save_optimizer(optimizer_out)
            threads = torch.get_num_threads()
        return metrics, threads

    def _resident_step(
        self,
        run_id: str,
        cfg: RunConfig,
        checkpoint: Path,
        step: int,
        samples: list[Sample],
        out: Path,
        model_path: Path,
        optimizer_in: Path | None,
    ) -> dict[str, Any]:
        """The step on the run's resident ranks; a new group starts from `checkpoint` (v`step`)."""
        keep = cfg.save_optimizer_state  # every step; on release always (trainer.resident_pool)
        init = Init(
            config={"run": cfg.model_dump(mode="json"), "parallel": cfg.parallel.model_dump()},
            checkpoint_dir=str(checkpoint),
            version=step,
            reference_dir=str(model_path) if cfg.kl_coef > 0 or cfg.lora else None,
            # a new group resumes the moments saved for v`step`, after a step or on a release
            optimizer_in=str(optimizer_in) if optimizer_in else None,
            run_id=run_id,
            weight_host=self.settings.weight_sync_host,
        )
        return self.resident.step(
            run_id,
            init,
            cfg.world_size,
            samples,
            out,
            model_path,
            optimizer_dir=partial(self._optimizer_for, run_id),
            threads_per_rank=self._threads_per_rank(cfg.world_size),
            timeout_s=self.settings.step_timeout_s,
            every_step=keep,
            save=save_due(cfg, step + 1),  # weight_sync collective: only every few versions
        )

    def _run_active(self, run_id: str) -> bool:
        """Whether `run_id` still trains (the reaper releases the ranks of one that does not)."""
        with self.sessions() as s:
            run = s.get(Run, run_id)
            return run is not None and run.status == "active"

    def close(self) -> None:
        """Worker shutdown: release every resident group, then close the trackers."""
        self.resident.close()
        self.weights.close()
        self.sinks.close()

    def _record_sink_errors(self, run_id: str, step: int, failed: int) -> None:
        """`sink_errors` into a done step's metrics; the step stays done whatever happens here."""
        try:
            with self.sessions.begin() as s:
                row = s.get(TrainStep, (run_id, step))
                row.metrics = {**(row.metrics or {}), "sink_errors": failed}
        except Exception:
            logger.exception("storing sink_errors of %s step %d failed", run_id, step)

    def _threads_per_rank(self, world_size: int) -> int:
        """The trainer's thread budget split over torchrun ranks (OMP_NUM_THREADS of each)."""
        return max(1, self.settings.threads().trainer // max(1, world_size))

    def _optimizer_of(
        self, session: Session, run_id: str, version: int, sharded: bool = False
    ) -> Path | None:
        """Where the AdamW state of committed `version` is: the recorded path, or the layout
        before attempt directories for a version recorded without one (None: version 0)."""
        pv = session.get(PolicyVersion, (run_id, version))
        if pv is not None and pv.optimizer_path:
            return Path(pv.optimizer_path)
        if version == 0:
            return None
        return legacy_optimizer_dir(self.settings.checkpoints_dir, run_id, version, sharded)

    def _optimizer_for(self, run_id: str, version: int) -> Path:
        """A resident group's AdamW destination for `version`: the attempt in progress
        when it is the version being trained, else the committed version's recorded one."""
        pending = self.pending.get(run_id)
        if pending is not None and pending.name.startswith(f"v{version}."):
            return optimizer_dir(pending)
        with self.sessions() as s:
            found = self._optimizer_of(s, run_id, version, sharded=True)
        return found or legacy_optimizer_dir(self.settings.checkpoints_dir, run_id, version, True)

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
        can never be committed: `core.store.checkpoints.garbage`)."""
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
                pv.optimizer_path
                or legacy_optimizer_dir(self.settings.checkpoints_dir, run_id, pv.version, True),
                ignore_errors=True,
            )
        root = run_dir(self.settings.checkpoints_dir, run_id)
        recorded = set(paths.values()) | {
            Path(pv.optimizer_path) for pv in versions if pv.optimizer_path
        }
        for path in garbage(root, recorded, newest):
            _remove(path)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _remove_attempt(out: Path) -> None:
    """Every file an uncommitted attempt wrote under its own names."""
    for path in out.parent.glob(f"{out.name}*"):
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
