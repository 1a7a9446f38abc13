"""`rlgate bench gateway`'s figures from measured loads: ratios, the 512 fraction, workers."""

from __future__ import annotations

import pytest

from rlgate.bench.gateway_report import figure_lines, load_line, summary, target_name


def level(c: int, rps: float, p50: float = 30.0, p99: float = 60.0, s429=0, s5xx=0) -> dict:
    return {
        "concurrency": c,
        "requests": int(rps * 5),
        "answers": int(rps * 5) + s429 + s5xx,
        "errors": s429 + s5xx,
        "status_429": s429,
        "status_5xx": s5xx,
        "rps": rps,
        "p50_ms": p50,
        "p99_ms": p99,
        "warm_ok": 1,
    }


def target(latency: dict, *levels: dict) -> dict:
    return {
        "latency": latency,
        "throughput": list(levels),
        "max_rps": max(lv["rps"] for lv in levels),
    }


def mode_results() -> dict:
    return {
        "stub": target(level(4, 180, p50=20.0), level(32, 1400), level(512, 1500)),
        "rlgate": target(
            level(4, 120, p50=25.0, p99=75.0),
            level(32, 400),
            level(128, 500, s429=30),
            level(512, 250, s429=900, s5xx=2),
        ),
        "rlgate_w2": target(level(4, 130, p50=24.0), level(32, 600), level(512, 700)),
        "litellm": target(level(4, 60, p50=70.0), level(32, 50), level(512, 40)),
    }


def test_mode_figures_against_litellm_the_stub_and_its_best_level() -> None:
    results = {"plain": mode_results(), "stream": mode_results()}
    stored = {"rlgate": {"answered": 10, "stored": 10}, "rlgate_w2": {"answered": 5, "stored": 6}}
    out = summary(results, [1, 2], stored, True, litellm_version="1.108.7")
    plain = out["plain"]
    assert plain["rlgate_added_p50_ms"] == 5.0 and plain["litellm_added_p50_ms"] == 50.0
    assert plain["overhead_ratio"] == pytest.approx(0.1)
    assert plain["throughput_ratio"] == 10.0  # best levels: 500 against 50 (latency loads aside)
    assert plain["stub_fraction"] == pytest.approx(0.333)
    assert plain["r512_fraction"] == 0.5  # 250 at 512 clients against 500 at 128
    assert plain["status_429"] == 930 and plain["status_5xx"] == 2
    assert plain["status_5xx_at_top"] == 2
    assert plain["p99_over_p50"] == 3.0
    assert plain["workers"]["2"]["vs_workers_1"] == 1.4  # best levels: 700 against 500
    assert out["throughput_ratio"] == plain["throughput_ratio"]
    assert out["r512_fraction"] == 0.5
    assert out["stream_p99_over_p50"] == 3.0
    assert out["status_5xx"] == 4
    assert out["litellm_version"] == "1.108.7"
    assert (out["rlgate_answered"], out["rlgate_stored"]) == (15, 16) and out["all_stored"]


def test_a_missing_completion_fails_the_storage_check() -> None:
    stored = {"rlgate": {"answered": 10, "stored": 9}}
    out = summary({"chat": mode_results()}, [1], stored, False)
    assert not out["all_stored"]
    assert "overhead_ratio" not in out["chat"]  # no LiteLLM measured
    assert "workers" not in out["chat"] and "r512_fraction" in out["chat"]


def test_a_run_without_512_clients_has_no_r512_fraction() -> None:
    r = mode_results()
    for name in r:
        r[name]["throughput"] = [lv for lv in r[name]["throughput"] if lv["concurrency"] != 512]
    out = summary({"plain": r}, [1], {"rlgate": {"answered": 1, "stored": 1}}, True)
    assert "r512_fraction" not in out["plain"] and "r512_fraction" not in out
    assert out["plain"]["top_level"] == 128


def test_names_and_lines() -> None:
    assert target_name(1, 1) == "rlgate" and target_name(2, 1) == "rlgate_w2"
    assert target_name(2, 2) == "rlgate"
    line = load_line("plain", "rlgate", level(512, 250, s429=900, s5xx=2))
    assert "2xx    250.0 req/s" in line and "429 900" in line and "5xx 2" in line
    assert "no answer within the window" in load_line("stream", "litellm", level(512, 0))
    out = summary({"plain": mode_results()}, [1, 2], {"rlgate": {"answered": 1, "stored": 1}}, True)
    assert any(ln.startswith("plain --workers 2:") for ln in figure_lines(out))


def test_a_baseline_tree_is_reported_against_the_gateway_measured() -> None:
    r = mode_results()
    r["rlgate_baseline"] = target(level(4, 80, p50=30.0), level(32, 100), level(512, 50))
    out = summary({"plain": r}, [1], {"rlgate": {"answered": 1, "stored": 1}}, True)
    base = out["plain"]["baseline"]
    assert base["max_rps"] == 100 and base["added_p50_ms"] == 10.0
    assert base["rlgate_max_rps_over_this"] == 5.0  # 500 against 100
    assert base["rlgate_added_p50_over_this"] == 0.5  # 5 ms added against 10
    assert base["throughput_ratio"] == 2.0  # the baseline's own, against LiteLLM's 50
    assert any(ln.startswith("plain baseline:") for ln in figure_lines(out))
