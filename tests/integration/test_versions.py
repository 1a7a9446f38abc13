"""Several policy versions of one run: weights after a swap and a restart, pruning, export.

Real processes: a uvicorn gateway and a Celery worker (embedded broker,
SQLite), two real train steps on the tiny model with `keep_checkpoints: 1`
and a learning rate high enough that every version answers differently.

- The local backend's hot swap is checked by its tokens, not only by its
  label: greedy output after each swap is the new checkpoint's greedy choice
  at every position, and its stored logprobs are the new checkpoint's, not
  the old one's (tests/integration/test_vllm.py does the same for vLLM).
  Logprobs, not a changed argmax: one step need not move any greedy choice
  of a model that the previous step made peaky, but it always moves them.
- A gateway restarted on the run at v2 serves v2: label and weights.
- v1's checkpoint is pruned: downloading it or rolling back to it answers 410
  `checkpoint_pruned` and changes nothing; a rollback to v0 still works.
- The export's `min_version` filter with samples from v0, v1 and v2, and a
  two-turn episode that spans v0 and v1.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch

from core.settings import Settings
from rlgate.stack import free_port, start_gateway, start_worker, stop, wait_healthy

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ADMIN_KEY = "versions-admin-key"
CONFIG = {
    "group_size": 2,
    "groups_per_step": 1,
    "micro_batch_size": 2,
    "keep_checkpoints": 1,
    "learning_rate": 3e-3,  # one step moves the tiny random model's argmax
    "max_pending_episodes": 64,
}
PROMPTS = ["greedy?", "the river", "hello there", "what is two plus two?", "yes or no"]
GREEDY_TOKENS = 8
TIE = 1e-4  # logits this close to the maximum count as a greedy choice (float noise)
SAME = 1e-3  # stored logprobs this close to a checkpoint's come from its weights


@dataclass
class VersionStack:
    settings: Settings
    logs: Path
    url: str = ""
    gateway: subprocess.Popen | None = None
    run: dict = field(default_factory=dict)
    greedy: dict[int, list[dict]] = field(default_factory=dict)  # version -> stored rows
    kept: dict[int, Path] = field(default_factory=dict)  # copies of checkpoints, by version

    def start_gateway(self) -> None:
        port = free_port()
        self.gateway = start_gateway(self.settings, "127.0.0.1", port, self.logs / "gateway.log")
        self.url = f"http://127.0.0.1:{port}"
        wait_healthy(self.url, self.gateway, timeout_s=120)

    def admin(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=120
        )

    def agent(self, path: str = "") -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}{path}/v1", api_key=self.run["api_key"], max_retries=0
        )

    def query(self, sql: str, params: tuple = ()) -> list[tuple]:
        db = self.settings.data_dir / "rlgate.db"
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
        try:
            return conn.execute(sql, params).fetchall()
        finally:
            conn.close()

    def completion(self, completion_id: str) -> dict[str, Any]:
        ((prompt, output, logprobs, version),) = self.query(
            "SELECT prompt_token_ids, output_token_ids, output_logprobs, policy_version "
            "FROM completions WHERE id = ?",
            (completion_id,),
        )
        return {
            "id": completion_id,
            "prompt": np.frombuffer(prompt, dtype="<i4").tolist(),
            "output": np.frombuffer(output, dtype="<i4").tolist(),
            "logprobs": np.frombuffer(logprobs, dtype="<f4").tolist(),
            "version": version,
        }

    def checkpoint(self, version: int) -> Path:
        ((path,),) = self.query(
            "SELECT checkpoint_path FROM policy_versions WHERE run_id = ? AND version = ?",
            (self.run["run_id"], version),
        )
        return Path(path)

    def info(self) -> dict:
        with self.admin() as admin:
            return admin.get(f"/admin/v1/runs/{self.run['run_id']}").json()

    def wait_served(self, version: int, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = self.info()
            if info["current_version"] >= version and info["served_version"] == version:
                return
            time.sleep(0.2)
        with self.admin() as admin:
            steps = admin.get(f"/admin/v1/runs/{self.run['run_id']}/steps").json()
        raise AssertionError(f"version {version} never served; steps: {steps}")

    def ask_greedy(self, tag: str) -> list[dict]:
        """One greedy call per prompt, each its own episode; the stored rows."""
        rows = []
        for i, prompt in enumerate(PROMPTS):
            client = self.agent(f"/groups/greedy/episodes/greedy-{tag}-{i}")
            resp = client.chat.completions.create(
                model=self.run["name"],
                messages=[{"role": "user", "content": prompt}],
                max_tokens=GREEDY_TOKENS,
                temperature=0,
            )
            row = self.completion(resp.id)
            assert resp.model_extra["policy_version"] == row["version"]
            rows.append(row)
        return rows


class Reference:
    """The checkpoints themselves, in transformers (float32), outside the gateway."""

    def __init__(self) -> None:
        self._models: dict[Path, Any] = {}

    def model(self, path: Path):
        from transformers import AutoModelForCausalLM

        if path not in self._models:
            m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            self._models[path] = m.eval()
        return self._models[path]

    def off_greedy(self, path: Path, prompt: list[int], output: list[int]) -> int:
        """Positions where `output` is not `path`'s greedy choice (within TIE)."""
        with torch.no_grad():
            logits = self.model(path)(torch.tensor([prompt + output])).logits[0]
        rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(output)]
        chosen = rows[torch.arange(len(output)), torch.tensor(output)]
        return int((chosen < rows.max(dim=-1).values - TIE).sum())

    def logprob_gap(self, path: Path, row: dict) -> float:
        """Largest distance between the row's stored logprobs and `path`'s (temperature 1)."""
        with torch.no_grad():
            logits = self.model(path)(torch.tensor([row["prompt"] + row["output"]])).logits[0]
        start = len(row["prompt"]) - 1
        lps = torch.log_softmax(logits[start : start + len(row["output"])], dim=-1)
        expected = lps[torch.arange(len(row["output"])), torch.tensor(row["output"])]
        return float((expected - torch.tensor(row["logprobs"])).abs().max())


