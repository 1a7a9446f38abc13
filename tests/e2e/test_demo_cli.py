"""`rlgate demo` end to end on the tiny model: real processes, the CLI contract, the summary."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def _query(out: Path, sql: str) -> list[tuple]:
    """`sql`'s rows from a demo's store, opened read-only."""
    conn = sqlite3.connect(f"file:{out / 'state' / 'rlgate.db'}?mode=ro", uri=True)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def test_demo_writes_contract_outputs(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    env = dict(os.environ, RLGATE_DATA_DIR=str(tmp_path / "cache"))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlgate.cli",
            "demo",
            "--model",
            "tiny",
            "--steps",
            "2",
            "--out",
            str(out),
            "--port",
            "0",
            # The random tiny model names the sum in a few percent of replies, so about one
            # group of 6 in 5 has differing rewards. One such group per step, looked for in
            # up to 24 waves of one group, misses with odds of about 0.78**24 (0.3%); six
            # in 24 groups (the defaults) missed about half the time.
            "--groups-per-step",
            "1",
            "--max-waves",
            "24",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = json.loads((out / "summary.json").read_text())
    # exit code and verdict agree: 0 only if the run learned
    assert proc.returncode == (0 if summary["learned"] else 1), proc.stdout + proc.stderr
    assert {"reward_first", "reward_last", "steps"} <= summary.keys()
    # one entry per version that sampled: the trained steps, then the final version measured.
    # The random tiny model may run out of reward variance early ("converged"); then fewer.
    steps = summary["steps"]
    n = len(steps)
    assert n == 3 or (summary["converged_early"] and n >= 2), steps
    assert [s["step"] for s in steps] == list(range(n))
    assert [s["version"] for s in steps] == list(range(n))
    assert [s["trained"] for s in steps] == [True] * (n - 1) + [False]
    assert all(0.0 <= s["reward_mean"] <= 1.0 for s in summary["steps"])
    assert (out / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "step   0 | sampled by v0" in proc.stdout

    # Held-out reward through /eval at version 0, every third version and the final one, each
    # the gateway's figure over all 8 held-out problems (greedy, so every reply is scored).
    final = steps[-1]["version"]
    held = summary["eval"]
    assert [e["version"] for e in held] == sorted({0, final, *range(3, final + 1, 3)}), held
    assert all(e["episodes"] == 8 and 0.0 <= e["mean_reward"] <= 1.0 for e in held), held
    for e in held:
        assert f"held-out v{e['version']}: reward {e['mean_reward']:.3f}" in proc.stdout
    # The store holds them as evaluation episodes, rewarded and never in a train step.
    rows = _query(
        out,
        "SELECT status, COUNT(*), COUNT(reward), COUNT(train_step) FROM episodes "
        "WHERE id LIKE 'eval-%' GROUP BY status",
    )
    assert rows == [("eval", 8 * len(held), 8 * len(held), 0)], rows


def _tiny_demo(out: Path, cache: Path, seed: int) -> subprocess.CompletedProcess:
    args = ["--model", "tiny", "--steps", "1", "--groups-per-step", "1", "--max-waves", "24"]
    args += ["--eval-every", "0", "--seed", str(seed), "--out", str(out), "--port", "0"]
    return subprocess.run(
        [sys.executable, "-m", "rlgate.cli", "demo", *args],
        env=dict(os.environ, RLGATE_DATA_DIR=str(cache)),
        capture_output=True,
        text=True,
        timeout=600,
    )


def _stored(out: Path) -> dict[str, tuple]:
    """Each training episode's group, train step and sampled tokens, by episode id."""
    rows = _query(
        out,
        "SELECT e.id, e.group_id, e.train_step, c.output_token_ids FROM episodes e "
        "JOIN completions c ON c.run_id = e.run_id AND c.episode_id = e.id",
    )
    return {ep: (group, step, tokens) for ep, group, step, tokens in rows}


def test_one_seed_gives_one_run(tmp_path: Path) -> None:
    """Two demos of one seed call with the same ids, sample the same tokens (the random tiny
    model would differ on every call unseeded) and train the same groups; another seed
    differs."""
    cache = tmp_path / "cache"
    runs = [_tiny_demo(tmp_path / f"demo{i}", cache, seed) for i, seed in enumerate((3, 3, 4))]
    for proc in runs:
        assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    first, again, other = (_stored(tmp_path / f"demo{i}") for i in range(3))
    assert len(first) >= 6 and first == again
    assert any(step is not None for _, step, _ in first.values())  # a step trained
    assert not first.keys() & other.keys()
