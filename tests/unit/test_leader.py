"""The scheduling leader: one holder of the PostgreSQL advisory lock per store, failover on loss."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest

from gateway.services.leader import AdvisoryLockLeader, SoleLeader, make_leader

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/test"


@pytest.fixture
def pg_url() -> Iterator[str]:
    name = "rlgate_leader_" + uuid.uuid4().hex[:10]
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql://postgres@127.0.0.1:5432/{name}"
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


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
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_locks "
                "WHERE locktype = 'advisory' AND granted"
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
