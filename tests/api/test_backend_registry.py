"""A backend kind added through `inference.registry` ALONE is usable end to end.

The kind "stub" is registered here, in the test process, and nowhere else:
its backend is vLLM's HTTP client, its server is `inference.stub_server`
(which speaks vLLM's API). The gateway runs in this process (uvicorn in a
thread) so that it sees the registration; the stand-in server is started by
`inference.launch` from the kind's `server_command`, as `rlgate inference
serve --backend stub` would. A run with backend "stub" is then created
through the real admin API and answers a chat completion.
"""

from __future__ import annotations

import contextlib
import sqlite3
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from core.settings import Settings
from gateway.app import create_app
from gateway.protocol import RunCreate
from inference import registry
from inference.launch import ServerConfig, running_server, server_command
from inference.registry import BackendKind
from inference.stub_server import StubConfig, StubState, flavor_of
from rlgate.cli import build_parser
from rlgate.stack import free_port
from tests.conftest import ADMIN_KEY, gateway_settings, serving_in_thread

pytestmark = pytest.mark.integration

OUTPUT_TOKENS = 5


def stub_command(cfg: ServerConfig) -> list[str]:
    """The stand-in's command line for `cfg` (what a real kind's module would provide)."""
    return [
        str(cfg.python), "-m", "inference.stub_server", "--flavor=vllm",
        f"--host={cfg.host}", f"--port={cfg.port}", f"--output-tokens={OUTPUT_TOKENS}",
    ]  # fmt: skip


@pytest.fixture
def stub_kind() -> Iterator[BackendKind]:
    kind = BackendKind(
        "stub",
        label="stand-in",
        connect="inference.vllm_http:VLLMBackend.for_url",
        server_command=stub_command,
        stub_flavor="vllm",
    )
    registry.register(kind)
    try:
        yield kind
    finally:
        registry.unregister(kind.name)


def gateway_in_process(settings: Settings) -> contextlib.AbstractContextManager[str]:
    """The real gateway app under uvicorn in a thread of this process; yields its URL."""
    return serving_in_thread(create_app(settings))


def stored(db: Path, completion_id: str) -> dict:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        prompt, output, version = conn.execute(
            "SELECT prompt_token_ids, output_token_ids, policy_version FROM completions"
            " WHERE id = ?",
            (completion_id,),
        ).fetchone()
    finally:
        conn.close()
    ids = [np.frombuffer(b, dtype="<i4").tolist() for b in (prompt, output)]  # LE int32
    return {"prompt": ids[0], "output": ids[1], "version": version}


def test_a_registered_kind_reaches_every_choice(stub_kind: BackendKind) -> None:
    assert "stub" in registry.names() and "stub" in registry.remote_names()
    parser = build_parser()
    args = parser.parse_args(["runs", "create", "--name", "n", "--model", "tiny"])
    assert args.backend == "local"
    for argv in (
        ["runs", "create", "--name", "n", "--model", "tiny", "--backend", "stub"],
        ["demo", "--backend", "stub"],
        ["inference", "serve", "--model", "tiny", "--backend", "stub"],
    ):
        assert parser.parse_args(argv).backend == "stub"
    assert RunCreate(name="n", model="tiny", backend="stub").backend == "stub"
    assert flavor_of("stub") == "vllm"
    cfg = ServerConfig(kind="stub", model_dir=Path("m"), python=Path("py"), port=9)
    assert server_command(cfg)[:3] == ["py", "-m", "inference.stub_server"]
    registry.unregister("stub")
    with pytest.raises(ValueError, match="unknown backend 'stub'"):
        RunCreate(name="n", model="tiny", backend="stub")


def test_a_registered_kind_serves_a_run_through_the_admin_api(
    stub_kind: BackendKind, tmp_path: Path, model_cache_dir: Path, tiny_model_dir: Path
) -> None:
    settings = gateway_settings(tmp_path / "data", model_cache_dir)
    server = ServerConfig(
        kind="stub", model_dir=tiny_model_dir, python=Path(sys.executable), port=free_port()
    )
    with (
        running_server(server, tmp_path / "stub.log", timeout_s=60),
        gateway_in_process(settings) as url,
        httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60
        ) as admin,
    ):
        bad = admin.post("/admin/v1/runs", json={"name": "x", "model": "tiny", "backend": "nope"})
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["param"] == "backend"
        body = {"name": "s", "model": "tiny", "backend": "stub", "replicas": [server.url]}
        created = admin.post("/admin/v1/runs", json=body)
        assert created.status_code == 201, created.text
        run = created.json()

        client = openai.OpenAI(base_url=run["base_url"], api_key=run["api_key"], max_retries=0)
        answer = client.chat.completions.create(
            model="s", messages=[{"role": "user", "content": "hi"}], max_tokens=8
        )
        assert answer.choices[0].finish_reason in ("stop", "length")
        row = stored(settings.data_dir / "rlgate.db", answer.id)
        stub = StubState(StubConfig(version=row["version"]))
        assert row["version"] == 0 and len(row["output"]) >= 1
        want = [stub.token(row["prompt"], i)[0] for i in range(len(row["output"]))]
        assert row["output"] == want, "the tokens are the stand-in's, served via the kind"
        assert httpx.get(server.url + "/stub/state").json()["requests"] >= 1
