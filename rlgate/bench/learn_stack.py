"""rlgate's side of `rlgate bench learn`: the embedded stack and a plain-`openai` agent.

The agent is what a new user writes: `groups_in_flight` groups at a time,
each group `group_size` concurrent `openai.AsyncOpenAI` clients on a
path-scoped base_url (`/groups/{g}/episodes/{e}/v1`), default SDK retries,
one chat completion per episode, then the group's rewards in one
`POST /v1/rewards` by `episode_id`. It stops launching groups once the
budget of completions is reached. Problems come from the task's seeded
training order, the order TRL's side uses.

The run gets the shared hyperparameters (group size, groups per step, learning
rate, clip range, seed) and rlgate's defaults for everything else: no
staleness, admission or batch override. Training has finished when no step
is queued or running and the version stops moving; the newest checkpoint is
then fetched through the admin API (a tar stream) for evaluation.

Everything is read through the public HTTP API: steps, metrics, counters,
episodes, versions.
"""

from __future__ import annotations

import asyncio
import statistics
import tarfile
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import httpx
import openai

from core.settings import Settings
from rlgate.learn_task import Problem, messages, score, train_order
from rlgate.stack import embedded_stack

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

    from rlgate.bench.learn import LearnConfig

QUIET_POLLS = 5  # one second apart: well past the scheduler's full scan (2 s by default)


@dataclass
class Sample:
    t: float  # seconds since the agent started, when the completion came back
    reward: float
    group_id: str
    episode_id: str


def run_rlgate(cfg: LearnConfig, out: Path, base: Settings) -> dict[str, Any]:
    """One run through the embedded stack; returns its figures and the final checkpoint dir."""
    settings = base.model_copy(
        update={
            "data_dir": out / "state",
            "database_url": "",
            "broker_url": "",
            "result_backend": "",
            "model_cache_dir": cfg.cache_dir.resolve(),
            "admin_key": "bench-" + uuid.uuid4().hex,
            "dev_mode": False,
        }
    )
    with embedded_stack(settings, "127.0.0.1", cfg.port, out / "logs") as url:
        return asyncio.run(_side(url, settings.admin_key, cfg, out))


def run_config(cfg: LearnConfig) -> dict[str, Any]:
    """The shared hyperparameters; every other knob keeps rlgate's default."""
    return {
        "group_size": cfg.group_size,
        "groups_per_step": cfg.completions_per_step // cfg.group_size,
        "learning_rate": cfg.learning_rate,
        "clip_eps_low": cfg.clip,
        "clip_eps_high": cfg.clip,
        "kl_coef": 0.0,
        "micro_batch_size": cfg.micro_batch,
        "seed": cfg.seed,
    }


