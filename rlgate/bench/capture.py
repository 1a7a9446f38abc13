"""`rlgate bench capture`: completions/s persisted, group commit against one commit each.

Both modes store the same synthetic completions through the gateway's own
storing path (`CaptureWriter`, `write_rows`) into a fresh database:
`agents` concurrent agents each play episodes of `turns` turns, and an
agent sends its next turn only once the previous one is committed (as a
real agent, which waits for the answer). "batched" is the started writer
(group commit); "baseline" is one transaction per completion. Each mode
runs `seconds` of load; completions/s counts rows found in the database
afterwards, not submissions. The last printed line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import time
import uuid
from collections.abc import Iterator
from typing import Any

from rlgate.seed_rows import synthetic_row

DEFAULT_PG = "postgresql://postgres@127.0.0.1:5432/test"


@contextlib.contextmanager
def fresh_database(url: str) -> Iterator[str]:
    """A new empty database next to `url` (PostgreSQL), dropped afterwards; SQLite: a temp file."""
    from sqlalchemy.engine import make_url

    u = make_url(url)
    if u.get_backend_name() == "sqlite":
        import tempfile
        from pathlib import Path

        with tempfile.TemporaryDirectory() as tmp:
            yield f"sqlite:///{Path(tmp) / 'bench.db'}"
        return
    import psycopg

    name = "rlgate_bench_" + uuid.uuid4().hex[:10]
    admin = u.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield u.set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def _mode(url: str, batched: bool, agents: int, turns: int, seconds: float) -> dict:
    from sqlalchemy.ext.asyncio import async_sessionmaker

    from core.store.completions import count_completions
    from core.store.db import make_async_engine
    from core.store.models import Run
    from gateway.agent.capture import CaptureWriter

    engine = make_async_engine(url)
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    run_id = "bench-" + uuid.uuid4().hex[:8]
    async with sessions.begin() as s:
        s.add(Run(id=run_id, name=run_id, model="tiny", model_path="/dev/null"))
    writer = CaptureWriter(sessions)
    if batched:
        writer.start()
    acked = 0
    deadline = time.perf_counter() + seconds

    async def agent(k: int) -> None:
        nonlocal acked
        rng = random.Random(k)
        while time.perf_counter() < deadline:
            episode, parent = f"ep-{uuid.uuid4().hex}", None
            for _ in range(turns):
                row = synthetic_row(run_id, episode, parent, rng)
                await writer.submit([row], None)
                acked += 1
                parent = row.id

    t0 = time.perf_counter()
    await asyncio.gather(*(agent(k) for k in range(agents)))
    elapsed = time.perf_counter() - t0
    await writer.close()
    async with sessions() as s:
        stored = await count_completions(s, run_id)
    await engine.dispose()
    return {
        "acknowledged": acked,
        "stored": stored,
        "seconds": round(elapsed, 3),
        "completions_per_s": round(stored / elapsed, 1),
        "commits": writer.batches,
        "rows_per_commit": round(writer.rows / max(writer.batches, 1), 2),
    }


def bench_capture(
    database_url: str = DEFAULT_PG, agents: int = 64, turns: int = 3, seconds: float = 5.0
) -> dict[str, Any]:
    """Both modes on one fresh database (baseline first, then batched, then baseline again)."""
    from core.store.migrate import upgrade

    with fresh_database(database_url) as url:
        upgrade(url)
        base1 = asyncio.run(_mode(url, False, agents, turns, seconds / 2))
        batched = asyncio.run(_mode(url, True, agents, turns, seconds))
        base2 = asyncio.run(_mode(url, False, agents, turns, seconds / 2))
    return summary(url.split("://")[0], agents, turns, base1, batched, base2)


def summary(
    database: str,
    agents: int,
    turns: int,
    base1: dict[str, Any],
    batched: dict[str, Any],
    base2: dict[str, Any],
) -> dict[str, Any]:
    """The bench's JSON from its three measured modes (baseline, batched, baseline)."""
    base_rate = (base1["stored"] + base2["stored"]) / (base1["seconds"] + base2["seconds"])
    lost = sum(m["acknowledged"] - m["stored"] for m in (base1, batched, base2))
    return {
        "bench": "capture",
        "database": database,
        "agents": agents,
        "turns": turns,
        "completions_per_s": batched["completions_per_s"],
        "baseline_completions_per_s": round(base_rate, 1),
        "ratio": round(batched["completions_per_s"] / base_rate, 2),
        "rows_per_commit": batched["rows_per_commit"],
        "lost": lost,
        "modes": {"batched": batched, "baseline": [base1, base2]},
    }


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--database-url", default=DEFAULT_PG, help="a fresh database is made next to it")
    p.add_argument("--agents", type=int, default=64, help="concurrent agents")
    p.add_argument("--turns", type=int, default=3, help="turns per episode")
    p.add_argument("--seconds", type=float, default=5.0, help="load time of the batched mode")
    return p


def run(args: argparse.Namespace) -> int:
    out = bench_capture(args.database_url, args.agents, args.turns, args.seconds)
    b = out["modes"]["batched"]
    print(
        f"group commit: {out['completions_per_s']:.0f} completions/s "
        f"({b['rows_per_commit']} rows/commit); one commit each: "
        f"{out['baseline_completions_per_s']:.0f}/s; ratio {out['ratio']:.2f}x; lost {out['lost']}"
    )
    print(json.dumps(out))
    return 0 if out["lost"] == 0 else 1
