"""The demo's verdict: first vs last quarter of the measured versions, exit 0 only if learned."""

from __future__ import annotations

import pytest

from rlgate.demo import DemoConfig, plateaued, summarize


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


def test_the_demo_stops_once_learned_and_no_new_best_for_patience_versions() -> None:
    rising_then_flat = [0.3, 0.5, 0.62, 0.7, 0.68, 0.69, 0.7]
    assert not plateaued(rising_then_flat[:6], 0.1, 3)  # 0.7 was the best two versions ago
    assert plateaued(rising_then_flat, 0.1, 3)  # ties do not count as a new best
    assert not plateaued(rising_then_flat, 0.1, 0)  # patience 0 never stops
    assert not plateaued([0.3, 0.5, 0.62, 0.7, 0.68, 0.69, 0.71], 0.1, 3)  # a new best
    # flat from the start: nothing learned, so the demo keeps training
    assert not plateaued([0.5, 0.52, 0.49, 0.5, 0.51, 0.5, 0.49, 0.5], 0.1, 3)
