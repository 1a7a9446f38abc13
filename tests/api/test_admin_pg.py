"""Run deletion on PostgreSQL: every row of the run goes in one transaction, others stay."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.integration

TABLES = ("api_keys", "episodes", "completions", "rewards", "responses", "policy_versions")


def test_delete_removes_every_row_of_the_run_only(pg) -> None:
    admin = httpx.Client(base_url=pg.server.url, headers=pg.server.admin_headers(), timeout=60)
    doomed = pg.server.create_run(name="pg-doomed")
    agent = httpx.Client(
        base_url=pg.server.url, headers={"Authorization": f"Bearer {doomed['api_key']}"}, timeout=60
    )
    msgs = [{"role": "user", "content": "hi"}]
    done = agent.post(
        "/episodes/pg-d1/v1/chat/completions",
        json={"model": "pg-doomed", "messages": msgs, "max_tokens": 2},
    ).json()
    agent.post("/v1/rewards", json={"completion_id": done["id"], "reward": 1.0}).raise_for_status()
    agent.post(
        "/v1/responses", json={"model": "pg-doomed", "input": "hi", "max_output_tokens": 2}
    ).raise_for_status()
    keep = pg.chat()  # the module's other run keeps its rows
    assert keep.status_code == 200

    def rows(run_id: str) -> dict[str, int]:
        return {
            t: pg.conn.execute(f"SELECT COUNT(*) FROM {t} WHERE run_id = %s", (run_id,)).fetchone()[
                0
            ]
            for t in TABLES
        }

    before = rows(doomed["run_id"])
    assert all(before[t] >= 1 for t in TABLES), before
    other_before = rows(pg.run["run_id"])
    assert admin.delete(f"/admin/v1/runs/{doomed['run_id']}").status_code == 409  # still active
    assert rows(doomed["run_id"]) == before
    admin.post(f"/admin/v1/runs/{doomed['run_id']}/stop").raise_for_status()
    assert admin.delete(f"/admin/v1/runs/{doomed['run_id']}").status_code == 200
    assert set(rows(doomed["run_id"]).values()) == {0}
    assert pg.count("runs") >= 1
    assert rows(pg.run["run_id"]) == other_before
