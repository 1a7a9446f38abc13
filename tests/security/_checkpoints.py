"""Helpers for the checkpoint tests: a run with one step queued, and a step attempt in a
child process that the test can hold and kill.

`python -m tests.security._checkpoints SETTINGS_JSON RUN STEP MARKERS [--freeze-on-rename]`
runs the real `Trainer.train_step` in a fresh process. It writes `MARKERS/started` once
the attempt is past its "already done?" check, waits for `MARKERS/go`, and with
`--freeze-on-rename` stops for good (until SIGKILL) at the first rename into a
directory of the version it writes, that is in the middle of publishing its
checkpoint. `MARKERS/result.json` is its answer or its error. The holds are set here,
in the child, around the real code: production code has no test hook.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai

ROOT = Path(__file__).resolve().parents[2]
CONFIG = {
    "group_size": 2,
    "groups_per_step": 1,
    "micro_batch_size": 2,
    "learning_rate": 3e-3,
    "save_optimizer_state": True,
}


def settings_json(settings: Any) -> str:
    """What the child needs to build the same `Settings` as the test's gateway."""
    fields = ("data_dir", "model_cache_dir", "admin_key")
    return json.dumps({f: str(getattr(settings, f)) for f in fields})


def queue_step(server: Any, name: str = "ckpt", **config: Any) -> dict:
    """A run on `server` with one rewarded group: step 0 is queued (no worker takes it)."""
    run = server.create_run(name=name, config=CONFIG | config)
    root = run["base_url"].removesuffix("/v1")
    for e, reward in enumerate((0.0, 1.0)):
        client = openai.OpenAI(
            base_url=f"{root}/groups/g0/episodes/g0-{e}/v1", api_key=run["api_key"], max_retries=0
        )
        resp = client.chat.completions.create(
            model=run["name"], messages=[{"role": "user", "content": f"hi {e}"}], max_tokens=8
        )
        client.post("/rewards", body={"completion_id": resp.id, "reward": reward}, cast_to=object)
    wait_for(
        lambda: server.query("SELECT status FROM train_steps WHERE run_id = ?", (run["run_id"],)),
        60,
        "step 0 to be queued",
    )
    return run


def wait_for(predicate, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def version_row(db: Path, run_id: str, version: int) -> tuple[str, str | None] | None:
    """(checkpoint_path, optimizer_path) recorded for `version`, or None."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        cols = {r[1] for r in conn.execute("PRAGMA table_info(policy_versions)")}
        opt = "optimizer_path" if "optimizer_path" in cols else "NULL"
        row = conn.execute(
            f"SELECT checkpoint_path, {opt} FROM policy_versions WHERE run_id = ? AND version = ?",
            (run_id, version),
        ).fetchone()
        return tuple(row) if row else None
    finally:
        conn.close()


def current_version(db: Path, run_id: str) -> int:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        return conn.execute("SELECT current_version FROM runs WHERE id = ?", (run_id,)).fetchone()[
            0
        ]
    finally:
        conn.close()


def fingerprint(path: Path) -> dict[str, tuple[str, int, int]]:
    """Every file below `path`: (sha256, inode, mtime_ns). A rewrite changes the last two
    even when the bytes come out the same."""
    out = {}
    for p in sorted(Path(path).rglob("*")):
        if p.is_file():
            st = p.stat()
            out[str(p.relative_to(path))] = (
                hashlib.sha256(p.read_bytes()).hexdigest(),
                st.st_ino,
                st.st_mtime_ns,
            )
    return out


def start_attempt(
    settings: Any, run_id: str, step: int, markers: Path, freeze_on_rename: bool = False
) -> subprocess.Popen:
    markers.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "tests.security._checkpoints", settings_json(settings)]
    argv += [run_id, str(step), str(markers)] + (["--freeze-on-rename"] if freeze_on_rename else [])
    log = (markers / "child.log").open("w")
    return subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def commit_step(server: Any, run_id: str, markers: Path) -> dict:
    """A whole attempt at step 0 in a child process, run to its end; its answer."""
    proc = start_attempt(server.settings, run_id, 0, markers)
    (markers / "go").touch()
    assert proc.wait(300) == 0, (markers / "child.log").read_text()
    return json.loads((markers / "result.json").read_text())


def admin_client(server: Any) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers=server.admin_headers(), timeout=120)


def _child(raw: str, run_id: str, step: int, markers: Path, freeze: bool) -> None:
    import trainer.tasks as tasks
    from core.settings import Settings

    fields = json.loads(raw)
    settings = Settings(
        **fields, database_url="", broker_url="", result_backend="", public_url="", dev_mode=False
    )
    real_load = tasks.load_step_samples

    def held_load(*args: Any, **kwargs: Any):
        (markers / "started").touch()
        while not (markers / "go").exists():
            time.sleep(0.05)
        return real_load(*args, **kwargs)

    tasks.load_step_samples = held_load
    if freeze:
        real_rename = Path.rename

        def frozen_rename(self: Path, target: Any) -> Any:
            if Path(target).name.startswith(f"v{step + 1}") and not str(target).endswith(".json"):
                (markers / "frozen").write_text(f"{self} -> {target}")
                while True:
                    time.sleep(60)  # until the test's SIGKILL
            return real_rename(self, target)

        Path.rename = frozen_rename  # type: ignore[method-assign]
    trainer = tasks.Trainer(settings)
    try:
        result: Any = trainer.train_step(run_id, step)
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {exc}"}
    (markers / "result.json").write_text(json.dumps(result))
    os._exit(0)  # no worker shutdown hooks: this process is one attempt, nothing more


if __name__ == "__main__":
    _child(
        sys.argv[1],
        sys.argv[2],
        int(sys.argv[3]),
        Path(sys.argv[4]),
        "--freeze-on-rename" in sys.argv,
    )
