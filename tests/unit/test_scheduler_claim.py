"""The scheduler's claim is one consistent transaction: the trainer cannot commit inside it.

The run has a step in flight whose task went quiet, so the claim goes on
to resend it. A hook runs inside the claim, right after it read the run
(where the old code's separate reads left a gap), and tries the trainer's
commit of that step from an independent connection that does not wait for
locks. It must be refused (SQLite: the claim's `BEGIN IMMEDIATE` holds the
write lock; PostgreSQL: the claim's `FOR NO KEY UPDATE` holds the run row),
and go through once the claim is over. On the old code the commit lands
between the claim's reads. The resend goes to a real Celery app on the
embedded (filesystem) broker. A captured episode, whose foreign key only
shares the run row's key, is never held up by a claim (PostgreSQL).
"""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.ext.asyncio import async_sessionmaker
from sqlalchemy.orm import Session

from core.config import QueueConfig
from core.store.db import make_async_engine, make_sync_engine
from core.store.migrate import upgrade
from core.store.models import Run, TrainStep
from gateway.control import scheduler as scheduling
from gateway.control.scheduler import TrainingScheduler
from trainer.celery_app import make_celery

PG_URL = "postgresql://postgres@127.0.0.1:5432/test"
BUMP = "UPDATE runs SET current_version = 1 WHERE id = 'run_c' AND current_version = 0"
DONE = "UPDATE train_steps SET status = 'done' WHERE run_id = 'run_c' AND step = 0"


def _seed(url: str) -> None:
    upgrade(url)
    with Session(make_sync_engine(url)) as s, s.begin():
        s.add(
            Run(
                id="run_c",
                name="c",
                model="tiny",
                model_path="/nonexistent",
                config={},
                current_version=0,
                counters={},
            )
        )
        s.flush()
        quiet = datetime.now(UTC) - timedelta(hours=2)  # past the default step_timeout_s
        s.add(TrainStep(run_id="run_c", step=0, status="running", enqueued_at=quiet, metrics={}))


def _claim_with_hook(
    url: str, monkeypatch: pytest.MonkeyPatch, trainer_commit: Callable[[], str], broker: Path
) -> tuple[int | None, list[str]]:
    """Run one claim; the hook records what the trainer's no-wait commit did inside it."""
    seen: list[str] = []
    original = scheduling.step_in_flight

    async def hooked(session, run_id):
        seen.append(trainer_commit())
        return await original(session, run_id)

    monkeypatch.setattr(scheduling, "step_in_flight", hooked)

    async def claim() -> int | None:
        engine = make_async_engine(url)
        try:
            celery = make_celery(QueueConfig(data_dir=broker))
            scheduler = TrainingScheduler(async_sessionmaker(engine), celery)
            return await scheduler.maybe_schedule("run_c")
        finally:
            await engine.dispose()

    return asyncio.run(claim()), seen


def _state(url: str) -> tuple[int, str]:
    with Session(make_sync_engine(url)) as s:
        return s.get(Run, "run_c").current_version, s.get(TrainStep, ("run_c", 0)).status


def test_sqlite_claim_holds_the_write_lock(tmp_path: Path, monkeypatch) -> None:
    db = tmp_path / "rlgate.db"
    url = f"sqlite:///{db}"
    _seed(url)

    def trainer_commit() -> str:
        conn = sqlite3.connect(db, timeout=0)  # no busy wait: locked means refused
        try:
            conn.execute(BUMP)
            conn.execute(DONE)
            conn.commit()
            return "landed"
        except sqlite3.OperationalError as exc:
            assert "locked" in str(exc)
            return "blocked"
        finally:
            conn.close()

    step, seen = _claim_with_hook(url, monkeypatch, trainer_commit, tmp_path)
    assert seen == ["blocked"], "the trainer committed in the middle of the claim"
    assert step == 0  # the quiet step was sent again, as the state before the claim says
    assert _state(url) == (0, "running")
    assert trainer_commit() == "landed"  # after the claim, the trainer goes through
    assert _state(url) == (1, "done")


def test_a_busy_step_is_seen_without_taking_the_lock(tmp_path: Path, monkeypatch) -> None:
    """While a step is in flight (and not quiet) the claim never opens its locked part."""
    url = f"sqlite:///{tmp_path / 'rlgate.db'}"
    _seed(url)
    with sqlite3.connect(tmp_path / "rlgate.db") as conn:
        conn.execute("UPDATE train_steps SET enqueued_at = ?", (datetime.now(UTC).isoformat(),))

    async def no_lock(session, run_id):
        raise AssertionError("the claim took the lock with a step in flight")

    monkeypatch.setattr(scheduling, "lock_run_for_claim", no_lock)
    step, _ = _claim_with_hook(url, monkeypatch, lambda: "unused", tmp_path)
    assert step is None


@pytest.fixture
def pg_url(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """PG_URL on a fresh schema (made the search_path of every libpq connection)."""
    try:
        admin = psycopg.connect(PG_URL, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        pytest.fail(f"PostgreSQL must run at {PG_URL} for this test: {exc}")
    schema = "rlgate_claim_" + uuid.uuid4().hex[:10]
    admin.execute(f'CREATE SCHEMA "{schema}"')
    monkeypatch.setenv("PGOPTIONS", f"-c search_path={schema}")
    try:
        yield PG_URL
    finally:
        admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        admin.close()


@pytest.mark.integration
def test_postgres_claim_locks_the_run_row(pg_url: str, monkeypatch, tmp_path: Path) -> None:
    _seed(pg_url)

    def trainer_commit() -> str:
        with psycopg.connect(pg_url) as conn:
            # The claim cannot release its lock while this hook runs inside it, so any
            # timeout decides the same way; it only keeps a refused commit from hanging.
            conn.execute("SET lock_timeout = '200ms'")
            try:
                conn.execute(BUMP)
                conn.execute(DONE)
                conn.commit()
                return "landed"
            except psycopg.errors.LockNotAvailable:
                conn.rollback()
                return "blocked"

    step, seen = _claim_with_hook(pg_url, monkeypatch, trainer_commit, tmp_path)
    assert seen == ["blocked"], "the trainer committed in the middle of the claim"
    assert step == 0
    assert _state(pg_url) == (0, "running")
    assert trainer_commit() == "landed"
    assert _state(pg_url) == (1, "done")


@pytest.mark.integration
def test_postgres_claim_lets_captured_rows_in(pg_url: str, monkeypatch, tmp_path: Path) -> None:
    """Inserting an episode (a capture) inside the claim does not wait for its lock."""
    _seed(pg_url)

    def capture() -> str:
        with psycopg.connect(pg_url) as conn:
            conn.execute("SET lock_timeout = '200ms'")
            try:
                conn.execute(
                    "INSERT INTO episodes (run_id, id, group_id, status, created_at)"
                    " VALUES ('run_c', 'ep-during-claim', '~ungrouped', 'open', now())"
                )
                conn.commit()
                return "landed"
            except psycopg.errors.LockNotAvailable:
                conn.rollback()
                return "blocked"

    step, seen = _claim_with_hook(pg_url, monkeypatch, capture, tmp_path)
    assert seen == ["landed"], "a capture waited for the scheduler's claim"
    assert step == 0
