"""Status values: stored strings that must not drift, and columns (as migrated) that hold them."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import inspect

from core.store.db import make_sync_engine
from core.store.migrate import upgrade
from core.store.models import Episode, TrainStep
from core.store.status import PENDING_EPISODE, STEP_IN_FLIGHT, EpisodeStatus, StepStatus


def test_the_stored_values_are_pinned() -> None:
    # Rows already in databases carry these strings: renaming one orphans them.
    assert [s.value for s in EpisodeStatus] == [
        "open",
        "rewarded",
        "queued",
        "trained",
        "dropped",
        "expired",
        "eval",
    ]
    assert [s.value for s in StepStatus] == ["queued", "running", "done", "failed"]
    assert PENDING_EPISODE == ("open", "rewarded")
    assert STEP_IN_FLIGHT == ("queued", "running")


def test_models_default_to_the_first_status() -> None:
    assert Episode.__table__.c.status.default.arg == EpisodeStatus.OPEN
    assert TrainStep.__table__.c.status.default.arg == StepStatus.QUEUED


@pytest.mark.parametrize(
    ("table", "enum"), [("episodes", EpisodeStatus), ("train_steps", StepStatus)]
)
def test_the_migrated_status_columns_hold_every_value(tmp_path: Path, table, enum) -> None:
    """The migrations spell out no status value (no default, no CHECK); only the width matters."""
    url = f"sqlite:///{tmp_path / 'rlgate.db'}"
    upgrade(url)
    engine = make_sync_engine(url)
    try:
        insp = inspect(engine)
        column = next(c for c in insp.get_columns(table) if c["name"] == "status")
        checks = insp.get_check_constraints(table)
    finally:
        engine.dispose()
    assert column["default"] is None
    assert not [c for c in checks if "status" in (c.get("sqltext") or "")]
    assert max(len(s.value) for s in enum) <= column["type"].length
