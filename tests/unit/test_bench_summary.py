"""Each `rlgate bench` command's last JSON line keeps the keys the design's contract names.

Every bench builds that line with a pure `summary` function (or, for `train`, from
the figures of its parts); these tests feed them synthetic measurements, so no bench
runs. Dropping or renaming a contract key fails here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from rlgate.bench import (
    capture,
    e2e,
    gateway_report,
    learn,
    served,
    swap,
    swap_stall,
    tenants,
    train,
)
from rlgate.bench.train_fsdp import fsdp_figures
from rlgate.bench.train_step import step_figures
from rlgate.bench.train_swap import swap_figures


def keys_of(out: dict) -> dict:
    """What the command prints: the dict must survive its JSON line."""
    return json.loads(json.dumps(out))


def load(c: int, rps: float, p50: float) -> dict:
    return {
        "concurrency": c,
        "requests": int(rps),
        "answers": int(rps),
        "errors": 0,
        "status_429": 0,
        "status_5xx": 0,
        "rps": rps,
        "p50_ms": p50,
        "p99_ms": 2 * p50,
        "warm_ok": 1,
    }


def target(p50: float, rps: float) -> dict:
    levels = [load(32, rps, p50), load(512, rps / 2, p50)]
    return {"latency": load(4, rps / 4, p50), "throughput": levels, "max_rps": rps}


def test_gateway_has_overhead_and_throughput_ratios_per_mode() -> None:
    per_mode = {
        "stub": target(20.0, 1500),
        "rlgate": target(25.0, 500),
        "litellm": target(70.0, 50),
    }
    results = {mode: per_mode for mode in ("plain", "stream", "chat")}
    stored = {"rlgate": {"answered": 10, "stored": 10, "episodes": 10}}
    out = keys_of(gateway_report.summary(results, [1], stored, True))
    for mode in ("plain", "stream", "chat"):
        assert out[mode]["overhead_ratio"] == pytest.approx(0.1)
        assert out[mode]["throughput_ratio"] == 10.0
    assert out["overhead_ratio"] == out["plain"]["overhead_ratio"]
    assert out["throughput_ratio"] == out["plain"]["throughput_ratio"]


def test_train_has_ratio_step_ratio_and_with_fsdp_its_step_ratio_and_swap_seconds() -> None:
    packing = train.packing_figures(
        {"packed": [300.0, 310.0, 320.0], "padded": [100.0, 100.0, 100.0]}, {"tokens": 4096}
    )
    step = step_figures([9.0, 2.0, 2.0], [8.0, 1.5, 1.5], [5.0, 1.0, 1.0], {"step_tokens": 900})
    local_only = keys_of(train.summary("tiny", packing, step))
    assert local_only["ratio"] == pytest.approx(3.1)
    assert local_only["step_ratio"] == 2.0
    assert "fsdp_step_ratio" not in local_only and "swap_s" not in local_only

    fsdp = fsdp_figures({"local": [5.0, 1.0, 1.0], "fsdp": [30.0, 1.5, 1.5]}, 2, 2)
    sync = swap_figures(
        {"disk": [0.4, 0.5], "collective": [0.2, 0.3]},
        {"disk": [0.1, 0.1], "collective": [0.05, 0.05]},
        {"disk": 1000, "collective": 1000},
    )
    out = keys_of(train.summary("tiny", fsdp, sync, packing, step))
    assert out["fsdp_step_ratio"] == 1.5
    assert set(out["swap_s"]) == {"disk", "collective"}
    assert out["ratio"] == pytest.approx(3.1) and out["step_ratio"] == 2.0


def test_swap_has_ratio() -> None:
    out = keys_of(swap.summary("smollm2", [0.5, 0.6, 0.7], [60.0, 61.0]))
    assert out["ratio"] == pytest.approx(0.6 / 60.5)


def test_swap_stall_has_per_mode_stall_failed_calls_and_tokens_per_s() -> None:
    def run(first: float, tokens: int) -> swap_stall.ModeRun:
        calls = [
            swap_stall.Call(0.0, 0.1, 4.0, tokens, (), 1),
            swap_stall.Call(10.1, first, 14.0, tokens, (), 1),
        ]
        return swap_stall.ModeRun(10.0, calls, [swap_stall.Swap(10.0, 10.5, 0.4)], 0)

    out = keys_of(
        swap_stall.summary(
            swap_stall.StallSetup(), {"drain": run(12.1, 100), "keep": run(10.4, 200)}
        )
    )
    for mode in ("drain", "keep"):
        assert {"stall_ms", "failed", "tokens_per_s"} <= out[mode].keys()
    assert out["drain"]["stall_ms"] == 1900.0 and out["keep"]["stall_ms"] == 200.0
    assert out["throughput_ratio"] == 2.0 and out["keep"]["failed"] == 0


def test_capture_has_completions_per_s() -> None:
    def mode(stored: int, seconds: float) -> dict:
        rate = round(stored / seconds, 1)
        return {"acknowledged": stored, "stored": stored, "seconds": seconds, "commits": 1} | {
            "completions_per_s": rate,
            "rows_per_commit": 4.0,
        }

    out = keys_of(
        capture.summary("postgresql", 64, 3, mode(100, 1.0), mode(800, 2.0), mode(100, 1.0))
    )
    assert out["completions_per_s"] == 400.0 and out["lost"] == 0


def test_e2e_has_ratio() -> None:
    modes = [
        {"max_staleness": 0, "samples_per_s": 1.0},
        {"max_staleness": 1, "samples_per_s": 1.8},
        {"max_staleness": 2, "samples_per_s": 1.6},
    ]
    out = keys_of(e2e.summary(4, modes))
    assert out["ratio"] == 1.8


def test_learn_has_reward_ratio_wall_ratio_and_trained_fraction() -> None:
    def side(heldout: float, finish_s: float) -> dict:
        return {"heldout": heldout, "finish_s": finish_s, "trained_fraction": 0.9, "curve": []}

    seeds = [learn.seed_summary(s, 0.2, side(0.4, 100.0), side(0.5, 50.0)) for s in (0, 1)]
    out = keys_of(learn.summary(seeds, 0.2, Path("/tmp/out")))
    assert out["reward_ratio"] == pytest.approx(1.5)
    assert out["wall_ratio"] == 0.5
    assert out["trained_fraction"] == 0.9
    assert all("curve" not in seed["rlgate"] for seed in out["seeds"])


def test_tenants_has_memory_ratio_and_swap_ratio() -> None:
    args = argparse.Namespace(model="tiny", runs=8, rank=8, repeats=3)
    memory = {"rss_1_run": 1000, "rss_8_runs": 1500, "rss_growth": 500}
    out = keys_of(tenants.summary(args, memory, 10_000, 100, [0.01, 0.02, 0.03], [1.0, 1.0, 1.0]))
    assert out["memory_ratio"] == 0.05
    assert out["swap_ratio"] == 0.02
    assert "policy_worker_ratio" not in out  # --policies 0


def test_tenants_has_policy_ratios_for_n_policies_from_the_last_n_minus_one() -> None:
    args = argparse.Namespace(
        model="tiny", runs=8, rank=8, repeats=3, policies=8, policy_targets="q_proj,v_proj"
    )
    memory = {"rss_1_run": 1000, "rss_8_runs": 1500, "rss_growth": 500}
    policies = {
        "policy_gateway_rss_1": 1000,
        "policy_gateway_rss_8": 1070,
        "policy_gateway_growth": 70,
        "policy_worker_rss_1": 2000,
        "policy_worker_rss_8": 2700,
        "policy_worker_growth": 700,
    }
    out = keys_of(tenants.summary(args, memory, 10_000, 100, [0.01], [1.0], policies))
    assert out["policy_gateway_ratio"] == pytest.approx(8 * 10 / 10_000)
    assert out["policy_worker_ratio"] == pytest.approx(8 * 100 / 10_000)
    assert out["policy_targets"] == ["q_proj", "v_proj"] and out["policies"] == 8


def test_served_has_a_ratio_per_setting_against_local() -> None:
    out = keys_of(served.summary("smollm2", 2, {"local": [2.0, 2.0], "fsdp2": [3.0, 3.0]}))
    assert out["served_ratio"] == {"fsdp2": 1.5}
