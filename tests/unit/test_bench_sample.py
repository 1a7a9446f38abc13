"""`rlgate bench sample`: its JSON keys, its figures, and a tiny wave through every target."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from rlgate.bench import sample
from rlgate.cli import BENCHES, build_parser

CONTRACT = ("sample_ratio", "static_ratio", "roofline_fraction", "model", "agents", "cores")
PER_TARGET = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "roofline_fraction")
HARDWARE = {"bandwidth_bytes_per_s": 10e9, "matmul_flop_per_s": 100e9}


def figures(tokens_per_s: float) -> dict:
    one = {"tokens_per_s": tokens_per_s, "ttft_p50_ms": 10.0, "ttft_p99_ms": 20.0}
    return sample.target_figures([one | {"wall_s": 1.0, "tokens": 100}])


def config(agents: int = 36) -> dict:
    return {"model": "smollm2", "agents": agents, "cores": 2, "threads": 2}


def test_help_lists_the_workload_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert "sample" in BENCHES
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["bench", "sample", "--help"])
    assert exit_.value.code == 0
    assert "--baseline-src" in capsys.readouterr().out


def test_summary_has_the_ratios_and_each_targets_figures() -> None:
    targets = {"rlgate": figures(200.0), "generate": figures(100.0), "static": figures(50.0)}
    out = json.loads(json.dumps(sample.summary(config(), targets, HARDWARE, 10**8)))
    for key in CONTRACT:
        assert key in out
    for name in targets:
        assert all(key in out[name] for key in PER_TARGET)
    assert out["sample_ratio"] == 2.0 and out["static_ratio"] == 4.0
    # 36 rows: compute 2 x 1e8 x 36 / 1e11 = 72 ms > memory 4e8 / 1e10 = 40 ms
    assert out["roofline"]["bound"] == "compute"
    assert out["roofline"]["tokens_per_s"] == pytest.approx(500.0)
    assert out["roofline_fraction"] == pytest.approx(0.4)


def test_without_a_baseline_static_ratio_is_null() -> None:
    targets = {"rlgate": figures(200.0), "generate": figures(100.0)}
    out = sample.summary(config(1), targets, HARDWARE, 10**8)
    assert out["static_ratio"] is None and "static" not in out
    assert out["roofline"]["bound"] == "memory"  # one row: the weights' read dominates


def test_time_to_first_token_counts_from_each_arrival() -> None:
    raw = {"first_token_s": [0.1, 0.3], "last_token_s": [0.5, 1.0], "tokens": [10, 30]}
    one = sample.run_figures(raw, [0.0, 0.2])
    assert one["ttft_p50_ms"] == pytest.approx(100.0)
    assert one["tokens_per_s"] == pytest.approx(40.0)  # 40 tokens, first arrival to last token


def test_demo_wave_groups_agents_on_one_problem() -> None:
    wave = sample.demo_messages(7, 3, seed=0)
    assert len(wave) == 7 and wave[0] == wave[2] and wave[3] == wave[5] == wave[4]


def test_a_tiny_wave_runs_through_every_target(tiny_model_dir: Path, tmp_path: Path) -> None:
    wave = "--model tiny --agents 3 --group-size 2 --gap-ms 5 --min-tokens 2 --max-tokens 4"
    args = sample.add_arguments(argparse.ArgumentParser()).parse_args(f"{wave} --threads 1".split())
    out = json.loads(json.dumps(sample.bench_sample(args, tiny_model_dir, tmp_path)))
    spec = json.loads((tmp_path / "spec.json").read_text())
    assert out["rlgate"]["tokens"] == out["generate"]["tokens"] == sum(spec["max_tokens"])
    assert out["threads"] == 1 and out["static_ratio"] is None
    assert out["sample_ratio"] > 0 and 0 < out["roofline_fraction"] < 1
