"""The demo's verdict: first vs last quarter of the measured versions, exit 0 only if learned."""

from __future__ import annotations

import pytest

from rlgate.demo import DemoConfig, summarize


def _steps(rewards: list[float]) -> list[dict]:
    n = len(rewards)
    return [
        {"step": i, "version": i, "trained": i < n - 1, "reward_mean": r}
        for i, r in enumerate(rewards)
    ]


def test_a_rising_curve_learned() -> None:
    s = summarize(DemoConfig(), _steps([0.2, 0.3, 0.5, 0.6, 0.7, 0.7, 0.8, 0.8]))
    assert s["window"] == 2
    assert s["reward_first"] == pytest.approx(0.25) and s["reward_last"] == pytest.approx(0.8)
    assert s["learned"] is True


def test_a_flat_curve_did_not_learn() -> None:
    s = summarize(DemoConfig(), _steps([0.5, 0.52, 0.49, 0.55]))
    assert s["learned"] is False


def test_no_train_step_is_a_verdict_not_a_crash() -> None:
    # Only the final measurement: the first waves never had reward variance.
    s = summarize(DemoConfig(), _steps([0.02]))
    assert s["learned"] is False
    assert s["reward_first"] == s["reward_last"] == pytest.approx(0.02)
