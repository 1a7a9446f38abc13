"""Checkpoints that survive: two live attempts of one step, and a worker killed mid-write.

Real processes: a uvicorn gateway (SQLite, embedded broker, no worker, so step 0
stays queued) and each step attempt in a child process running the real
`Trainer.train_step` (tests/security/_checkpoints.py). The late attempt passes the
"already done?" check before the winner commits, as a resend after `step_timeout_s`
or a broker redelivery does, and only then writes.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import openai
import pytest
import torch

from rlgate.stack import stop
from tests.security._checkpoints import (
    admin_client,
    commit_step,
    current_version,
    fingerprint,
    queue_step,
    start_attempt,
    version_row,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _held(server, run_id: str, markers: Path, freeze: bool = False):
    """An attempt at step 0 that has passed its check and waits for `markers/go`."""
    proc = start_attempt(server.settings, run_id, 0, markers, freeze_on_rename=freeze)
    wait_for(lambda: (markers / "started").exists() or proc.poll() is not None, 180, "a start")
    assert proc.poll() is None, (markers / "child.log").read_text()
    return proc


def test_a_late_attempt_never_replaces_the_committed_version(gateway_launcher, tmp_path) -> None:
    server = gateway_launcher(tmp_path / "data")
    try:
        run = queue_step(server, "two-attempts")
        rid, db = run["run_id"], server.db_path
        late = _held(server, rid, tmp_path / "late")
        won = commit_step(server, rid, tmp_path / "winner")
        assert won["version"] == 1 and "skipped" not in won, won
        committed = version_row(db, rid, 1)
        before = fingerprint(Path(committed[0]))
        assert any(name.endswith(".safetensors") for name in before), before

        (tmp_path / "late" / "go").touch()
        assert late.wait(300) == 0, (tmp_path / "late" / "child.log").read_text()

        assert fingerprint(Path(committed[0])) == before, "the committed v1 was rewritten"
        assert version_row(db, rid, 1) == committed
        assert current_version(db, rid) == 1, "the version moved once"
        lost = json.loads((tmp_path / "late" / "result.json").read_text())
        assert lost.get("skipped") is True, lost
        # the late attempt removed what it wrote: only the committed attempt's files of v1
        root = Path(committed[0]).parent
        left = sorted(p.name for p in root.iterdir() if p.name.startswith("v1"))
        assert left == sorted(Path(p).name for p in committed if p), left
        with admin_client(server) as admin:
            steps = admin.get(f"/admin/v1/runs/{rid}/steps").json()
        assert [(s["step"], s["status"]) for s in steps] == [(0, "done")]
    finally:
        stop(server.proc)


def test_a_worker_killed_mid_write_leaves_the_last_version_serving(
    gateway_launcher, tmp_path
) -> None:
    from transformers import AutoModelForCausalLM

    data = tmp_path / "data"
    server = gateway_launcher(data)
    second = None
    try:
        run = queue_step(server, "killed")
        rid, db = run["run_id"], server.db_path
        late = _held(server, rid, tmp_path / "late", freeze=True)
        won = commit_step(server, rid, tmp_path / "winner")
        assert won["version"] == 1 and "skipped" not in won, won
        committed = version_row(db, rid, 1)
        before = fingerprint(Path(committed[0]))

        (tmp_path / "late" / "go").touch()  # it trains, then freezes publishing its checkpoint
        wait_for(
            lambda: (tmp_path / "late" / "frozen").exists() or late.poll() is not None,
            300,
            "the late attempt to reach its checkpoint write",
        )
        assert late.poll() is None, (tmp_path / "late" / "child.log").read_text()
        os.kill(late.pid, signal.SIGKILL)
        late.wait(30)

        assert fingerprint(Path(committed[0])) == before
        assert current_version(db, rid) == 1
        model = AutoModelForCausalLM.from_pretrained(committed[0], dtype=torch.float32)
        assert model.config.vocab_size > 0
        # what the killed attempt left is garbage that the next commit sweeps, and only that
        from core.store.checkpoints import CheckpointLayout

        root = Path(committed[0]).parent
        layout = CheckpointLayout(root.parent)
        leftovers = layout.garbage(root.name, {Path(p) for p in committed if p}, newest=1)
        assert leftovers and all(Path(committed[0]).name not in p.name for p in leftovers)

        stop(server.proc)  # a fresh gateway must load v1 from its recorded path
        second = gateway_launcher(data)
        client = openai.OpenAI(base_url=second.url + "/v1", api_key=run["api_key"], max_retries=0)
        resp = client.chat.completions.create(
            model=run["name"], messages=[{"role": "user", "content": "still there?"}], max_tokens=4
        )
        assert resp.model_extra["policy_version"] == 1
    finally:
        stop(server.proc)
        if second is not None:
            stop(second.proc)
