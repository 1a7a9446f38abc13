"""Shared fixtures: the tiny model (built once per session) and a real gateway process."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sqlite3
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from core.settings import Settings
from inference.models import resolve_model
from rlgate.stack import start_gateway, stop, wait_healthy

ADMIN_KEY = "test-admin-key-not-the-dev-one"


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A `wrk` test without wrk: skipped on a developer's machine, failed in CI, which installs
    it (.ci/run), so that no load test silently stops running there."""
    if item.get_closest_marker("wrk") and shutil.which("wrk") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("wrk is required under CI=true (Debian package wrk)")
        pytest.skip("wrk is not installed (Debian package wrk)")


@pytest.fixture(scope="session")
def model_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One model cache for the whole session, shared with every gateway process."""
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture(scope="session")
def tiny_model_dir(model_cache_dir: Path) -> Path:
    """The `tiny` alias built offline once (random 2-layer Llama, ChatML tokenizer)."""
    return resolve_model("tiny", model_cache_dir)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class GatewayServer:
    """A uvicorn gateway in a child process, plus direct read access to its SQLite file."""

    url: str
    admin_key: str
    settings: Settings
    proc: subprocess.Popen
    log: Path

    @property
    def db_path(self) -> Path:
        return self.settings.data_dir / "rlgate.db"

    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_key}"}

    def create_run(
        self, name: str = "test-run", config: dict[str, Any] | None = None, model: str = "tiny"
    ) -> dict:
        """POST /admin/v1/runs (`tiny` unless told); the JSON (run_id, api_key, base_url)."""
        resp = httpx.post(
            self.url + "/admin/v1/runs",
            json={"name": name, "model": model, "config": config or {}},
            headers=self.admin_headers(),
            timeout=60,
        )
        assert resp.status_code == 201, resp.text
        return resp.json()

    def query(self, sql: str, params: tuple = ()) -> list[tuple]:
        """Read the gateway's store directly (read-only, so the server's writes are unaffected)."""
        conn = sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True, timeout=10)
        try:
            return conn.execute(sql, params).fetchall()
        finally:
            conn.close()

    def count(self, table: str) -> int:
        return self.query(f"SELECT COUNT(*) FROM {table}")[0][0]

    def completion(self, completion_id: str) -> dict[str, Any] | None:
        """One stored completion, its packed id and logprob arrays decoded as written."""
        conn = sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True, timeout=10)
        conn.row_factory = sqlite3.Row
        try:
            row = conn.execute(
                "SELECT * FROM completions WHERE id = ?", (completion_id,)
            ).fetchone()
        finally:
            conn.close()
        if row is None:
            return None
        out = dict(row)
        for name in ("prompt_token_ids", "output_token_ids"):
            out[name] = np.frombuffer(out[name], dtype="<i4").tolist()  # IntArray: LE int32
        out["output_logprobs"] = np.frombuffer(out["output_logprobs"], dtype="<f4").tolist()
        return out

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def gateway_settings(data_dir: Path, model_cache: Path, **overrides: Any) -> Settings:
    """A test gateway's settings: SQLite in `data_dir`, embedded broker, ADMIN_KEY."""
    fields: dict[str, Any] = {
        "data_dir": data_dir,
        "database_url": "",  # explicit, so a stray RLGATE_* variable cannot redirect the test
        "broker_url": "",
        "result_backend": "",
        "public_url": "",
        "admin_key": ADMIN_KEY,
        "dev_mode": False,
        "model_cache_dir": model_cache,
    }
    return Settings(**(fields | overrides))


@contextlib.contextmanager
def serving_in_thread(app: Any) -> Iterator[str]:
    """The real gateway `app` under uvicorn in a thread of this process; yields its URL."""
    import uvicorn

    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning")
    )
    thread = threading.Thread(target=server.run, name="gateway", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.config.port}"
    try:
        wait_healthy(url, timeout_s=90)
        yield url
    finally:
        server.should_exit = True
        thread.join(30)


def launch_gateway(
    data_dir: Path, model_cache: Path, extra_env: dict[str, str] | None = None, **overrides: Any
) -> GatewayServer:
    """Start a real gateway on a free loopback port and wait until /health answers 200.

    `overrides` are Settings fields; `extra_env` is added to the child's environment only.
    """
    settings = gateway_settings(data_dir, model_cache, **overrides)
    data_dir.mkdir(parents=True, exist_ok=True)
    host, port = "127.0.0.1", free_port()
    log = data_dir / "gateway.log"
    with pytest.MonkeyPatch.context() as mp:  # start_gateway copies os.environ for the child
        for name, value in (extra_env or {}).items():
            mp.setenv(name, value)
        proc = start_gateway(settings, host, port, log)
    url = f"http://{host}:{port}"
    try:
        wait_healthy(url, proc, timeout_s=90)
    except BaseException:
        stop(proc)
        raise RuntimeError("gateway did not start:\n" + log.read_text(errors="replace")) from None
    return GatewayServer(url=url, admin_key=ADMIN_KEY, settings=settings, proc=proc, log=log)


@pytest.fixture(scope="module")
def gateway_server(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, model_cache_dir: Path
) -> Iterator[GatewayServer]:
    """A real gateway (SQLite store, embedded broker, no worker) for one test module."""
    server = launch_gateway(tmp_path_factory.mktemp("gateway") / "data", model_cache_dir)
    try:
        yield server
    finally:
        stop(server.proc)


@pytest.fixture(scope="session")
def gateway_launcher(model_cache_dir: Path, tiny_model_dir: Path) -> Callable[..., GatewayServer]:
    """`launch(data_dir, extra_env=None, **settings)` for tests that need their own gateway.

    The caller stops it with `rlgate.stack.stop(server.proc)`.
    """

    def launch(data_dir: Path, extra_env: dict[str, str] | None = None, **overrides: Any):
        return launch_gateway(data_dir, model_cache_dir, extra_env, **overrides)

    return launch


@pytest.fixture
def create_run(gateway_server: GatewayServer) -> Callable[..., dict]:
    """`create_run(name=..., config=...)` against the module's gateway."""
    return gateway_server.create_run
