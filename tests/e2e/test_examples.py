"""The runnable examples in examples/ run against a real gateway (they are the docs' code)."""

from __future__ import annotations

import math
import os
import sqlite3
import statistics
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.integration
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _env_of(run: dict) -> dict[str, str]:
    """The environment an example reads its run from."""
    return dict(
        os.environ,
        RLGATE_BASE_URL=run["base_url"],
        RLGATE_API_KEY=run["api_key"],
        RLGATE_MODEL=run["name"],
    )


def _example(script: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """examples/`script` run to its end (Python, or bash for a .sh)."""
    runner = ["bash"] if script.endswith(".sh") else [sys.executable]
    return subprocess.run(
        [*runner, str(EXAMPLES / script)], env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def env(gateway_server) -> dict[str, str]:
    return _env_of(gateway_server.create_run(name="examples"))


def test_openai_sdk_example(env, gateway_server) -> None:
    out = _example("openai_sdk.py", env)
    assert out.returncode == 0, out.stderr
    assert "episode example-1 is rewarded" in out.stdout
    assert (
        gateway_server.query("SELECT COUNT(*) FROM completions WHERE episode_id = 'example-1'")[0][
            0
        ]
        == 3
    )  # three turns of the one episode


def test_curl_example(env, gateway_server) -> None:
    out = _example("curl.sh", env)
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
    out = _example(script, env)
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
    out = _example("token_versions.py", env)
    assert out.returncode == 0, out.stderr
    assert "versions: from token 0: v0" in out.stdout
    assert "streamed versions: from token 0: v0" in out.stdout


@pytest.mark.slow
def test_eval_agent_example(tmp_path: Path, tiny_model_dir: Path, model_cache_dir: Path) -> None:
    """The example trains through the run's base_url and evaluates through /eval on a stack with
    a worker; the held-out figures it prints are the store's evaluation episodes, recomputed
    per version, and none of those episodes was trained on."""
    from rlgate.stack import embedded_stack
    from tests.conftest import ADMIN_KEY, gateway_settings

    settings = gateway_settings(tmp_path / "data", model_cache_dir)
    args = ["--versions", "2", "--eval-every", "1", "--group-size", "2", "--max-groups", "40"]
    with embedded_stack(settings, "127.0.0.1", 0, tmp_path / "logs") as url:
        r = httpx.post(  # one group of two trains a version: v2 comes in a few groups
            url + "/admin/v1/runs",
            json={
                "name": "eval-example",
                "model": "tiny",
                "config": {"group_size": 2, "groups_per_step": 1},
            },
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=60,
        )
        assert r.status_code == 201, r.text
        run = r.json()
        out = subprocess.run(
            [sys.executable, str(EXAMPLES / "eval_agent.py"), *args],
            env=dict(
                os.environ,
                RLGATE_BASE_URL=run["base_url"],
                RLGATE_API_KEY=run["api_key"],
                RLGATE_MODEL=run["name"],
                RLGATE_ADMIN_KEY=ADMIN_KEY,
            ),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        # Training goes on while it evaluates, so a version may pass unevaluated; v0 never does.
        evaluated = [line for line in out.stdout.splitlines() if line.startswith("evaluated v")]
        assert evaluated[0] == "evaluated v0" and len(evaluated) >= 2, out.stdout
        conn = sqlite3.connect(f"file:{settings.data_dir / 'rlgate.db'}?mode=ro", uri=True)
        try:
            episodes = conn.execute(
                "SELECT e.id, e.status, e.reward, e.train_step, c.policy_version, "
                "c.version_starts FROM episodes e JOIN completions c "
                "ON c.run_id = e.run_id AND c.episode_id = e.id "
                "WHERE e.run_id = ? AND e.id LIKE 'eval-%'",
                (run["run_id"],),
            ).fetchall()
        finally:
            conn.close()
    assert len(episodes) == 8 * len(evaluated)  # the 8 held-out problems, one call each
    assert {(status, train_step) for _, status, _, train_step, _, _ in episodes} == {("eval", None)}
    by_version: dict[int, list[float]] = {}
    for _, _, reward, _, version, starts in episodes:
        if starts is None:  # one version sampled the whole reply; otherwise it spans a swap
            by_version.setdefault(version, []).append(reward)
    assert 0 in by_version and max(by_version) >= 1, by_version
    printed = [line for line in out.stdout.splitlines() if line.startswith("held-out v")]
    expected = []
    for version, rewards in sorted(by_version.items()):
        n, mean = len(rewards), statistics.fmean(rewards)
        stderr = statistics.stdev(rewards) / math.sqrt(n) if n > 1 else None
        spread = f" ± {stderr:.3f}" if stderr is not None else ""
        expected.append(f"held-out v{version}: reward {mean:.3f}{spread} over {n} episodes")
    assert printed == expected, out.stdout


def test_policies_example_files_both_agents_under_one_episode(gateway_server) -> None:
    """Two Agents SDK agents, each its own policy, one episode by its path-scoped base_url;
    the writer's fresh context would not be linked by prefix matching."""
    run = gateway_server.create_run(
        name="team-example",
        config={"lora_rank": 4, "policies": {"planner": {}, "writer": {}}},
    )
    out = _example("policies_agents.py", _env_of(run))
    assert out.returncode == 0, out.stderr
    assert "final output:" in out.stdout, out.stdout
    episode = out.stdout.split("episode ", 1)[1].split()[0]
    rows = gateway_server.query(
        "SELECT runs.policy, completions.link FROM completions"
        " JOIN runs ON runs.id = completions.run_id WHERE completions.episode_id = ?"
        " ORDER BY completions.created_at",
        (episode,),
    )
    assert [policy for policy, _ in rows] == ["planner", "writer"], rows
    assert {link for _, link in rows} == {"path"}
    statuses = gateway_server.query(
        "SELECT runs.policy, episodes.status FROM episodes JOIN runs ON runs.id = episodes.run_id"
        " WHERE episodes.id = ?",
        (episode,),
    )
    assert dict(statuses) == {"planner": "rewarded", "writer": "rewarded"}
    assert f"episode {episode} policy writer is rewarded" in out.stdout
