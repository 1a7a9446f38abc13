"""The runnable examples in examples/ run against a real gateway (they are the docs' code)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def env(gateway_server) -> dict[str, str]:
    run = gateway_server.create_run(name="examples")
    return dict(
        os.environ,
        RLGATE_BASE_URL=run["base_url"],
        RLGATE_API_KEY=run["api_key"],
        RLGATE_MODEL=run["name"],
    )


def test_openai_sdk_example(env, gateway_server) -> None:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "openai_sdk.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "episode example-1 is rewarded" in out.stdout
    assert (
        gateway_server.query("SELECT COUNT(*) FROM completions WHERE episode_id = 'example-1'")[0][
            0
        ]
        == 3
    )  # three turns of the one episode


def test_curl_example(env, gateway_server) -> None:
    out = subprocess.run(
        ["bash", str(EXAMPLES / "curl.sh")], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert '"episode_status":"rewarded"' in out.stdout


@pytest.mark.parametrize(
    ("script", "episode"), [("langchain_agent.py", "lc-1"), ("agents_sdk_agent.py", "agents-1")]
)
def test_framework_examples(env, gateway_server, script: str, episode: str) -> None:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert f"episode {episode} is rewarded" in out.stdout
    calls = gateway_server.query(
        "SELECT COUNT(*) FROM completions WHERE episode_id = ?", (episode,)
    )
    assert calls[0][0] >= 1
