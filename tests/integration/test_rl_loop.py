"""The whole loop with real processes: uvicorn gateway, Celery worker on Redis, openai client.

Only the model is small (the offline `tiny` random model); every seam is real.
"""

from __future__ import annotations

import time

import openai
import pytest

from core.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _wait_served(stack, run_id: str, version: int, timeout_s: float = 180) -> dict:
    deadline = time.monotonic() + timeout_s
    with stack.admin() as admin:
        while time.monotonic() < deadline:
            info = admin.get(f"/admin/v1/runs/{run_id}").json()
            if info["served_version"] == version:
                return info
            time.sleep(0.3)
        steps = admin.get(f"/admin/v1/runs/{run_id}/steps").json()
    raise AssertionError(f"version {version} never served; steps: {steps}")


@pytest.mark.parametrize(
    ("database", "engine"),
    [("sqlite", "local"), ("postgresql", "local"), ("sqlite", "fsdp")],
)
def test_train_step_through_redis_and_hot_swap(
    database, engine, redis_url, model_cache, tmp_path, request
) -> None:
    from tests.integration.conftest import running_stack

    db_url = request.getfixturevalue("postgres_url") if database == "postgresql" else ""
    settings = Settings(
        data_dir=tmp_path / "data",
        database_url=db_url,
        broker_url=redis_url,
        queue_name=f"train-{tmp_path.name}",
        admin_key="it-admin-key",
        dev_mode=False,
        model_cache_dir=model_cache,
    )
    with running_stack(settings, tmp_path) as stack:
        with stack.admin() as admin:
            r = admin.post(
                "/admin/v1/runs",
                json={
                    "name": "it",
                    "model": "tiny",
                    "config": {
                        "group_size": 2,
                        "groups_per_step": 2,
                        "micro_batch_size": 2,
                        # fsdp: the worker launches 2 torchrun ranks (gloo) for the step, with
                        # the KL/entropy terms and AdamW state carried between steps
                        **(FSDP_CONFIG if engine == "fsdp" else {}),
                    },
                },
            )
            assert r.status_code == 201, r.text
            run = r.json()
        root = run["base_url"].removesuffix("/v1")
        rewarded = _play_two_groups(root, run["api_key"], version=0)
        info = _wait_served(stack, run["run_id"], 1)
        assert info["current_version"] == 1
        with stack.admin() as admin:
            steps = admin.get(f"/admin/v1/runs/{run['run_id']}/steps").json()
        assert [s["status"] for s in steps] == ["done"]
        assert steps[0]["n_episodes"] == rewarded
        # The behaviour logprobs the backend reported are the trainer's own: ratio 1 at step 0.
        assert steps[0]["metrics"]["ratio_max"] == pytest.approx(1.0, abs=1e-3)
        after = openai.OpenAI(base_url=run["base_url"], api_key=run["api_key"])
        resp = after.chat.completions.create(
            model="it", messages=[{"role": "user", "content": "again"}], max_tokens=4
        )
        assert resp.system_fingerprint.endswith("-v1")
        assert resp.model_extra["policy_version"] == 1

        if engine != "fsdp":
            return
        # a second FSDP step: a new torchrun group that resumes AdamW and keeps the KL term
        _play_two_groups(root, run["api_key"], version=1)
        _wait_served(stack, run["run_id"], 2)
        with stack.admin() as admin:
            steps = admin.get(f"/admin/v1/runs/{run['run_id']}/steps").json()
    first, second = steps[0]["metrics"], steps[1]["metrics"]
    assert first["optimizer_resumed"] == 0 and second["optimizer_resumed"] == 1
    assert first["kl_ref"] == pytest.approx(0.0, abs=1e-6)  # v0 is the reference
    assert second["kl_ref"] > 0 and second["entropy"] > 0
    # each version's AdamW state sits beside its checkpoint, as the store records it
    import sqlite3
    from pathlib import Path

    conn = sqlite3.connect(f"file:{settings.data_dir / 'rlgate.db'}?mode=ro", uri=True)
    rows = conn.execute(
        "SELECT version, checkpoint_path, optimizer_path FROM policy_versions "
        "WHERE run_id = ? AND version > 0 ORDER BY version",
        (run["run_id"],),
    ).fetchall()
    conn.close()
    assert [v for v, _, _ in rows] == [1, 2]
    for _, ckpt, state in rows:
        assert state == ckpt + ".optimizer" and (Path(state) / "meta.json").is_file()


FSDP_CONFIG = {
    "engine": "fsdp",
    "world_size": 2,
    "save_optimizer_state": True,
    "kl_coef": 0.05,
    "entropy_coef": 0.01,
}


def _play_two_groups(root: str, api_key: str, version: int) -> int:
    """Two groups of two episodes (rewards 0 and 1) sampled at `version`; returns 4."""
    rewarded = 0
    for g in range(2):
        for e in range(2):
            episode = f"e{version}-{g}-{e}"
            client = openai.OpenAI(
                base_url=f"{root}/groups/g{version}-{g}/episodes/{episode}/v1", api_key=api_key
            )
            resp = client.chat.completions.create(
                model="it", messages=[{"role": "user", "content": "1 + 2?"}], max_tokens=6
            )
            assert resp.system_fingerprint.endswith(f"-v{version}")
            assert resp.model_extra["episode_id"] == episode
            ack = client.post(
                "/rewards", body={"completion_id": resp.id, "reward": float(e)}, cast_to=object
            )
            assert ack["episode_status"] in ("rewarded", "queued")
            rewarded += 1
    return rewarded
