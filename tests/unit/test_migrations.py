"""Alembic migrations: upgrade, downgrade, upgrade again, on SQLite and on PostgreSQL."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text

from core.store.db import make_sync_engine
from core.store.migrate import alembic_config, downgrade, upgrade
from core.store.models import Base

PG_URL = "postgresql://postgres@127.0.0.1:5432/test"
APP_TABLES = {
    "runs",
    "api_keys",
    "policy_versions",
    "episodes",
    "completions",
    "rewards",
    "train_steps",
    "responses",
    "run_replicas",
    "revoked_sessions",
}


def _tables(url: str) -> set[str]:
    engine = make_sync_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def _revisions(url: str) -> list[str]:
    engine = make_sync_engine(url)
    try:
        with engine.connect() as conn:
            return [r[0] for r in conn.execute(text("SELECT version_num FROM alembic_version"))]
    finally:
        engine.dispose()


def _check_round_trip(url: str) -> None:
    head = ScriptDirectory.from_config(alembic_config(url)).get_current_head()
    assert head is not None

    upgrade(url)
    assert _tables(url) == APP_TABLES | {"alembic_version"}
    assert _revisions(url) == [head]

    downgrade(url)
    assert _tables(url) == {"alembic_version"}
    assert _revisions(url) == []

    upgrade(url)
    assert _tables(url) == APP_TABLES | {"alembic_version"}
    assert _revisions(url) == [head]
    upgrade(url)  # already at head: a no-op, not an error
    assert _revisions(url) == [head]


def _drift(url: str) -> list:
    engine = make_sync_engine(url)
    try:
        with engine.connect() as conn:
            return compare_metadata(MigrationContext.configure(conn), Base.metadata)
    finally:
        engine.dispose()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'migrations.db'}"


def test_sqlite_upgrade_downgrade_upgrade(sqlite_url: str) -> None:
    _check_round_trip(sqlite_url)


def test_migrated_schema_has_the_models_tables_and_indexes(sqlite_url: str) -> None:
    upgrade(sqlite_url)
    assert set(Base.metadata.tables) == APP_TABLES
    engine = make_sync_engine(sqlite_url)
    try:
        insp = inspect(engine)
        for name, table in Base.metadata.tables.items():
            assert {c["name"] for c in insp.get_columns(name)} == set(table.columns.keys()), name
        completion_fks = insp.get_foreign_keys("completions")
        assert any(
            fk["referred_table"] == "episodes"
            and fk["constrained_columns"] == ["run_id", "episode_id", "held_out"]
            for fk in completion_fks
        )
        unique = insp.get_unique_constraints("rewards")
        assert any(u["column_names"] == ["run_id", "idempotency_key"] for u in unique)
    finally:
        engine.dispose()


def test_migration_matches_the_models(sqlite_url: str) -> None:
    upgrade(sqlite_url)
    assert _drift(sqlite_url) == []


def test_alembic_config_accepts_percent_encoded_passwords() -> None:
    url = "postgresql://rlgate:p%40ss%25word@db.internal:5432/rlgate"
    cfg = alembic_config(url)
    assert (
        cfg.get_main_option("sqlalchemy.url")
        == "postgresql+psycopg://rlgate:p%40ss%25word@db.internal:5432/rlgate"
    )


# --- PostgreSQL ---------------------------------------------------------------------


@pytest.fixture
def pg_schema(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh schema made the search_path of every libpq connection (via PGOPTIONS)."""
    try:
        admin = psycopg.connect(PG_URL, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        pytest.fail(f"PostgreSQL must run at {PG_URL} for this test: {exc}")
    schema = "rlgate_migr_" + uuid.uuid4().hex[:10]
    admin.execute(f'CREATE SCHEMA "{schema}"')
    monkeypatch.setenv("PGOPTIONS", f"-c search_path={schema}")
    try:
        yield schema
    finally:
        admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        admin.close()


@pytest.mark.integration
def test_postgres_upgrade_downgrade_upgrade(pg_schema: str) -> None:
    engine = make_sync_engine(PG_URL)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT current_schema()")).scalar_one() == pg_schema
    finally:
        engine.dispose()
    _check_round_trip(PG_URL)


@pytest.mark.integration
def test_postgres_migration_matches_the_models(pg_schema: str) -> None:
    upgrade(PG_URL)
    assert _drift(PG_URL) == []


# --- completions.version_starts (0009) ----------------------------------------------


def _insert_completion(url: str) -> None:
    """One run, episode and completion, written with the columns 0008 has."""
    engine = make_sync_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO runs (id, name, model, model_path, backend, status, config,"
                    " current_version, counters, created_at) VALUES ('r', 'r', 'm', 'm',"
                    " 'local', 'active', '{}', 0, '{}', CURRENT_TIMESTAMP)"
                )
            )
            conn.execute(
                text(
                    "INSERT INTO episodes (run_id, id, group_id, status, created_at)"
                    " VALUES ('r', 'e', 'g', 'open', CURRENT_TIMESTAMP)"
                )
            )
            conn.execute(
                text(
                    "INSERT INTO completions (id, run_id, episode_id, messages, prompt_token_ids,"
                    " output_token_ids, output_logprobs, content, finish_reason, temperature,"
                    " policy_version, created_at, spliced, drift) VALUES ('c', 'r', 'e', '[]',"
                    " :b, :b, :b, '', 'stop', 1.0, 3, CURRENT_TIMESTAMP, false, false)"
                ),
                {"b": b""},
            )
    finally:
        engine.dispose()


