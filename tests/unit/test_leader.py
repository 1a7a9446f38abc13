"""The scheduling leader: one holder of the PostgreSQL advisory lock per store, failover on loss."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from gateway.control.leader import LOCK_CLASS, AdvisoryLockLeader, SoleLeader, make_leader
from tests.integration.conftest import fresh_database


@pytest.fixture
def pg_url() -> Iterator[str]:
    with fresh_database() as url:
        yield url


async def test_one_leads_and_another_takes_over_when_it_goes(pg_url: str) -> None:
    a, b = AdvisoryLockLeader(pg_url), AdvisoryLockLeader(pg_url)
    try:
        assert await a.step() is True
        assert await b.step() is False
        assert await a.step() is True and await b.step() is False  # both keep their roles
        await a.close()  # as a process's shutdown, or its death, ends its session
        assert await b.step() is True
    finally:
        await a.close()
        await b.close()


async def test_a_leader_whose_session_is_killed_steps_down(pg_url: str) -> None:
    a, b = AdvisoryLockLeader(pg_url), AdvisoryLockLeader(pg_url)
    try:
        assert await a.step() is True
        with psycopg.connect(pg_url, autocommit=True) as conn:  # the database drops it
            # Only the leader lock's holders: the suite's other files, on other workers,
            # hold advisory locks of their own (a migration's, a swap barrier's).
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_locks "
                "WHERE locktype = 'advisory' AND granted AND classid = %s AND objsubid = 2",
                (LOCK_CLASS,),
            )
        assert await a.step() is False  # its check fails: it no longer leads
        assert await b.step() is True
        assert await a.step() is False
    finally:
        await a.close()
        await b.close()


async def test_stores_in_other_schemas_lead_apart(pg_url: str) -> None:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA other")
    a = AdvisoryLockLeader(pg_url)
    b = AdvisoryLockLeader(pg_url + "?options=-csearch_path%3Dother")
    try:
        assert await a.step() is True and await b.step() is True
    finally:
        await a.close()
        await b.close()


def test_sqlite_has_one_process_which_leads() -> None:
    assert isinstance(make_leader("sqlite:////tmp/x.db", 1.0), SoleLeader)
    assert SoleLeader.is_leader
