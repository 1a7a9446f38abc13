"""The scheduler skips its full pass while nothing it depends on changed, and no longer:
new rewards end the skip at once, the clock when it expires an episode or times out a group.

SQLite store, a real Celery app on the embedded (filesystem) broker.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import update
from sqlalchemy.ext.asyncio import async_sessionmaker
from sqlalchemy.orm import Session

from core.config import QueueConfig
from core.store.db import make_async_engine, make_sync_engine
from core.store.migrate import upgrade
from core.store.models import Episode, Run
from gateway.control.scheduler import TrainingScheduler
from trainer.celery_app import make_celery

EXPIRES_IN_S = 2.5  # the old episode's expiry, from the seed


def _seed(url: str) -> float:
    """Group g's two open episodes, and one idle episode about to expire; its expiry
    (monotonic)."""
    upgrade(url)
    with Session(make_sync_engine(url)) as s, s.begin():
        cfg = {"group_size": 2, "groups_per_step": 1, "micro_batch_size": 2}
        s.add(Run(id="run_s", name="s", model="tiny", model_path="/x", config=cfg, counters={}))
        s.flush()
        s.add_all(
            [Episode(run_id="run_s", id=f"e{i}", group_id="g", status="open") for i in (0, 1)]
        )
        idle_since = datetime.now(UTC) - timedelta(seconds=3600 - EXPIRES_IN_S)  # 3600: default
        s.add(Episode(run_id="run_s", id="old", group_id="x", status="open", created_at=idle_since))
    return time.monotonic() + EXPIRES_IN_S


def _reward(url: str, episode: str, reward: float) -> None:
    with Session(make_sync_engine(url)) as s, s.begin():
        s.execute(
            update(Episode)
            .where(Episode.id == episode)
            .values(status="rewarded", reward=reward, rewarded_at=datetime.now(UTC))
        )


def test_full_pass_only_when_the_signature_changes_or_the_clock_changes_a_verdict(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'rlgate.db'}"
    expires = _seed(url)

    async def scenario() -> list:
        engine = make_async_engine(url)
        try:
            celery = make_celery(QueueConfig(data_dir=tmp_path / "broker"))
            sched = TrainingScheduler(async_sessionmaker(engine), celery, full_scan_s=0.3)
            seen = []
            for _ in range(3):  # open episodes only: one full pass, two skipped
                seen.append((await sched.maybe_schedule("run_s"), sched.full_passes))
            await asyncio.sleep(0.4)  # past full_scan_s, but no verdict changed by time yet
            assert time.monotonic() < expires, "the machine is too slow for this scenario"
            seen.append((await sched.maybe_schedule("run_s"), sched.full_passes))
            await asyncio.sleep(expires - time.monotonic() + 0.2)  # the old episode expires
            seen.append((await sched.maybe_schedule("run_s"), sched.full_passes))
            await asyncio.to_thread(_reward, url, "e0", 0.0)  # changed: at once
            seen.append((await sched.maybe_schedule("run_s"), sched.full_passes))
            seen.append((await sched.maybe_schedule("run_s"), sched.full_passes))
            await asyncio.to_thread(_reward, url, "e1", 1.0)  # the group is complete
            seen.append((await sched.maybe_schedule("run_s"), sched.full_passes))
            async with async_sessionmaker(engine)() as s:
                assert (await s.get(Episode, ("run_s", "old"))).status == "expired"
            return seen
        finally:
            await engine.dispose()

    assert asyncio.run(scenario()) == [
        (None, 1),
        (None, 1),
        (None, 1),
        (None, 1),
        (None, 2),  # the pass that expired the old episode
        (None, 3),
        (None, 3),
        (0, 4),  # step 0 claimed as soon as the second reward landed
    ]