def _version_starts_column(url: str) -> tuple[bool, list]:
    """Whether completions has version_starts, and its values (None per row without it)."""
    engine = make_sync_engine(url)
    try:
        has = "version_starts" in {c["name"] for c in inspect(engine).get_columns("completions")}
        with engine.connect() as conn:
            column = "version_starts" if has else "NULL"
            rows = conn.execute(text(f"SELECT {column} FROM completions")).all()
        return has, [r[0] for r in rows]
    finally:
        engine.dispose()


def _check_version_starts_migration(url: str) -> None:
    upgrade(url, "0008")
    _insert_completion(url)
    upgrade(url, "0009")
    # a row stored before the column existed reads as one version: SQL NULL
    assert _version_starts_column(url) == (True, [None])
    engine = make_sync_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(text("UPDATE completions SET version_starts = '[[0, 3], [5, 4]]'"))
    finally:
        engine.dispose()
    has, values = _version_starts_column(url)
    assert has and values in ([[[0, 3], [5, 4]]], ["[[0, 3], [5, 4]]"])
    downgrade(url, "0008")
    assert _version_starts_column(url) == (False, [None])  # the row itself is kept
    upgrade(url)
    assert _version_starts_column(url) == (True, [None])


def test_sqlite_version_starts_column_keeps_rows(sqlite_url: str) -> None:
    _check_version_starts_migration(sqlite_url)


@pytest.mark.integration
def test_postgres_version_starts_column_keeps_rows(pg_schema: str) -> None:
    _check_version_starts_migration(PG_URL)


# --- held-out episodes (0010) --------------------------------------------------------


def _check_held_out_migration(url: str) -> None:
    from sqlalchemy.exc import IntegrityError

    upgrade(url, "0009")
    _insert_completion(url)
    upgrade(url, "0010")
    engine = make_sync_engine(url)
    try:
        with engine.connect() as conn:
            # rows stored before are training rows, and are all still there
            assert conn.execute(text("SELECT held_out FROM episodes")).scalars().all() == [False]
            assert conn.execute(text("SELECT id, held_out FROM completions")).all() == [
                ("c", False)
            ]
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO episodes (run_id, id, group_id, status, created_at, held_out)"
                    " VALUES ('r', 'h', 'g', 'eval', CURRENT_TIMESTAMP, true)"
                )
            )
        columns = (
            "id, run_id, episode_id, messages, prompt_token_ids, output_token_ids,"
            " output_logprobs, content, finish_reason, temperature, policy_version, created_at,"
            " spliced, drift, held_out"
        )
        for cid, episode, held_out in (("x1", "h", "false"), ("x2", "e", "true")):
            with pytest.raises(IntegrityError), engine.begin() as conn:
                conn.execute(
                    text(
                        f"INSERT INTO completions ({columns}) VALUES ('{cid}', 'r', '{episode}',"
                        " '[]', :b, :b, :b, '', 'stop', 1.0, 0, CURRENT_TIMESTAMP, false, false,"
                        f" {held_out})"
                    ),
                    {"b": b""},
                )
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM episodes WHERE id = 'h'"))
    finally:
        engine.dispose()
    downgrade(url, "0009")
    upgrade(url)
    engine = make_sync_engine(url)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT id FROM completions")).scalars().all() == ["c"]
    finally:
        engine.dispose()


def test_sqlite_held_out_split_keeps_rows_and_refuses_crossing(sqlite_url: str) -> None:
    _check_held_out_migration(sqlite_url)


@pytest.mark.integration
def test_postgres_held_out_split_keeps_rows_and_refuses_crossing(pg_schema: str) -> None:
    _check_held_out_migration(PG_URL)


# --- policies of a run (0011) ---------------------------------------------------------


def _check_policies_migration(url: str) -> None:
    upgrade(url, "0010")
    _insert_completion(url)
    engine = make_sync_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO rewards (run_id, episode_id, value, created_at)"
                    " VALUES ('r', 'e', 1.0, CURRENT_TIMESTAMP)"
                )
            )
        upgrade(url, "0011")
        with engine.connect() as conn:
            # rows stored before are runs without policies, and are all still there
            assert conn.execute(text("SELECT id, parent_id, policy FROM runs")).all() == [
                ("r", None, None)
            ]
            assert conn.execute(text("SELECT policy FROM rewards")).all() == [(None,)]
        downgrade(url, "0010")
        with engine.connect() as conn:
            # the downgrade drops the columns in place: nothing cascades out of `runs`
            for table in ("runs", "episodes", "completions", "rewards"):
                assert conn.execute(text(f"SELECT COUNT(*) FROM {table}")).scalar() == 1, table
            assert "parent_id" not in {c["name"] for c in inspect(engine).get_columns("runs")}
    finally:
        engine.dispose()
    upgrade(url)


def test_sqlite_policies_columns_keep_every_row(sqlite_url: str) -> None:
    _check_policies_migration(sqlite_url)


@pytest.mark.integration
def test_postgres_policies_columns_keep_every_row(pg_schema: str) -> None:
    _check_policies_migration(PG_URL)
