"""The Claude Agent SDK on a run: examples/claude_agent_sdk_agent.py against a real gateway.

The SDK drives its bundled Claude Code CLI, which calls `/v1/messages?beta=true` (streamed)
with Anthropic's beta fields. Its prompt is ~860 of `tiny`'s tokens, and an answer cut at
the output limit is resumed with one more prompt, so the run serves a copy of `tiny` that
says ANSWER and stops (tests/forced_tokens.py) with a 4096-token context.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from inference.chat_template import ChatTemplate
from tests.forced_tokens import FIRST, scripted_model

pytestmark = pytest.mark.integration
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "claude_agent_sdk_agent.py"
ANSWER = "the answer is three."


def answering_model(tiny_dir: Path, out: Path) -> Path:
    """`tiny` answering ANSWER to every chat turn, its context widened for the CLI's prompt."""
    template = ChatTemplate(tiny_dir)
    script = template.tokenizer.encode(ANSWER, add_special_tokens=False)
    model = scripted_model(tiny_dir, out, template.render(FIRST)[-1], script)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    return model


@pytest.fixture(scope="module")
def run(gateway_server, tiny_model_dir: Path, tmp_path_factory) -> dict:
    model = answering_model(tiny_model_dir, tmp_path_factory.mktemp("claude-model") / "model")
    return gateway_server.create_run("claude-agent", model=str(model))


def test_the_example_gets_the_answer_the_gateway_stored(gateway_server, run) -> None:
    env = dict(
        os.environ,
        RLGATE_BASE_URL=run["base_url"],
        RLGATE_API_KEY=run["api_key"],
        RLGATE_MODEL=run["name"],
    )
    out = subprocess.run(
        [sys.executable, str(EXAMPLE)], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr  # also when claude-agent-sdk or its CLI is missing
    assert f"result: {ANSWER!r}" in out.stdout, out.stdout + out.stderr
    assert "episode claude-agent-1 is rewarded" in out.stdout
    rows = gateway_server.query(
        "SELECT content, finish_reason, messages FROM completions"
        " WHERE run_id = ? AND episode_id = 'claude-agent-1'",
        (run["run_id"],),
    )
    assert [row[:2] for row in rows] == [(ANSWER, "stop")]  # one call: nothing was resumed
    messages = json.loads(rows[0][2])
    assert messages[0]["role"] == "system"
    assert messages[0]["content"].endswith("Answer briefly.")
    users = [m["content"] for m in messages if m["role"] == "user"]
    assert users and users[-1].endswith("What is one plus two?")
    # Every request the CLI sent was answered 200: its mid-conversation system turn is
    # accepted, not refused with a 400 that it would work around by retrying.
    metrics = httpx.get(
        gateway_server.url + "/metrics", headers=gateway_server.admin_headers(), timeout=30
    ).text
    answered = [
        line
        for line in metrics.splitlines()
        if line.startswith("rlgate_http_requests_total") and "/v1/messages" in line
    ]
    assert answered and all('status="200"' in line for line in answered), answered
