"""Admin response models read straight from store rows (from_attributes)."""

from __future__ import annotations

from types import SimpleNamespace

from gateway.protocol import TrainStepPublic


def _row(**over):
    row = dict(
        step=4, status="queued", n_episodes=8, n_groups=2, loss=None, reward_mean=None,
        reward_std=None, tokens=None, duration_s=None, metrics=None, error=None,
    )  # fmt: skip
    return SimpleNamespace(**{**row, **over})


def test_a_step_reports_the_version_it_produces_and_no_metrics_until_done() -> None:
    out = TrainStepPublic.model_validate(_row()).model_dump()
    assert out["version"] == 5
    assert out["metrics"] == {}


def test_a_finished_step_keeps_its_figures() -> None:
    row = _row(status="done", loss=0.25, tokens=640, metrics={"clip_frac": 0.1})
    out = TrainStepPublic.model_validate(row).model_dump()
    assert (out["status"], out["loss"], out["tokens"]) == ("done", 0.25, 640)
    assert out["metrics"] == {"clip_frac": 0.1}
    assert "version" in TrainStepPublic.model_json_schema(mode="serialization")["properties"]
