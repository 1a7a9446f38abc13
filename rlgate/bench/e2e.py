"""`rlgate bench e2e`: trained samples/s of the whole loop, synchronous against asynchronous.

One embedded stack (gateway, Celery worker, local tiny model) serves three
runs in turn, identical but for `max_staleness`: 0 (synchronous: a sample is
trained only by the version that sampled it, so what is sampled while a step
runs is dropped) and 1, 2 (asynchronous: agents keep sampling while the
trainer steps). In each, `agents` concurrent agents play GRPO groups (one
request per episode, rewards alternating 0/1 so no group has zero variance)
for `seconds`. Samples/s = episodes in finished train steps / seconds; the
sampled and dropped counts are reported too. The last line is JSON, with
`ratio` = best asynchronous samples/s / synchronous samples/s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from core.store.status import STEP_IN_FLIGHT, StepStatus
from rlgate.bench import dirs as bench_dirs

ADMIN_KEY = "bench-admin"


async def _agent(client, base: str, key: str, model: str, group_size: int, stop: float, seen):
    headers = {"Authorization": f"Bearer {key}"}
    while time.monotonic() < stop:
        group = "g-" + uuid.uuid4().hex[:12]

        async def episode(i: int, group: str = group) -> None:
            url = f"{base}/groups/{group}/episodes/{group}-{i}/v1"
            body = {
                "model": model,
                "messages": [{"role": "user", "content": f"count to {i + 3}"}],
                "max_tokens": 8,
            }
            resp = await client.post(url + "/chat/completions", json=body, headers=headers)
            if resp.status_code != 200:
                seen["refused"] += 1
                await asyncio.sleep(0.5)
                return
            seen["sampled"] += 1
            reward = {"completion_id": resp.json()["id"], "reward": float(i % 2)}
            await client.post(url + "/rewards", json=reward, headers=headers)

        await asyncio.gather(*(episode(i) for i in range(group_size)))


async def _load(base: str, run: dict, agents: int, group_size: int, seconds: float) -> dict:
    import httpx

    seen = {"sampled": 0, "refused": 0}
    stop = time.monotonic() + seconds
    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(
            *(
                _agent(client, base, run["api_key"], run["name"], group_size, stop, seen)
                for _ in range(agents)
            )
        )
    return seen


def _quiet(admin, run_id: str, timeout_s: float = 300) -> list[dict]:
    """Wait until no step of the run is queued or running; return its steps."""
    deadline = time.monotonic() + timeout_s
    while True:
        steps = admin.get(f"/admin/v1/runs/{run_id}/steps").json()
        if all(s["status"] not in STEP_IN_FLIGHT for s in steps):
            return steps
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {run_id} still has a step in flight")
        time.sleep(0.5)


def _mode(url: str, admin, staleness: int, agents: int, seconds: float, cfg: dict) -> dict:
    run = admin.post(
        "/admin/v1/runs",
        json={
            "name": f"e2e-s{staleness}",
            "model": "tiny",
            "config": cfg | {"max_staleness": staleness},
        },
    ).json()
    t0 = time.monotonic()
    seen = asyncio.run(_load(url, run, agents, cfg["group_size"], seconds))
    elapsed = time.monotonic() - t0
    # steps finished within the window; one still running finishes, uncounted, before the next
    counted = [
        st
        for st in admin.get(f"/admin/v1/runs/{run['run_id']}/steps").json()
        if st["status"] == StepStatus.DONE
    ]
    _quiet(admin, run["run_id"])
    info = admin.get(f"/admin/v1/runs/{run['run_id']}").json()
    trained = sum(st["n_episodes"] for st in counted)
    return {
        "max_staleness": staleness,
        "seconds": round(elapsed, 2),
        "steps": len(counted),
        "trained_samples": trained,
        "samples_per_s": round(trained / elapsed, 2),
        "sampled": seen["sampled"],
        "refused": seen["refused"],
        "dropped": info.get("counters", {}).get("dropped_stale_episodes", 0),
        "version": info["current_version"],
    }


def _warm_up(url: str, admin, cfg: dict, timeout_s: float = 240) -> None:
    """Until a first step is done: the worker loads the model once, outside every window."""
    run = admin.post(
        "/admin/v1/runs", json={"name": "e2e-warm-up", "model": "tiny", "config": cfg}
    ).json()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        asyncio.run(_load(url, run, 2, cfg["group_size"], 3))
        steps = admin.get(f"/admin/v1/runs/{run['run_id']}/steps").json()
        if any(st["status"] == StepStatus.DONE for st in steps):
            break
    _quiet(admin, run["run_id"])
    admin.post(f"/admin/v1/runs/{run['run_id']}/pause")


def bench_e2e(
    cache_dir: Path | None = None,
    agents: int = 4,
    seconds: float = 40.0,
    group_size: int = 4,
    groups_per_step: int = 2,
    modes: tuple[int, ...] = (0, 1, 2),
    work_dir: Path | None = None,
) -> dict[str, Any]:
    import httpx

    from inference.models import resolve_model
    from rlgate.stack import embedded_stack

    cache_dir = bench_dirs.model_cache(cache_dir)
    resolve_model("tiny", cache_dir)
    cfg = {"group_size": group_size, "groups_per_step": groups_per_step, "micro_batch_size": 8}
    results = []
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(bench_dirs.work_dir("e2e", work_dir))  # removed last
        settings = bench_dirs.stack_settings(tmp, cache_dir, ADMIN_KEY)
        url = stack.enter_context(embedded_stack(settings, "127.0.0.1", 0, tmp / "logs"))
        admin = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=120
        )
        with admin:
            _warm_up(url, admin, cfg)
            for s in modes:
                results.append(_mode(url, admin, s, agents, seconds, cfg))
                r = results[-1]
                print(
                    f"max_staleness {s}: {r['samples_per_s']:.2f} trained samples/s "
                    f"({r['steps']} steps, {r['sampled']} sampled)",
                    file=sys.stderr,
                )
    return summary(agents, results)


def summary(agents: int, results: list[dict[str, Any]]) -> dict[str, Any]:
    """The bench's JSON: each mode, and the best asynchronous mode against the synchronous one."""
    sync = next((r for r in results if r["max_staleness"] == 0), None)
    best_async = max(
        (r for r in results if r["max_staleness"] > 0), key=lambda r: r["samples_per_s"]
    )
    out: dict[str, Any] = {"bench": "e2e", "agents": agents, "modes": results}
    if sync is not None:
        base = max(sync["samples_per_s"], 1e-9)
        out["sync_samples_per_s"] = sync["samples_per_s"]
        out["async_samples_per_s"] = best_async["samples_per_s"]
        out["ratio"] = round(best_async["samples_per_s"] / base, 2)
        for r in results:
            r["ratio_to_sync"] = round(r["samples_per_s"] / base, 2)
    return out


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    bench_dirs.add_dir_arguments(p, "the stack's data dir (checkpoints) and logs")
    p.add_argument("--agents", type=int, default=4, help="concurrent agents (one group each)")
    p.add_argument("--seconds", type=float, default=40.0, help="load time per mode")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--groups-per-step", type=int, default=2)
    return p


def run(args: argparse.Namespace) -> int:
    # The options are named after bench_e2e's parameters.
    names = ("cache_dir", "agents", "seconds", "group_size", "groups_per_step", "work_dir")
    out = bench_e2e(**{name: getattr(args, name) for name in names})
    for r in out["modes"]:
        print(
            f"max_staleness {r['max_staleness']}: {r['samples_per_s']:.2f} samples/s "
            f"(x{r.get('ratio_to_sync', 0):.2f} of sync), {r['steps']} steps, "
            f"{r['sampled']} sampled, {r['dropped']} dropped stale"
        )
    print(json.dumps(out))
    return 0
