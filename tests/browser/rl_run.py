"""A short real RL run on the tiny model, shared by the browser and admin API tests.

Every seam is real: a uvicorn gateway and a Celery worker in child processes
(embedded filesystem broker, SQLite), agents on the official `openai` client,
rewards over REST, train steps, hot swaps.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

from core.settings import Settings
from rlgate.stack import embedded_stack

ADMIN_KEY = "browser-test-admin-key"
TOOL_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
}


@dataclass
class RunFixture:
    url: str
    admin_key: str
    run: dict
    episodes: list[str]
    data_dir: Path
    others: list[dict] = field(default_factory=list)  # more trained runs on the same stack

    def admin(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {self.admin_key}"}, timeout=60
        )


def _wave(url: str, run: dict, step: int, episodes: list[str], scale: float = 1.0) -> None:
    """Two groups of two episodes; rewards (0 and `scale`) differ within each group so both
    groups train."""
    for g in range(2):
        for e in range(2):
            ep = f"s{step}-g{g}-e{e}"
            client = openai.OpenAI(
                base_url=f"{url}/groups/s{step}-g{g}/episodes/{ep}/v1", api_key=run["api_key"]
            )
            messages = [{"role": "user", "content": "What is 1 + 2? Use the add tool."}]
            if e == 1:  # a second turn after a tool result: the conversation shows tool calls
                messages += [
                    {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "3"},
                ]
            resp = client.chat.completions.create(
                model=run["name"], messages=messages, max_tokens=8
            )
            client.post(
                "/rewards", body={"completion_id": resp.id, "reward": scale * e}, cast_to=object
            )
            episodes.append(ep)


def wait_version(
    fx: RunFixture, version: int, timeout_s: float = 240, run: dict | None = None
) -> dict:
    """Wait until `run` (the fixture's own by default) serves `version`."""
    run_id = (run or fx.run)["run_id"]
    deadline = time.monotonic() + timeout_s
    with fx.admin() as admin:
        while time.monotonic() < deadline:
            info = admin.get(f"/admin/v1/runs/{run_id}").json()
            if info["current_version"] >= version and info["served_version"] == version:
                return info
            time.sleep(0.3)
        steps = admin.get(f"/admin/v1/runs/{run_id}/steps").json()
    raise AssertionError(f"version {version} never served; steps: {steps}")


def _create(url: str, name: str, model: str) -> dict:
    r = httpx.post(
        f"{url}/admin/v1/runs",
        json={
            "name": name,
            "model": model,
            "config": {"group_size": 2, "groups_per_step": 2, "micro_batch_size": 4},
        },
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=120,
    )
    assert r.status_code == 201, r.text
    return r.json()


def add_trained_run(
    fx: RunFixture, name: str, steps: int = 2, model: str = "tiny", scale: float = 1.0
) -> dict:
    """Another run on the fixture's stack, trained `steps` real steps (rewards 0 and `scale`)."""
    run = _create(fx.url, name, model)
    episodes: list[str] = []
    for step in range(steps):
        _wave(fx.url, run, step, episodes, scale)
        wait_version(fx, step + 1, run=run)
    fx.others.append(run)
    return run


@contextlib.contextmanager
def trained_run(
    data_dir: Path, model_cache: Path, steps: int = 2, model: str = "tiny"
) -> Iterator[RunFixture]:
    """A gateway + worker with one run of `model` that finished `steps` train steps."""
    settings = Settings(
        data_dir=data_dir,
        database_url="",
        broker_url="",
        result_backend="",
        public_url="",
        admin_key=ADMIN_KEY,
        dev_mode=False,
        model_cache_dir=model_cache,
        sync_interval_s=0.2,
        metrics_dir=data_dir / "metrics",  # the trainer's JSONL sink
    )
    with embedded_stack(settings, "127.0.0.1", 0, data_dir / "logs") as url:
        fx = RunFixture(url, ADMIN_KEY, _create(url, "browser-run", model), [], data_dir)
        for step in range(steps):
            _wave(url, fx.run, step, fx.episodes)
            wait_version(fx, step + 1)
        yield fx
