"""Fixtures for API tests that need a gateway on PostgreSQL."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import httpx
import psycopg
import pytest

from rlgate.stack import stop

if TYPE_CHECKING:
    from tests.conftest import GatewayServer

PG_URL = "postgresql://postgres@127.0.0.1:5432/test"
USER = [{"role": "user", "content": "what is one plus two?"}]


class PgGateway:
    def __init__(self, server: GatewayServer, conn: Any, run: dict) -> None:
        self.server, self.conn, self.run = server, conn, run
        self.http = httpx.Client(
            base_url=server.url, headers={"Authorization": f"Bearer {run['api_key']}"}, timeout=60
        )

    def count(self, table: str) -> int:
        return self.conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]

    def chat(self, **fields: Any) -> httpx.Response:
        body = {"model": self.run["name"], "messages": USER, "max_tokens": 4, **fields}
        return self.http.post("/v1/chat/completions", json=body)


@pytest.fixture(scope="module")
def pg(
    gateway_launcher: Callable[..., GatewayServer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PgGateway]:
    try:
        admin = psycopg.connect(PG_URL, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        pytest.fail(f"PostgreSQL must run at {PG_URL} for this test: {exc}")
    schema = "rlgate_api_" + uuid.uuid4().hex[:10]
    admin.execute(f'CREATE SCHEMA "{schema}"')
    admin.execute(f'SET search_path TO "{schema}"')
    server = None
    try:
        server = gateway_launcher(
            tmp_path_factory.mktemp("pg-gateway") / "data",
            extra_env={"PGOPTIONS": f"-c search_path={schema}"},
            database_url=PG_URL,
        )
        gw = PgGateway(server, admin, server.create_run(name="pg-run"))
        yield gw
        gw.http.close()
    finally:
        if server is not None:
            stop(server.proc)
        admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        admin.close()
