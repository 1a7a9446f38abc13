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
    ("script", "episode", "answered"),
    [
        ("langchain_agent.py", "lc-1", "streamed:"),
        ("anthropic_sdk.py", "claude-1", "streamed:"),
        ("langchain_anthropic_agent.py", "lca-1", "streamed:"),
        # The Agents SDK example prints this only when the run completed. It catches
        # MaxTurnsExceeded for its readers (an untrained model may loop on tools); here that
        # fails the test. The tiny model ends a turn with no text about once in 400 answers,
        # and four such turns in a row are needed to run out, so the run completes.
        ("agents_sdk_agent.py", "agents-1", "final output:"),
    ],
)
def test_framework_examples(env, gateway_server, script: str, episode: str, answered: str) -> None:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert answered in out.stdout, out.stdout
    assert f"episode {episode} is rewarded" in out.stdout
    calls = gateway_server.query(
        "SELECT COUNT(*) FROM completions WHERE episode_id = ?", (episode,)
    )
    assert calls[0][0] >= 1
    if script == "anthropic_sdk.py":  # its second turn echoes the first answer's blocks
        turns = gateway_server.query(
            "SELECT spliced, drift FROM completions WHERE episode_id = ? ORDER BY created_at",
            (episode,),
        )
        assert turns == [(0, 0), (1, 0)], turns


def test_token_versions_example(env) -> None:
    """The example reads `policy_version` (and `version_starts`, when a swap happened
    mid-call) from a plain and a streamed answer; no swap happens here, so each answer
    names the run's one served version from token 0."""
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "token_versions.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "versions: from token 0: v0" in out.stdout
    assert "streamed versions: from token 0: v0" in out.stdout
