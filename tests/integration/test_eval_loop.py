"""Evaluation beside training, on the embedded stack: real gateway and Celery worker processes
(embedded broker, SQLite), the `openai` client as the agent, the offline `tiny` model.

A run with room for two unconsumed training episodes and no admission wait (a third new
training conversation is a 429 at once) trains three steps while 200 unrewarded evaluation
calls go through `/eval/v1`. Every evaluation call is answered; none is held or refused; no
evaluation episode ever enters a step. Rewarded evaluation episodes at each version give the
admin endpoint's per-version figures, which equal a recomputation from
`rlgate export --split eval`.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from core.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 3
UNREWARDED = 200
SCORED_PER_VERSION = 4
CONFIG = {
    "group_size": 2,
    "groups_per_step": 1,
    "max_pending_episodes": 2,
    "admission_wait_s": 0,
}


def _served(admin: httpx.Client, run_id: str) -> int | None:
    return admin.get(f"/admin/v1/runs/{run_id}").json()["served_version"]


def _wait_served(admin: httpx.Client, run_id: str, version: int, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _served(admin, run_id) == version:
            return
        time.sleep(0.3)
    steps = admin.get(f"/admin/v1/runs/{run_id}/steps").json()
    raise AssertionError(f"version {version} never served; steps: {steps}")


def _train(root: str, key: str, stack, run_id: str, errors: list) -> None:
    """STEPS steps of one group of two (rewards 0 and 1), each waiting for its swap."""
    try:
        http = httpx.Client(base_url=root, headers={"Authorization": f"Bearer {key}"}, timeout=120)
        admin = stack.admin()
        for step in range(STEPS):
            for e in range(2):
                body = {"model": "ev", "messages": [{"role": "user", "content": "1 + 2?"}],
                        "max_tokens": 6}  # fmt: skip
                path = f"/groups/g{step}/episodes/t{step}-{e}/v1/chat/completions"
                while (r := http.post(path, json=body)).status_code == 429:
                    time.sleep(0.2)  # the previous step has not consumed its group yet
                assert r.status_code == 200, r.text
                ack = http.post("/v1/rewards", json={"episode_id": f"t{step}-{e}", "reward": e})
                assert ack.status_code == 200, ack.text
            _wait_served(admin, run_id, step + 1)
    except BaseException as exc:  # reported by the main thread
        errors.append(exc)


def _export(stack_url: str, admin_key: str, run_id: str, out: Path) -> list[dict]:
    env = {**os.environ, "RLGATE_URL": stack_url, "RLGATE_ADMIN_KEY": admin_key}
    cmd = [sys.executable, "-m", "rlgate.cli", "export", "--run", run_id, "--format", "jsonl",
           "--split", "eval", "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def _token_versions(completion: dict) -> set[int]:
    starts = completion.get("version_starts") or [[0, completion["policy_version"]]]
    return {int(v) for _, v in starts}


def _recomputed(records: list[dict]) -> tuple[dict[int, list[float]], list[float]]:
    """Per version the scores of episodes sampled by it alone, and those spanning a swap."""
    by_version: dict[int, list[float]] = {}
    spanning: list[float] = []
    for rec in records:
        turns = [c["reward"] for c in rec["completions"] if c["reward"] is not None]
        score = rec["reward"] if rec["reward"] is not None else (sum(turns) if turns else None)
        if score is None:
            continue
        versions = set().union(*(_token_versions(c) for c in rec["completions"]))
        if len(versions) == 1:
            by_version.setdefault(versions.pop(), []).append(score)
        else:
            spanning.append(score)
    return by_version, spanning


def _stderr(scores: list[float]) -> float | None:
    return statistics.stdev(scores) / math.sqrt(len(scores)) if len(scores) > 1 else None


def test_evaluation_beside_training_is_served_never_trained_and_scored_per_version(
    model_cache, tmp_path
) -> None:
    from tests.integration.conftest import running_stack

    settings = Settings(
        data_dir=tmp_path / "data",
        admin_key="eval-admin-key",
        dev_mode=False,
        model_cache_dir=model_cache,
    )
    with running_stack(settings, tmp_path) as stack, stack.admin() as admin:
        created = admin.post(
            "/admin/v1/runs", json={"name": "ev", "model": "tiny", "config": CONFIG}
        )
        assert created.status_code == 201, created.text
        run = created.json()
        run_id, key = run["run_id"], run["api_key"]
        root = run["base_url"].removesuffix("/v1")
        evaluator = openai.OpenAI(base_url=root + "/eval/v1", api_key=key, max_retries=0)

        served = [0]  # the version the main thread saw served last

        def unrewarded(i: int) -> tuple[int, int]:
            # A quarter of the calls at each version: evaluation beside every step.
            while served[0] < i * (STEPS + 1) // UNREWARDED and trainer.is_alive():
                time.sleep(0.1)
            raw = evaluator.chat.completions.with_raw_response.create(
                model="ev", messages=[{"role": "user", "content": f"held out {i}"}],
                max_tokens=4,
            )  # fmt: skip
            return raw.status_code, raw.parse().model_extra["policy_version"]

        errors: list[BaseException] = []
        trainer = threading.Thread(target=_train, args=(root, key, stack, run_id, errors))
        trainer.start()
        scored: dict[str, float] = {}
        with ThreadPoolExecutor(4) as pool:
            calls = [pool.submit(unrewarded, i) for i in range(UNREWARDED)]
            while True:
                done = not trainer.is_alive()  # read first: its last version is scored below
                version = served[0] = _served(admin, run_id) or 0
                for i in range(SCORED_PER_VERSION):
                    episode = f"held-v{version}-{i}"
                    if episode in scored:
                        continue
                    client = evaluator.with_options(base_url=f"{root}/eval/episodes/{episode}/v1")
                    client.chat.completions.create(
                        model="ev", messages=[{"role": "user", "content": f"task {i}"}],
                        max_tokens=4,
                    )  # fmt: skip
                    scored[episode] = (i + version) / 4
                    ack = client.post(
                        "/rewards", body={"episode_id": episode, "reward": scored[episode]},
                        cast_to=object,
                    )  # fmt: skip
                    assert ack["episode_status"] == "eval"
                if done:
                    break
                time.sleep(0.5)
            answers = [call.result() for call in calls]
        trainer.join()
        assert not errors, errors[0]
        assert [code for code, _ in answers] == [200] * UNREWARDED  # never a 429, never held
        assert len({v for _, v in answers}) >= 2, "the evaluation calls never saw a swap"
        assert {int(e.split("-")[1][1:]) for e in scored} >= {0, STEPS}

        # No evaluation episode ever entered a step; every step trained its two episodes.
        conn = sqlite3.connect(f"file:{settings.data_dir / 'rlgate.db'}?mode=ro", uri=True)
        try:
            held = conn.execute(
                "SELECT COUNT(*), COUNT(train_step) FROM episodes WHERE run_id = ? "
                "AND status = 'eval'", (run_id,),
            ).fetchone()  # fmt: skip
            trained = conn.execute(
                "SELECT id FROM episodes WHERE run_id = ? AND train_step IS NOT NULL", (run_id,)
            ).fetchall()
        finally:
            conn.close()
        assert held == (UNREWARDED + len(scored), 0)
        assert sorted(i for (i,) in trained) == sorted(
            f"t{s}-{e}" for s in range(STEPS) for e in range(2)
        )
        steps = admin.get(f"/admin/v1/runs/{run_id}/steps").json()
        assert [s["n_episodes"] for s in steps] == [2] * STEPS

        # The admin figures are the export's, recomputed.
        figures = admin.get(f"/admin/v1/runs/{run_id}/evals")
        assert figures.status_code == 200, figures.text
        body = figures.json()
        records = _export(stack.url, stack.admin_key, run_id, tmp_path / "eval.jsonl")
        assert len(records) == UNREWARDED + len(scored)
        assert {r["episode_id"] for r in records} >= set(scored)
        by_version, spanning = _recomputed(records)
        assert [row["version"] for row in body["data"]] == sorted(by_version)
        for row in body["data"]:
            scores = by_version[row["version"]]
            assert row["episodes"] == len(scores)
            assert row["mean_reward"] == pytest.approx(statistics.fmean(scores))
            expected = _stderr(scores)
            assert (row["stderr"] is None) == (expected is None)
            if expected is not None:
                assert row["stderr"] == pytest.approx(expected)
        if spanning:
            assert body["spanning"]["episodes"] == len(spanning)
            assert body["spanning"]["mean_reward"] == pytest.approx(statistics.fmean(spanning))
        else:
            assert body["spanning"] is None
