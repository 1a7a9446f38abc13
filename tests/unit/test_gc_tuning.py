"""A server process freezes its start-up heap and raises the collector's thresholds; an app
built without `tune_gc` (tests, embedding) leaves the collector alone. Each case runs in a
fresh interpreter: freezing is process-wide."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gateway.gc_tuning import THRESHOLDS

SCRIPT = """
import gc, json, sys
from pathlib import Path
from fastapi.testclient import TestClient
from gateway.app import create_app
from core.settings import Settings

data = Path(sys.argv[1])
settings = Settings(data_dir=data, admin_key="k" * 32, dev_mode=False)
app = create_app(settings, tune_gc=sys.argv[2] == "1")
with TestClient(app) as client:
    assert client.get("/health").status_code == 200
    print(json.dumps({"threshold": gc.get_threshold(), "frozen": gc.get_freeze_count()}))
"""


def _run(tmp_path: Path, tune: bool) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / ("on" if tune else "off")), str(int(tune))],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_server_process_freezes_its_heap_and_raises_thresholds(tmp_path: Path) -> None:
    tuned = _run(tmp_path, True)
    assert tuple(tuned["threshold"]) == THRESHOLDS
    assert tuned["frozen"] > 10_000  # the imported libraries' objects, out of the collector's way


def test_an_app_built_without_tuning_leaves_the_collector_alone(tmp_path: Path) -> None:
    plain = _run(tmp_path, False)
    assert tuple(plain["threshold"]) != THRESHOLDS and plain["frozen"] == 0
