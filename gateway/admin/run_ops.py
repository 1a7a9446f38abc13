"""Admin operations on a run beyond creation: update, delete, versions, checkpoints, rollback.

Delete refuses a run that is not stopped, or that still has a train step queued
or running (409): stopping first lets requests already generating finish and be
stored, and waiting for the step keeps the trainer from writing into a run that
is gone. The rows then go in one transaction (all or nothing); the checkpoint
files are removed after the commit.

Rollback to version v never rewinds the version counter: it writes a NEW
version N+1 whose weights are a copy of v's and bumps the run to N+1. Versions
stay monotonic, so the hot swap (which loads any version above the served one)
and the staleness bound (measured in versions) keep working unchanged; the
copied checkpoint carries a `ROLLBACK.json` marker naming v.

A LoRA run's versions are adapters; its version 0 is the base model itself,
which a LoRA run cannot roll back to (there is no adapter to serve or train
on). `merged_checkpoint` gives any version as a full HF directory: a LoRA
adapter is merged into its base in a scratch directory the caller removes
(the download route, once its answer ends however the client leaves).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from core.store.checkpoints import CheckpointLayout, fsync_dir, fsync_tree
from core.store.models import PolicyVersion, Run, as_utc
from core.store.runs import (
    advance_version,
    bump_counter,
    checkpoint_of,
    delete_run,
    policy_runs,
    policy_versions,
)
from core.store.steps import done_steps, step_in_flight
from gateway.control.backends import BackendPool
from gateway.errors import Conflict, Gone, InvalidRequest, NotFound
from gateway.protocol_admin import (
    LIVE_CONFIG_KEYS,
    PolicyVersionPublic,
    RollbackResult,
    RunUpdate,
)
from inference.lora import ADAPTER_CONFIG, merge_adapter
from inference.weight_source import offer_path
from trainer.config import RunConfig

logger = logging.getLogger(__name__)

ROLLBACK_MARKER = "ROLLBACK.json"


class RunAdmin:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        pool: BackendPool,
        checkpoints_dir: Path,
    ) -> None:
        self.sessions = sessions
        self.pool = pool
        self.checkpoints = CheckpointLayout(checkpoints_dir)

    async def update(self, run_id: str, body: RunUpdate) -> Run:
        unsafe = sorted(set(body.config) - LIVE_CONFIG_KEYS)
        if unsafe:
            raise InvalidRequest(
                f"config.{unsafe[0]} cannot change on a live run; live knobs: "
                + ", ".join(sorted(LIVE_CONFIG_KEYS)),
                param=f"config.{unsafe[0]}",
                code="not_live_updatable",
            )
        async with self.sessions.begin() as s:
            run = await _get(s, run_id)
            if body.config:
                try:
                    cfg = RunConfig.model_validate({**run.config, **body.config})
                except (ValidationError, ValueError) as exc:
                    raise InvalidRequest(f"config: {exc}".splitlines()[0], param="config") from exc
                run.config = cfg.model_dump()
                for child in await policy_runs(s, run_id):  # a run's policies follow it
                    child.config = {**child.config, **body.config}
            if body.name is not None:
                run.name = body.name
                for child in await policy_runs(s, run_id):
                    child.name = f"{body.name}/{child.policy}"
            return run

    async def delete(self, run_id: str) -> None:
        async with self.sessions.begin() as s:
            run = await _get(s, run_id)
            if run.status not in ("stopped", "failed"):
                raise Conflict(
                    f"run {run_id!r} is {run.status}: stop it before deleting it",
                    code="run_not_stopped",
                )
            ids = [run_id, *[p.id for p in await policy_runs(s, run_id)]]  # and its policies
            for one in ids:
                if await step_in_flight(s, one) is not None:
                    raise Conflict(
                        f"run {one!r} has a train step in flight: delete it once the step ends",
                        code="step_in_flight",
                    )
            await delete_run(s, run_id)
        for one in ids:
            await self.pool.unload(one)
            await asyncio.to_thread(shutil.rmtree, self.checkpoints.run_dir(one), True)
        logger.info("deleted run %s", run_id)

    async def versions(self, run_id: str) -> list[PolicyVersionPublic]:
        serving = self.pool.loaded().get(run_id)
        served = serving.backend.version if serving else None
        async with self.sessions() as s:
            await _get(s, run_id)
            versions = await policy_versions(s, run_id)
            steps = {r.step + 1: r for r in await done_steps(s, run_id)}
            out = []
            for pv in versions:
                path = Path(pv.checkpoint_path)
                step = steps.get(pv.version)
                out.append(
                    PolicyVersionPublic(
                        version=pv.version,
                        created_at=as_utc(pv.created_at).isoformat(),
                        checkpoint_available=path.is_dir(),
                        step=step.step if step else None,
                        rolled_back_from=_rollback_source(path),
                        served=pv.version == served,
                        reward_mean=step.reward_mean if step else None,
                        loss=step.loss if step else None,
                        metrics=_scalars(step.metrics) if step else {},
                    )
                )
            return out

    async def checkpoint_dir(self, run_id: str, version: int) -> Path:
        async with self.sessions() as s:
            await _get(s, run_id)
            path = await checkpoint_of(s, run_id, version)
        if path is None:
            raise NotFound(f"run {run_id!r} has no version {version}", param="version")
        if not Path(path).is_dir() and offer_path(Path(path)).is_file():
            raise Conflict(
                f"version {version} was sent to the inference servers (weight_sync "
                "collective) but not saved yet: pausing the run writes it",
                code="checkpoint_not_saved",
            )
        if not Path(path).is_dir():
            raise Gone(
                f"the checkpoint of version {version} was pruned (keep_checkpoints)",
                param="version",
                code="checkpoint_pruned",
            )
        return Path(path)

    async def merged_checkpoint(self, run_id: str, version: int) -> tuple[Path, bool]:
        """(a full HF directory of `version`, whether it is a scratch copy to remove after use).

        A LoRA adapter is merged into the run's base model; any other checkpoint is
        already a full model and is given as it is.
        """
        source = await self.checkpoint_dir(run_id, version)
        if not (source / ADAPTER_CONFIG).is_file():
            return source, False
        async with self.sessions() as s:
            base = Path((await _get(s, run_id)).model_path)
        scratch = Path(tempfile.mkdtemp(prefix=f"merged-{run_id}-v{version}-"))
        merge = asyncio.ensure_future(
            asyncio.to_thread(merge_adapter, base, source, scratch / "model")
        )
        try:
            await asyncio.shield(merge)
        except BaseException:
            # failed, or this request was cancelled: the merge thread may still be writing,
            # so the scratch goes once it has stopped
            merge.add_done_callback(lambda _: shutil.rmtree(scratch, ignore_errors=True))
            raise
        logger.info("merged run %s v%d into its base for export", run_id, version)
        return scratch / "model", True

    async def rollback(self, run_id: str, version: int) -> RollbackResult:
        source = await self.checkpoint_dir(run_id, version)
        async with self.sessions() as s:
            run = await _get(s, run_id)
            if (
                RunConfig.model_validate(run.config).lora
                and not (source / ADAPTER_CONFIG).is_file()
            ):
                raise InvalidRequest(
                    f"version {version} of a LoRA run is its base model, not an adapter: "
                    "roll back to a trained version (1 or later)",
                    param="version",
                )
            if await step_in_flight(s, run_id) is not None:
                raise Conflict(
                    "a train step is in flight: pause the run and retry once it ends",
                    code="step_in_flight",
                )
            new = run.current_version + 1
        if version >= new - 1:
            raise InvalidRequest(
                f"version {version} is the current one; roll back to an earlier version",
                param="version",
            )
        target = self.checkpoints.attempt_dir(run_id, new)
        await asyncio.to_thread(_copy_checkpoint, source, target, version)
        async with self.sessions.begin() as s:
            if not await advance_version(s, run_id, new - 1):
                await asyncio.to_thread(shutil.rmtree, target, True)
                raise Conflict("the run moved to a new version meanwhile; retry", code="raced")
            s.add(PolicyVersion(run_id=run_id, version=new, checkpoint_path=str(target)))
            bump_counter(await s.get_one(Run, run_id), "rollbacks")
        logger.info("run %s rolled back to v%d as v%d", run_id, version, new)
        return RollbackResult(run_id=run_id, version=new, rolled_back_from=version)


async def _get(s: AsyncSession, run_id: str) -> Run:
    run = await s.get(Run, run_id)
    if run is None:
        raise NotFound(f"no run {run_id!r}", param="run_id")
    return run


def _scalars(metrics: dict | None) -> dict[str, float]:
    return {k: v for k, v in (metrics or {}).items() if isinstance(v, int | float)}


def _rollback_source(path: Path) -> int | None:
    marker = path / ROLLBACK_MARKER
    if not marker.is_file():
        return None
    return int(json.loads(marker.read_text())["rolled_back_from"])


def _copy_checkpoint(source: Path, target: Path, version: int) -> None:
    """Weights and tokenizer of `source` (no optimizer state) into `target`, then the marker;
    fsynced before the version bump records `target` (a fresh attempt directory)."""
    partial = target.with_name(target.name + ".tmp")
    shutil.copytree(source, partial, ignore=shutil.ignore_patterns("*.pt", ROLLBACK_MARKER))
    (partial / ROLLBACK_MARKER).write_text(json.dumps({"rolled_back_from": version}))
    fsync_tree(partial)
    partial.rename(target)
    fsync_dir(target.parent)


def tar_stream(root: Path, arcname: str, chunk: int = 1 << 20) -> Iterator[bytes]:
    """An uncompressed tar of `root`, produced file by file (never whole in memory)."""
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        info = tarfile.TarInfo(f"{arcname}/{path.relative_to(root).as_posix()}")
        stat = path.stat()
        info.size, info.mtime, info.mode = stat.st_size, int(stat.st_mtime), 0o644
        yield info.tobuf(format=tarfile.PAX_FORMAT)
        with path.open("rb") as f:
            while data := f.read(chunk):
                yield data
        if info.size % tarfile.BLOCKSIZE:
            yield b"\0" * (tarfile.BLOCKSIZE - info.size % tarfile.BLOCKSIZE)
    yield b"\0" * (2 * tarfile.BLOCKSIZE)
