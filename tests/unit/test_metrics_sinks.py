"""Trainer metrics sinks: JSON lines always, and TensorBoard events read back."""

from __future__ import annotations

import json

from trainer.metrics_sinks import MetricsSinkConfig, MetricsSinks, TrackedRun, make_sinks

RUN_A, RUN_B, RUN_TB = TrackedRun("run_a"), TrackedRun("run_b"), TrackedRun("run_tb")
STEP = {"loss": 0.25, "reward_mean": 0.5, "tokens": 32, "staleness_histogram": {"0": 4}}


def test_jsonl_sink_appends_one_scalar_line_per_step(tmp_path) -> None:
    sinks = make_sinks(MetricsSinkConfig(dir=tmp_path))
    sinks.log(RUN_A, 1, STEP)
    sinks.log(RUN_A, 2, STEP | {"loss": 0.125})
    sinks.log(RUN_B, 1, STEP)
    sinks.close()
    lines = [json.loads(x) for x in (tmp_path / "run_a" / "metrics.jsonl").read_text().splitlines()]
    assert [x["version"] for x in lines] == [1, 2]
    assert [x["loss"] for x in lines] == [0.25, 0.125]
    assert "staleness_histogram" not in lines[0]  # scalars only
    assert (tmp_path / "run_b" / "metrics.jsonl").exists()


def test_no_dir_no_sinks_and_failures_do_not_raise(tmp_path, caplog) -> None:
    assert make_sinks(MetricsSinkConfig()).sinks == []

    class Broken:
        def log(self, *args) -> None:
            raise OSError("disk full")

        def close(self) -> None:
            pass

    jsonl = make_sinks(MetricsSinkConfig(dir=tmp_path)).sinks[0]
    sinks = MetricsSinks(MetricsSinkConfig(), [Broken(), jsonl])
    assert sinks.log(RUN_A, 1, STEP) == 1  # logged and counted, not raised
    assert "metrics sink Broken failed for run run_a" in caplog.text
    assert (tmp_path / "run_a" / "metrics.jsonl").exists()  # the next sink still wrote


def test_tensorboard_events_read_back(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sinks = make_sinks(MetricsSinkConfig(dir=tmp_path, tensorboard=True))
    assert len(sinks.sinks) == 2
    for version, loss in [(1, 0.5), (2, 0.25), (3, 0.125)]:
        sinks.log(RUN_TB, version, {"loss": loss, "reward_mean": version / 10})
    sinks.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard" / "run_tb"))
    acc.Reload()
    events = acc.Scalars("train/loss")
    assert [(e.step, e.value) for e in events] == [(1, 0.5), (2, 0.25), (3, 0.125)]
    assert [e.step for e in acc.Scalars("train/reward_mean")] == [1, 2, 3]
