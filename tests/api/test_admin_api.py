"""Admin API over a run holding real data: versions, checkpoints, rollback, episodes,
metrics, counters, workers, update, delete, and /metrics.

Real processes: a uvicorn gateway and a Celery worker (embedded broker,
SQLite), agents on the `openai` client, two real train steps on the tiny model.
"""

from __future__ import annotations

import io
import json
import tarfile
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.browser.rl_run import RunFixture, trained_run, wait_version

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def fx(tmp_path_factory, model_cache_dir, tiny_model_dir):
    with trained_run(tmp_path_factory.mktemp("admin-api") / "data", model_cache_dir) as run:
        yield run


@pytest.fixture
def admin(fx: RunFixture):
    with fx.admin() as client:
        yield client


def _tar_files(data: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def test_episodes_filter_and_token_detail(fx, admin) -> None:
    rid = fx.run["run_id"]
    page = admin.get(f"/admin/v1/runs/{rid}/episodes", params={"status": "trained"}).json()
    assert {e["episode_id"] for e in page["data"]} == set(fx.episodes)
    high = admin.get(f"/admin/v1/runs/{rid}/episodes", params={"reward_min": 0.5}).json()["data"]
    assert sorted(e["episode_id"] for e in high) == sorted(e for e in fx.episodes if e[-1] == "1")
    v0 = admin.get(f"/admin/v1/runs/{rid}/episodes", params={"version": 0}).json()["data"]
    assert sorted(e["episode_id"] for e in v0) == sorted(e for e in fx.episodes if e[1] == "0")
    # pages of 3, newest first, each episode once
    seen, after = [], None
    while True:
        params = {"limit": 3} | ({"after": after} if after else {})
        p = admin.get(f"/admin/v1/runs/{rid}/episodes", params=params).json()
        seen += [e["episode_id"] for e in p["data"]]
        if not p["has_more"]:
            break
        after = seen[-1]
    assert sorted(seen) == sorted(fx.episodes) and len(seen) == len(set(seen))
    for bad in ({"status": "bogus"}, {"reward_min": 2, "reward_max": 1}, {"limit": 0}):
        r = admin.get(f"/admin/v1/runs/{rid}/episodes", params=bad)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"

    d = admin.get(f"/admin/v1/runs/{rid}/episodes/s0-g0-e1").json()
    assert d["status"] == "trained" and d["reward"] == 1.0 and d["train_step"] == 0
    (turn,) = d["completions"]
    assert turn["messages"][1]["tool_calls"][0]["function"]["name"] == "add"
    assert [t["id"] for t in turn["output_tokens"]] == turn["output_token_ids"]
    assert [t["logprob"] for t in turn["output_tokens"]] == turn["output_logprobs"]
    assert all(t["trained"] for t in turn["output_tokens"])
    assert not any(t["trained"] for t in turn["prompt_tokens"])
    n_prompt = len(turn["prompt_token_ids"])
    assert turn["loss_mask"] == [0] * n_prompt + [1] * len(turn["output_token_ids"])
    # the decoded pieces put together are the prompt the model saw
    assert "add" in "".join(t["text"] for t in turn["prompt_tokens"])
    # the same ids and logprobs as the export (the trainer's input)
    export = admin.get(f"/admin/v1/runs/{rid}/export").text
    exported = [json.loads(line) for line in export.splitlines()]
    (record,) = [r for r in exported if r["episode_id"] == "s0-g0-e1"]
    assert record["completions"][0]["output_token_ids"] == turn["output_token_ids"]
    assert record["completions"][0]["output_logprobs"] == turn["output_logprobs"]
    assert admin.get(f"/admin/v1/runs/{rid}/episodes/nope").status_code == 404
    assert admin.get("/admin/v1/runs/run_nope/episodes").status_code == 404


def test_metrics_series_and_counters(fx, admin) -> None:
    rid = fx.run["run_id"]
    series = admin.get(f"/admin/v1/runs/{rid}/metrics").json()
    assert [p["step"] for p in series["points"]] == [0, 1]
    assert [p["version"] for p in series["points"]] == [1, 2]
    for p in series["points"]:
        assert p["values"]["reward_mean"] == pytest.approx(0.5)  # rewards 0 and 1 per group
        assert p["values"]["tokens_per_s"] > 0 and p["values"]["entropy"] > 0
        assert p["time"] is not None
    later = admin.get(f"/admin/v1/runs/{rid}/metrics", params={"since_step": 0}).json()
    assert [p["step"] for p in later["points"]] == [1]
    counters = admin.get(f"/admin/v1/runs/{rid}/counters").json()
    assert counters["episodes_by_status"]["trained"] >= 8
    assert counters["dropped"]["dropped_stale_episodes"] == 0
    assert counters["template_drift"] == 0


def test_trainer_wrote_its_jsonl_metrics(fx) -> None:
    log = Path(fx.data_dir) / "metrics" / fx.run["run_id"] / "metrics.jsonl"
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["version"] for x in lines[:2]] == [1, 2]
    assert all(x["reward_mean"] == pytest.approx(0.5) and "loss" in x for x in lines[:2])