@pytest.fixture(scope="module")
def reference() -> Reference:
    return Reference()


def _wave(stack: VersionStack, step: int) -> None:
    """One group of two episodes, rewards 0 and 1: enough for one train step.

    The two prompts differ, so the step's gradient is never zero: two samples
    with the same tokens and advantages of +1 and -1 would cancel exactly.
    """
    for e in range(2):
        client = stack.agent(f"/groups/g{step}/episodes/w{step}-{e}")
        resp = client.chat.completions.create(
            model=stack.run["name"],
            messages=[{"role": "user", "content": f"What is {e} + 2?"}],
            max_tokens=8,
        )
        client.post("/rewards", body={"completion_id": resp.id, "reward": float(e)}, cast_to=object)


def _span_turn(stack: VersionStack, history: list[dict]) -> None:
    """One more turn of the unrewarded episode `span` (it never trains)."""
    client = stack.agent("/groups/span/episodes/span")
    history.append({"role": "user", "content": f"turn {len(history) // 2}"})
    resp = client.chat.completions.create(model=stack.run["name"], messages=history, max_tokens=4)
    history.append({"role": "assistant", "content": resp.choices[0].message.content or ""})


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model_cache_dir: Path, tiny_model_dir: Path) -> Iterator[VersionStack]:
    tmp = tmp_path_factory.mktemp("versions")
    settings = Settings(
        data_dir=tmp / "data",
        database_url="",
        broker_url="",
        result_backend="",
        public_url="",
        admin_key=ADMIN_KEY,
        dev_mode=False,
        model_cache_dir=model_cache_dir,
        sync_interval_s=0.2,
    )
    settings.data_dir.mkdir(parents=True)
    stack = VersionStack(settings, tmp)
    worker = start_worker(settings, tmp / "worker.log")
    try:
        stack.start_gateway()
        with stack.admin() as admin:
            r = admin.post(
                "/admin/v1/runs", json={"name": "versions", "model": "tiny", "config": CONFIG}
            )
            assert r.status_code == 201, r.text
            stack.run = r.json()
        span: list[dict] = []
        stack.greedy[0] = stack.ask_greedy("v0")
        _span_turn(stack, span)  # sampled by v0
        stack.kept[0] = stack.checkpoint(0)
        for step in (0, 1):
            _wave(stack, step)
            stack.wait_served(step + 1)
            version = step + 1
            stack.greedy[version] = stack.ask_greedy(f"v{version}")
            # keep_checkpoints=1 prunes v1 once v2 is written: copy it for the reference
            stack.kept[version] = tmp / f"kept-v{version}"
            shutil.copytree(stack.checkpoint(version), stack.kept[version])
            if version == 1:
                _span_turn(stack, span)  # the same episode, now sampled by v1
        stack.agent("/groups/late/episodes/late").chat.completions.create(
            model=stack.run["name"], messages=[{"role": "user", "content": "late"}], max_tokens=2
        )
        yield stack
    finally:
        if stack.gateway is not None:
            stop(stack.gateway)
        stop(worker)


# --- the hot swap changes the tokens, not only the label ------------------------------------


@pytest.mark.parametrize("old,new", [(0, 1), (1, 2)])
def test_greedy_after_a_swap_comes_from_the_new_weights(
    stack: VersionStack, reference: Reference, old: int, new: int
) -> None:
    rows = stack.greedy[new]
    assert {r["version"] for r in rows} == {new}
    for row in rows:
        assert reference.off_greedy(stack.kept[new], row["prompt"], row["output"]) == 0, row
        assert reference.logprob_gap(stack.kept[new], row) < SAME, row
    # With a label-only swap the stored logprobs would be the old weights' (all gaps ~0);
    # one step at this learning rate moves them well past SAME.
    gaps = [reference.logprob_gap(stack.kept[old], r) for r in rows]
    assert max(gaps) > SAME, gaps


# --- pruning, and a rollback to a pruned version -----------------------------------------------