async def _side(url: str, admin_key: str, cfg: LearnConfig, out: Path) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {admin_key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as admin:
        body = {"name": "bench-learn", "model": cfg.model, "config": run_config(cfg)}
        r = await admin.post("/admin/v1/runs", json=body)
        if r.status_code != 201:
            raise RuntimeError(f"could not create the run: {r.text}")
        run = r.json()
        run_id = run["run_id"]
        t0, t0_wall = time.perf_counter(), time.time()
        samples = await _agent(url, run, cfg, t0)
        spend_s = max(s.t for s in samples)
        await _wait_trained(admin, run_id)
        metrics = (await admin.get(f"/admin/v1/runs/{run_id}/metrics?since_step=-1")).json()
        steps = [s for s in (await admin.get(f"/admin/v1/runs/{run_id}/steps")).json()]
        counters = (await admin.get(f"/admin/v1/runs/{run_id}/counters")).json()
        episodes = await _episodes(admin, run_id)
        final_dir = await _download_final(admin, run_id, out / "final")
    points = metrics["points"]
    finish_s = max([spend_s] + [_since(p["time"], t0_wall) for p in points if p.get("time")])
    return {
        "samples": samples,
        "spend_s": spend_s,
        "finish_s": finish_s,
        "steps": [s for s in steps if s["status"] == "done"],
        "points": points,
        "counters": counters,
        "episodes": episodes,
        "final_dir": str(final_dir),
        "t0_wall": t0_wall,
    }


async def _agent(url: str, run: dict, cfg: LearnConfig, t0: float) -> list[Sample]:
    order = train_order(cfg.seed)
    samples: list[Sample] = []
    launched = 0

    async def worker() -> None:
        nonlocal launched
        while launched < cfg.budget:
            problem = order[(launched // cfg.group_size) % len(order)]
            launched += cfg.group_size
            samples.extend(await _group(url, run, cfg, problem, t0))

    await asyncio.gather(*(worker() for _ in range(cfg.groups_in_flight)))
    return sorted(samples, key=lambda s: s.t)


async def _group(
    url: str, run: dict, cfg: LearnConfig, problem: Problem, t0: float
) -> list[Sample]:
    group = "g-" + uuid.uuid4().hex[:12]

    async def episode(i: int) -> tuple[str, str, float]:
        episode_id = f"{group}-{i}"
        client = openai.AsyncOpenAI(
            base_url=f"{url}/groups/{group}/episodes/{episode_id}/v1", api_key=run["api_key"]
        )
        async with client:
            resp = await client.chat.completions.create(
                model=run["name"],
                messages=cast("list[ChatCompletionMessageParam]", messages(problem)),
                max_tokens=cfg.max_tokens,
                temperature=cfg.temperature,
            )
        return episode_id, resp.choices[0].message.content or "", time.perf_counter() - t0

    replies = await asyncio.gather(*(episode(i) for i in range(cfg.group_size)))
    rewards = [score(problem, text) for _, text, _ in replies]
    body = [
        {"episode_id": e, "reward": r, "idempotency_key": e}
        for (e, _, _), r in zip(replies, rewards, strict=True)
    ]
    headers = {"Authorization": f"Bearer {run['api_key']}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as http:
        (await http.post("/v1/rewards", json=body)).raise_for_status()
    return [Sample(t, r, group, e) for (e, _, t), r in zip(replies, rewards, strict=True)]


async def _wait_trained(admin: httpx.AsyncClient, run_id: str, timeout_s: float = 7200) -> None:
    """Until no step is queued or running and the version held still for QUIET_POLLS polls."""
    deadline = time.monotonic() + timeout_s
    quiet, version = 0, None
    while quiet < QUIET_POLLS:
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {run_id} was still training after {timeout_s:.0f}s")
        await asyncio.sleep(1.0)
        steps = (await admin.get(f"/admin/v1/runs/{run_id}/steps")).json()
        now = (await admin.get(f"/admin/v1/runs/{run_id}")).json()["current_version"]
        busy = any(s["status"] in ("queued", "running") for s in steps)
        quiet = 0 if busy or now != version else quiet + 1
        version = now


async def _episodes(admin: httpx.AsyncClient, run_id: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    after: str | None = None
    while True:
        params: dict[str, Any] = {"limit": 500}
        if after:
            params["after"] = after
        page = (await admin.get(f"/admin/v1/runs/{run_id}/episodes", params=params)).json()
        out += page["data"]
        if not page["has_more"] or not page["data"]:
            return out
        after = page["data"][-1]["episode_id"]


async def _download_final(admin: httpx.AsyncClient, run_id: str, dest: Path) -> Path:
    """The newest version's checkpoint, through the admin API, unpacked under `dest`."""
    versions = (await admin.get(f"/admin/v1/runs/{run_id}/versions")).json()
    newest = max((v for v in versions if v["checkpoint_available"]), key=lambda v: v["version"])
    dest.mkdir(parents=True, exist_ok=True)
    tar_path = dest.with_suffix(".tar")
    path = f"/admin/v1/runs/{run_id}/versions/{newest['version']}/checkpoint"
    async with admin.stream("GET", path) as resp:
        resp.raise_for_status()
        with tar_path.open("wb") as f:
            async for chunk in resp.aiter_bytes():
                f.write(chunk)
    with tarfile.open(tar_path) as tar:
        tar.extractall(dest, filter="data")
    tar_path.unlink()
    return next(p.parent for p in dest.rglob("config.json"))


def _since(iso: str, t0_wall: float) -> float:
    return datetime.fromisoformat(iso).timestamp() - t0_wall


def trained_figures(side: dict[str, Any], group_size: int) -> dict[str, Any]:
    """Trained fraction, staleness and clip fraction of a finished run, from the admin API."""
    samples: list[Sample] = side["samples"]
    by_group: dict[str, list[float]] = {}
    for s in samples:
        by_group.setdefault(s.group_id, []).append(s.reward)
    flat = {g for g, rs in by_group.items() if len(set(rs)) == 1}
    informative = sum(1 for s in samples if s.group_id not in flat)
    trained = [e for e in side["episodes"] if e["status"] == "trained"]
    trained_informative = sum(1 for e in trained if e["group_id"] not in flat)
    steps = {s["step"]: s for s in side["steps"]}
    weights = [(steps[p["step"]]["n_episodes"], p["values"]) for p in side["points"]]
    total = sum(w for w, _ in weights) or 1
    return {
        "steps": len(side["steps"]),
        "sampled": len(samples),
        "zero_variance_completions": len(samples) - informative,
        "trained": len(trained),
        "trained_fraction": trained_informative / informative if informative else 0.0,
        "staleness_mean": sum(w * (v.get("staleness_mean") or 0.0) for w, v in weights) / total,
        "clip_frac": statistics.fmean(v.get("clip_frac") or 0.0 for _, v in weights)
        if weights
        else 0.0,
        "dropped": side["counters"].get("dropped", {}),
    }
