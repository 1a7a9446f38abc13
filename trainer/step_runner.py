"""Where a train step runs: one protocol, two runners, chosen from the run's `engine`.

`InProcessRunner` keeps a warm engine per run inside the worker (the local
engine). `ResidentRunner` runs a torchrun engine (FSDP, Megatron) on the run's
resident rank group (`trainer.resident_pool`); with `per_step` it releases the
group after each step, so every step starts a fresh group from the committed
checkpoint. Both write version N+1 under the attempt's own directory and, when
asked, AdamW's state beside it; neither commits anything: `trainer.tasks` does.

A runner starts from the newest saved version at or below N and the AdamW
state recorded with it; it asks `VersionSource` for those (the store knows
them) only when it needs a fresh engine or group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch

from trainer.batch import Sample
from trainer.config import RunConfig
from trainer.engine import Engine
from trainer.engines import engine_class, engine_entry
from trainer.heap import release_free_memory
from trainer.resident_pool import ResidentPool
from trainer.resident_protocol import Init
from trainer.shared_base import SharedBases
from trainer.weight_publish import StepWeights, save_due


class VersionSource(Protocol):
    """What a runner reads of the store to start a fresh engine or group."""

    def checkpoint(self, run_id: str, version: int) -> Path:
        """The newest saved checkpoint at or below `version` (raises if there is none)."""
        ...

    def optimizer(self, run_id: str, version: int, sharded: bool) -> Path | None:
        """Where AdamW's state recorded with `version` is (None: start fresh)."""
        ...


@dataclass(frozen=True)
class StepJob:
    """One step of a run from version `step` to `step + 1`."""

    run_id: str
    step: int
    cfg: RunConfig
    samples: list[Sample]
    out: Path  # this attempt's directory for version step + 1
    optimizer_out: Path | None  # this attempt's AdamW state (save_optimizer_state), else None
    model_path: Path  # the base model: tokenizer, and the reference for KL and LoRA

    @property
    def reference_dir(self) -> Path | None:
        return self.model_path if self.cfg.kl_coef > 0 or self.cfg.lora else None


class StepRunner(Protocol):
    """Runs steps of the runs it is given; holds whatever stays warm between them."""

    # AdamW's state is sharded (one directory of DCP files) rather than one file
    sharded_optimizer: ClassVar[bool]

    def run_step(self, job: StepJob) -> tuple[dict[str, Any], int]:
        """Train, write `job.out` (and `job.optimizer_out`): (metrics, torch threads per rank)."""
        ...

    def discard(self, run_id: str) -> None:
        """Forget the run's warm state without saving it (after a failed or lost attempt)."""
        ...

    def close(self) -> None:
        """Worker shutdown: save what must be saved and stop everything."""
        ...


class InProcessRunner:
    """Each run's engine warm inside the worker, rebuilt when the run's version moved on."""

    sharded_optimizer: ClassVar[bool] = False

    def __init__(self, source: VersionSource, weights: StepWeights) -> None:
        self.source, self.weights = source, weights
        self.engines: dict[str, Engine] = {}
        self.bases = SharedBases()  # LoRA engines share one frozen base per model

    def engine_for(self, job: StepJob) -> Engine:
        """The cached engine if it is at version `job.step`, else a fresh one from the newest
        saved checkpoint; a fresh engine resumes AdamW's moments when the run saves them
        (`save_optimizer_state`) and the saved state is for that version."""
        engine = self.engines.get(job.run_id)
        if engine is not None and engine.version == job.step:
            return engine
        checkpoint = self.source.checkpoint(job.run_id, job.step)
        engine = engine_class(job.cfg.engine)(
            checkpoint, job.step, job.cfg, reference_dir=job.model_path, bases=self.bases
        )
        if job.cfg.save_optimizer_state:
            engine.load_optimizer(self.source.optimizer(job.run_id, job.step, sharded=False))
        self.engines[job.run_id] = engine
        return engine

    def run_step(self, job: StepJob) -> tuple[dict[str, Any], int]:
        engine = self.engine_for(job)
        with self.weights.lock(job.run_id):  # the pause watcher may save this engine meanwhile
            metrics = engine.step(job.samples)
            metrics |= self.weights.after_step(
                job.run_id,
                job.cfg,
                job.step + 1,
                job.out,
                partial(engine.save, job.out, job.model_path),
                engine.hf_weights,
            )
        if job.optimizer_out is not None:
            engine.save_optimizer(job.optimizer_out)
        release_free_memory()  # the step's activations: back to the system (trainer.heap)
        return metrics, torch.get_num_threads()

    def discard(self, run_id: str) -> None:
        self.engines.pop(run_id, None)
        self.weights.forget(run_id)

    def close(self) -> None:
        self.weights.close()


class ResidentRunner:
    """Each run's torchrun ranks, kept between steps or (`per_step`) released after one.

    A released group saves nothing on its way out: a per-step group writes every
    version's checkpoint (it offers nothing, `weight_sync: disk`), and AdamW's state
    only when the run keeps it (`save_optimizer_state`), as every step's.
    """

    sharded_optimizer: ClassVar[bool] = True

    def __init__(
        self,
        source: VersionSource,
        pool: ResidentPool,
        *,
        threads_per_rank: Callable[[int], int],
        optimizer_for: Callable[[str, int], Path],
        weight_host: str,
        timeout_s: float,
        per_step: bool = False,
    ) -> None:
        """`optimizer_for(run_id, version)`: where a kept group's AdamW state goes when it
        is released (the attempt in progress, or the committed version's)."""
        self.source, self.pool, self.per_step = source, pool, per_step
        self.threads_per_rank, self.optimizer_for = threads_per_rank, optimizer_for
        self.weight_host, self.timeout_s = weight_host, timeout_s

    def run_step(self, job: StepJob) -> tuple[dict[str, Any], int]:
        cfg = job.cfg.model_copy(update={"weight_sync": "disk"}) if self.per_step else job.cfg
        keep = cfg.save_optimizer_state
        resume = keep or not self.per_step  # a per-step group resumes only what a run keeps
        optimizer_in = self.source.optimizer(job.run_id, job.step, sharded=True) if resume else None
        init = Init(
            config={"run": cfg.model_dump(mode="json"), "parallel": cfg.parallel.model_dump()},
            checkpoint_dir=str(self.source.checkpoint(job.run_id, job.step)),
            version=job.step,
            reference_dir=str(job.reference_dir) if job.reference_dir else None,
            optimizer_in=str(optimizer_in) if optimizer_in else None,
            run_id=job.run_id,
            weight_host=self.weight_host,
        )
        threads = self.threads_per_rank(cfg.world_size)
        metrics = self.pool.step(
            job.run_id,
            init,
            cfg.world_size,
            job.samples,
            job.out,
            job.model_path,
            optimizer_out=job.optimizer_out,
            release_optimizer=None if self.per_step else partial(self.optimizer_for, job.run_id),
            threads_per_rank=threads,
            timeout_s=self.timeout_s,
            save=save_due(cfg, job.step + 1),
            release=self.per_step,
        )
        return metrics, threads

    def discard(self, run_id: str) -> None:
        self.pool.discard(run_id)

    def close(self) -> None:
        self.pool.close()


def runs_in_process(cfg: RunConfig) -> bool:
    """Whether the run's engine runs inside the worker (else on torchrun ranks)."""
    return not engine_entry(cfg.engine).torchrun


__all__ = [
    "InProcessRunner",
    "ResidentRunner",
    "StepJob",
    "StepRunner",
    "VersionSource",
    "runs_in_process",
]
