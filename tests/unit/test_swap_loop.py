"""Each run's swap runs on its own task: one slow reload delays no other run, nor scheduling.

SQLite store; the backends are stand-ins whose reload can be held on an event.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

from sqlalchemy.ext.asyncio import async_sessionmaker
from sqlalchemy.orm import Session

from core.config import QueueConfig
from core.store.db import make_async_engine, make_sync_engine
from core.store.migrate import upgrade
from core.store.models import PolicyVersion, Run
from gateway.control.backends import BackendPool, RunServing
from gateway.control.scheduler import TrainingScheduler
from gateway.control.swapper import SwapLoop
from inference.chat_template import ChatTemplate
from inference.swap import InPlaceSwap, WeightsSource
from inference.types import DRAIN, KEEP, SwapPolicy
from trainer.celery_app import make_celery


class HeldTarget:
    """A swap target whose reload waits for `release` (None: it reloads at once)."""

    def __init__(self, release: asyncio.Event | None = None) -> None:
        self.version = 0
        self.release = release
        self.loads: list[tuple[WeightsSource, int]] = []
        self.policies: list[SwapPolicy] = []

    async def load_weights(
        self, checkpoint_dir: WeightsSource, version: int, policy: SwapPolicy = KEEP
    ) -> None:
        self.loads.append((checkpoint_dir, version))
        self.policies.append(policy)
        if self.release is not None:
            await self.release.wait()
        self.version = version


class Pool:
    """The pool as the swap loop sees it: the loaded runs."""

    def __init__(self, targets: dict[str, HeldTarget]) -> None:
        template = cast(ChatTemplate, None)  # never rendered here
        self.serving = {
            run_id: RunServing(cast(Any, t), template, 0, InPlaceSwap(t))
            for run_id, t in targets.items()
        }

    def loaded(self) -> dict[str, RunServing]:
        return dict(self.serving)


class CountingScheduler(TrainingScheduler):
    passes = 0

    async def schedule_once(self) -> None:
        self.passes += 1
        await super().schedule_once()


def _seed(url: str, tmp_path: Path) -> None:
    upgrade(url)
    with Session(make_sync_engine(url)) as s, s.begin():
        # run_slow swaps with the default policy (keep); run_fast asks for drain
        for run_id, config in (("run_slow", {}), ("run_fast", {"swap_mode": "drain"})):
            ckpt = tmp_path / run_id / "v1"
            ckpt.mkdir(parents=True)
            s.add(
                Run(
                    id=run_id,
                    name=run_id,
                    model="tiny",
                    model_path="/x",
                    current_version=1,
                    config=config,
                )
            )
            s.flush()
            s.add(PolicyVersion(run_id=run_id, version=1, checkpoint_path=str(ckpt)))


async def _until(check: Any, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_a_slow_reload_delays_neither_another_runs_swap_nor_the_scheduler(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'rlgate.db'}"
    _seed(url, tmp_path)

    async def scenario() -> None:
        engine = make_async_engine(url)
        release = asyncio.Event()
        slow, fast = HeldTarget(release), HeldTarget()
        pool = Pool({"run_slow": slow, "run_fast": fast})
        sessions = async_sessionmaker(engine, expire_on_commit=False)
        swaps = SwapLoop(sessions, cast(BackendPool, pool), interval_s=0.05)
        celery = make_celery(QueueConfig(data_dir=tmp_path / "broker"))
        scheduler = CountingScheduler(sessions, celery)
        tasks = [
            asyncio.create_task(swaps.run_forever()),
            asyncio.create_task(scheduler.run_forever(0.05)),
        ]
        try:
            await _until(lambda: fast.version == 1 and slow.loads)
            passes = scheduler.passes
            await _until(lambda: scheduler.passes >= passes + 3)  # still scheduling
            assert slow.version == 0 and len(slow.loads) == 1  # held, and never started twice
            release.set()
            await _until(lambda: slow.version == 1)
            assert fast.loads == [(tmp_path / "run_fast" / "v1", 1)]
            assert (slow.policies, fast.policies) == ([KEEP], [DRAIN]), "each run's swap_mode"
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await engine.dispose()

    asyncio.run(scenario())


def test_a_pass_reads_the_versions_of_all_loaded_runs_in_one_session(tmp_path: Path) -> None:
    """Eight runs loaded, one behind: the pass opens one session for all eight, and only the
    run behind opens another (its checkpoint). A session per run's task held eight store
    connections at once, and past SQLite's pool of five each pass opened connection threads."""
    url = f"sqlite:///{tmp_path / 'rlgate.db'}"
    _seed(url, tmp_path)

    async def scenario() -> None:
        engine = make_async_engine(url)
        factory = async_sessionmaker(engine, expire_on_commit=False)
        opened = 0

        def sessions() -> Any:
            nonlocal opened
            opened += 1
            return factory()

        targets = {f"run_gone_{i}": HeldTarget() for i in range(6)}  # loaded, not in the store
        targets |= {"run_slow": HeldTarget(), "run_fast": HeldTarget()}
        targets["run_slow"].version = 1  # up to date
        swaps = SwapLoop(cast(Any, sessions), cast(BackendPool, Pool(targets)), interval_s=1)
        try:
            await swaps.start_swaps()
            await swaps.idle()
            assert opened == 2
            assert targets["run_fast"].loads == [(tmp_path / "run_fast" / "v1", 1)]
            assert all(not t.loads for name, t in targets.items() if name != "run_fast")
            await swaps.start_swaps()  # nothing behind now: one read, no swap
            await swaps.idle()
            assert opened == 3 and len(targets["run_fast"].loads) == 1
        finally:
            await engine.dispose()

    asyncio.run(scenario())