def test_workers_and_queue(admin) -> None:
    # One inspect broadcast waits 1 s for replies. The worker (solo pool, polling the
    # filesystem broker) answers none while it runs a task, and on a loaded machine a
    # step of the earlier tests can still be finishing: ask for up to a minute.
    deadline = time.monotonic() + 60
    while True:
        status = admin.get("/admin/v1/workers").json()
        if (status["reachable"] and status["workers"]) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert status["reachable"] is True, status
    assert len(status["workers"]) == 1  # the one worker of the stack answered
    assert status["pending_steps"] == 0 and status["broker"] == "filesystem"


def test_versions_checkpoint_download_and_rollback(fx, admin) -> None:
    rid = fx.run["run_id"]
    versions = admin.get(f"/admin/v1/runs/{rid}/versions").json()
    assert [v["version"] for v in versions][:3] == [0, 1, 2]
    assert versions[1]["step"] == 0 and versions[1]["reward_mean"] == pytest.approx(0.5)
    assert "loss" in versions[1]["metrics"]
    assert [v["served"] for v in versions] == [False, False, True]
    r = admin.get(f"/admin/v1/runs/{rid}/versions/1/checkpoint")
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-tar"
    files = _tar_files(r.content)
    v1_weights = files[f"{rid}-v1/model.safetensors"]
    assert len(v1_weights) > 1000
    assert admin.get(f"/admin/v1/runs/{rid}/versions/9/checkpoint").status_code == 404
    assert admin.post(f"/admin/v1/runs/{rid}/versions/2/rollback").status_code == 400
    assert admin.post(f"/admin/v1/runs/{rid}/versions/9/rollback").status_code == 404

    r = admin.post(f"/admin/v1/runs/{rid}/versions/1/rollback")
    assert r.status_code == 201, r.text
    assert r.json() == {"run_id": rid, "version": 3, "rolled_back_from": 1}
    wait_version(fx, 3)  # hot-swapped like any new version
    v3 = admin.get(f"/admin/v1/runs/{rid}/versions").json()[-1]
    assert v3["version"] == 3 and v3["rolled_back_from"] == 1 and v3["served"]
    files3 = _tar_files(admin.get(f"/admin/v1/runs/{rid}/versions/3/checkpoint").content)
    assert files3[f"{rid}-v3/model.safetensors"] == v1_weights  # v1's weights, exactly
    client = openai.OpenAI(base_url=fx.run["base_url"], api_key=fx.run["api_key"])
    resp = client.chat.completions.create(
        model=fx.run["name"], messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert resp.model_extra["policy_version"] == 3  # versions stay monotonic


def test_update_run(fx, admin) -> None:
    rid = fx.run["run_id"]
    r = admin.patch(
        f"/admin/v1/runs/{rid}", json={"name": "renamed", "config": {"max_staleness": 5}}
    )
    assert r.status_code == 200, r.text
    assert r.json()["name"] == "renamed" and r.json()["config"]["max_staleness"] == 5
    for body, param in [
        ({"config": {"learning_rate": 1.0}}, "config.learning_rate"),
        ({"config": {"max_staleness": -1}}, "config"),
        ({"name": ""}, "name"),
        ({"colour": "red"}, "colour"),
    ]:
        r = admin.patch(f"/admin/v1/runs/{rid}", json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param
    assert admin.get(f"/admin/v1/runs/{rid}").json()["config"]["max_staleness"] == 5
    admin.patch(f"/admin/v1/runs/{rid}", json={"name": fx.run["name"]}).raise_for_status()


def test_delete_run(fx, admin) -> None:
    r = admin.post("/admin/v1/runs", json={"name": "doomed", "model": "tiny"})
    doomed = r.json()
    rid = doomed["run_id"]
    agent = httpx.Client(
        base_url=fx.url, headers={"Authorization": f"Bearer {doomed['api_key']}"}, timeout=60
    )
    chat = {"model": "doomed", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert agent.post("/episodes/d-1/v1/chat/completions", json=chat).status_code == 200
    r = admin.delete(f"/admin/v1/runs/{rid}")
    assert r.status_code == 409 and r.json()["error"]["code"] == "run_not_stopped"
    assert agent.post("/v1/chat/completions", json=chat).status_code == 200  # still there
    admin.post(f"/admin/v1/runs/{rid}/stop").raise_for_status()
    assert admin.delete(f"/admin/v1/runs/{rid}").json() == {"run_id": rid, "deleted": True}
    assert admin.get(f"/admin/v1/runs/{rid}").status_code == 404
    assert admin.delete(f"/admin/v1/runs/{rid}").status_code == 404
    assert agent.post("/v1/chat/completions", json=chat).status_code == 401
    assert rid not in [x["run_id"] for x in admin.get("/admin/v1/runs").json()]
    # the other run is untouched
    assert admin.get(f"/admin/v1/runs/{fx.run['run_id']}").status_code == 200


def test_prometheus_metrics(fx, admin) -> None:
    rid = fx.run["run_id"]
    text = admin.get("/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    reqs = {
        (s.labels["route"], s.labels["status"]): s.value
        for s in fams["rlgate_http_requests"].samples
        if s.name.endswith("_total")
    }
    chats = sum(v for (route, _), v in reqs.items() if route.endswith("/chat/completions"))
    assert chats >= 8
    assert not any(fx.run["run_id"] in r for r, _ in reqs)  # route templates, not raw paths
    buckets = [
        s
        for s in fams["rlgate_http_request_duration_seconds"].samples
        if s.name.endswith("_bucket") and s.labels["route"] == "/v1/rewards"
    ]
    assert buckets and buckets[-1].labels["le"] == "+Inf" and buckets[-1].value >= 8

    def value(family: str, **labels: str) -> float:
        return next(
            s.value
            for s in fams[family].samples
            if all(s.labels.get(k) == v for k, v in labels.items())
        )

    out_tokens = completions = 0
    for ep in admin.get(f"/admin/v1/runs/{rid}/episodes", params={"limit": 500}).json()["data"]:
        detail = admin.get(f"/admin/v1/runs/{rid}/episodes/{ep['episode_id']}").json()
        out_tokens += sum(len(c["output_token_ids"]) for c in detail["completions"])
        completions += len(detail["completions"])
    # counted as the completions were committed (a scrape reads no table)
    assert value("rlgate_output_tokens", run_id=rid) == out_tokens
    assert value("rlgate_completions", run_id=rid) == completions
    info = admin.get(f"/admin/v1/runs/{rid}").json()
    assert value("rlgate_served_version", run_id=rid) == info["served_version"]


def test_checkpoints_dir_is_removed_on_delete(fx, admin) -> None:
    """A deleted run's checkpoint folder goes with it (after the rows are committed)."""
    r = admin.post("/admin/v1/runs", json={"name": "gone", "model": "tiny"}).json()
    folder = Path(fx.data_dir) / "checkpoints" / r["run_id"]
    folder.mkdir(parents=True)
    (folder / "v1").mkdir()
    admin.post(f"/admin/v1/runs/{r['run_id']}/stop").raise_for_status()
    admin.delete(f"/admin/v1/runs/{r['run_id']}").raise_for_status()
    deadline = time.monotonic() + 10
    while folder.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not folder.exists()
