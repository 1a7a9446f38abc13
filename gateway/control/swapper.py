"""The swap loop: every loaded run brought to its newest version, each run on a task of its own."""

from __future__ import annotations

import asyncio
import functools
import logging
from pathlib import Path

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from core.store.models import Run
from core.store.runs import checkpoint_of, run_versions
from gateway.control.backends import BackendPool, RunServing
from inference import registry
from inference.weight_source import weights_source
from trainer.config import RunConfig

logger = logging.getLogger(__name__)


class SwapLoop:
    """Hot-swaps each loaded run's newest committed version into its serving.

    Each pass reads the newest version of every loaded run that has no swap
    under way, in one query, and starts a task for each of them that, if the
    run's `Swapper` is behind, swaps it with the run's `swap_mode` and
    `swap_clear_kv` (`inference.swap.Swapper`,
    whose docstring holds the ordering contract: the trainer's commit comes
    first, later requests start on N+1, those in flight either go on with N+1
    from their next token or finish on N, and every token records the version
    that sampled it).

    Why a task per run: one slow reload (a large model, a server draining a
    long generation, a barrier waiting for the other gateway processes) must
    delay no other run's swap and never the scheduler, which is a task of its
    own (`TrainingScheduler.run_forever`). Under the barrier it is also what
    keeps two processes, each waiting on the run the other has not looked at
    yet, from waiting forever.

    Why one read per pass: a task per run reading its own version holds as
    many store connections at once as there are runs, and on SQLite each one
    past the pool's five is a connection thread opened and closed again, pass
    after pass.

    Every gateway process runs its own loop on its own backends. How a run is
    swapped (alone, or agreed with the other processes on PostgreSQL) was
    chosen when its serving was loaded; this loop has no branch for it.
    """

    def __init__(
        self, sessions: async_sessionmaker[AsyncSession], pool: BackendPool, interval_s: float
    ) -> None:
        self.sessions = sessions
        self.pool = pool
        self.interval_s = interval_s
        self._tasks: dict[str, asyncio.Task[None]] = {}  # swaps under way, per run

    async def start_swaps(self) -> None:
        """One pass: a swap task for every loaded run that has none running."""
        idle = {r: serving for r, serving in self.pool.loaded().items() if r not in self._tasks}
        if not idle:
            return
        async with self.sessions() as s:
            newest = await run_versions(s, list(idle))
        for run_id, serving in idle.items():
            target = newest.get(run_id, 0)  # 0: the run is gone; its serving closes elsewhere
            task = asyncio.create_task(
                self._swap_logged(run_id, serving, target), name=f"swap-{run_id}"
            )
            self._tasks[run_id] = task
            task.add_done_callback(functools.partial(self._forget, run_id))

    def _forget(self, run_id: str, _: asyncio.Task[None]) -> None:
        self._tasks.pop(run_id, None)

    async def idle(self) -> None:
        """Wait for the swaps under way now (for tests and shutdown)."""
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def _swap_logged(self, run_id: str, serving: RunServing, target: int) -> None:
        try:
            await self.swap_run(run_id, serving, target)
        except Exception:  # one run's failed load must not stop the others
            logger.exception("hot swap for run %s failed; will retry", run_id)

    async def swap_run(self, run_id: str, serving: RunServing, target: int) -> None:
        """Bring one run to `target`, its newest committed version as the pass read it, if
        it is behind."""
        swapper = serving.swapper
        await swapper.check()
        if target <= swapper.version:
            return
        async with self.sessions() as s:
            run = await s.get(Run, run_id)
            if run is None:
                return
            ckpt = await checkpoint_of(s, run_id, target)
            remote = registry.get(run.backend).remote
            policy = RunConfig.model_validate(run.config).swap_policy
        if ckpt is None:
            return
        # a remote run's trainer may offer the version over a collective (weight_sync)
        source = weights_source(Path(ckpt), target) if remote else Path(ckpt)
        await swapper.swap(source, target, policy)
        if swapper.version < target:
            return  # some server did not load it; tried again on a later pass
        logger.info("run %s now serves version %d", run_id, target)

    async def run_forever(self) -> None:
        try:
            while True:
                try:
                    await self.start_swaps()
                except Exception:
                    logger.exception("swap pass failed; retrying")
                await asyncio.sleep(self.interval_s)
        finally:
            for task in list(self._tasks.values()):
                task.cancel()