def test_keep_checkpoints_prunes_older_versions(stack: VersionStack) -> None:
    rid = stack.run["run_id"]
    root = stack.settings.checkpoints_dir / rid
    # only the newest version's directory is left, the one the store records
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("v")) == [
        stack.checkpoint(2).name
    ]
    with stack.admin() as admin:
        versions = admin.get(f"/admin/v1/runs/{rid}/versions").json()
    assert [(v["version"], v["checkpoint_available"]) for v in versions] == [
        (0, True),  # the base model is never pruned
        (1, False),
        (2, True),
    ]


def test_a_pruned_checkpoint_is_410_for_download_and_rollback(stack: VersionStack) -> None:
    rid = stack.run["run_id"]
    root = stack.settings.checkpoints_dir / rid
    before = (
        stack.info(),
        stack.query("SELECT version, checkpoint_path FROM policy_versions ORDER BY version"),
        sorted(p.name for p in root.iterdir()),
    )
    with stack.admin() as admin:
        for resp in (
            admin.get(f"/admin/v1/runs/{rid}/versions/1/checkpoint"),
            admin.post(f"/admin/v1/runs/{rid}/versions/1/rollback"),
        ):
            assert resp.status_code == 410, resp.text
            err = resp.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert (err["param"], err["code"]) == ("version", "checkpoint_pruned")
            assert "keep_checkpoints" in err["message"]
        # a version that never existed stays a 404
        assert admin.post(f"/admin/v1/runs/{rid}/versions/7/rollback").status_code == 404
    after = (
        stack.info(),
        stack.query("SELECT version, checkpoint_path FROM policy_versions ORDER BY version"),
        sorted(p.name for p in root.iterdir()),
    )
    # nothing half-done: no new version, no copied or partial folder, no counter
    assert after[1:] == before[1:]
    assert after[0]["current_version"] == before[0]["current_version"] == 2
    assert "rollbacks" not in after[0]["counters"]
    assert after[0]["served_version"] == 2


# --- export by version ----------------------------------------------------------------------


def test_export_min_version_with_several_versions(stack: VersionStack) -> None:
    rid = stack.run["run_id"]
    oldest: dict[str, int] = dict(
        stack.query(
            "SELECT episode_id, MIN(policy_version) FROM completions WHERE run_id = ? "
            "GROUP BY episode_id",
            (rid,),
        )
    )
    assert set(oldest.values()) == {0, 1, 2}
    assert oldest["span"] == 0 and oldest["w1-0"] == 1 and oldest["late"] == 2
    with stack.admin() as admin:
        for min_version in (0, 1, 2, 3):
            resp = admin.get(f"/admin/v1/runs/{rid}/export", params={"min_version": min_version})
            assert resp.status_code == 200, resp.text
            records = [json.loads(line) for line in resp.text.splitlines()]
            got = {r["episode_id"] for r in records}
            assert got == {e for e, v in oldest.items() if v >= min_version}, min_version
            for r in records:
                assert all(c["policy_version"] >= min_version for c in r["completions"])
            # the episode that spans v0 and v1 goes with its oldest turn
            assert ("span" in got) == (min_version == 0)
        spans = admin.get(f"/admin/v1/runs/{rid}/export", params={"min_version": 0}).text
    (span,) = [r for r in map(json.loads, spans.splitlines()) if r["episode_id"] == "span"]
    assert [c["policy_version"] for c in span["completions"]] == [0, 1]


# --- a restarted gateway, then a rollback to the base model ------------------------------------


def test_a_restarted_gateway_serves_its_version_label_and_weights(
    stack: VersionStack, reference: Reference
) -> None:
    stop(stack.gateway)
    stack.start_gateway()
    assert stack.info()["current_version"] == 2
    rows = stack.ask_greedy("restarted")
    assert {r["version"] for r in rows} == {2}
    assert stack.info()["served_version"] == 2
    for row, before in zip(rows, stack.greedy[2], strict=True):
        assert row["output"] == before["output"]  # the same answers as before the restart
        assert reference.off_greedy(stack.kept[2], row["prompt"], row["output"]) == 0
    assert any(reference.off_greedy(stack.kept[0], r["prompt"], r["output"]) > 0 for r in rows), (
        "the restarted gateway answers like the base model"
    )


def test_rollback_to_the_base_model_serves_its_weights(
    stack: VersionStack, reference: Reference
) -> None:
    rid = stack.run["run_id"]
    with stack.admin() as admin:
        r = admin.post(f"/admin/v1/runs/{rid}/versions/0/rollback")
    assert r.status_code == 201, r.text
    assert r.json() == {"run_id": rid, "version": 3, "rolled_back_from": 0}
    stack.wait_served(3)
    rows = stack.ask_greedy("rolled-back")
    assert {r["version"] for r in rows} == {3}
    for row, base in zip(rows, stack.greedy[0], strict=True):
        assert row["output"] == base["output"]
        assert reference.off_greedy(stack.kept[0], row["prompt"], row["output"]) == 0
