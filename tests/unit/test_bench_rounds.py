"""`load.measure` with rounds: levels interleaved, each level read as its rounds' median."""

from __future__ import annotations

from typing import Any

from rlgate.bench.load import combine_rounds, measure, round_orders


def one_load(rps: float, requests: int, **extra: Any) -> dict[str, Any]:
    return {
        "concurrency": extra.pop("concurrency", 8),
        "requests": requests,
        "answers": requests + 1,
        "errors": 1,
        "status_429": 1,
        "status_5xx": 0,
        "statuses": {"200": requests, "429": 1},
        "rps": rps,
        "p50_ms": rps / 10,
        "p90_ms": rps / 5,
        "p99_ms": rps / 2,
        "warm_2xx": 3,
        "warm_ok": 1,
        **extra,
    }


def test_rounds_alternate_their_order() -> None:
    assert round_orders([32, 128, 512], 3) == [[32, 128, 512], [512, 128, 32], [32, 128, 512]]
    assert round_orders([8], 2) == [[8], [8]]


def test_a_level_is_its_rounds_median_and_its_counts_their_sum() -> None:
    level = combine_rounds([one_load(100.0, 10), one_load(300.0, 30), one_load(120.0, 12)])
    assert level["rps"] == 120.0 and level["p99_ms"] == 60.0  # medians, not the best round
    assert level["requests"] == 52 and level["warm_2xx"] == 9 and level["warm_ok"] == 3
    assert level["status_429"] == 3 and level["statuses"] == {"200": 52, "429": 3}
    assert [r["rps"] for r in level["rounds"]] == [100.0, 300.0, 120.0]


def test_one_round_is_the_load_itself() -> None:
    load = one_load(100.0, 10)
    assert combine_rounds([load]) == load


def test_measure_loads_every_level_once_per_round_in_alternating_order() -> None:
    calls: list[int] = []
    settles: list[int] = []
    rates = {32: [500.0, 400.0, 450.0], 128: [600.0, 300.0, 550.0], 512: [580.0, 590.0, 100.0]}
    latencies = [50.0, 45.0, 60.0]

    def fake_load(target: Any, c: int, seconds: float, loader: str, warmup: float) -> dict:
        calls.append(c)
        if c == 4:
            return one_load(latencies.pop(0), 5, concurrency=4)
        return one_load(rates[c].pop(0), 10, concurrency=c)

    out = measure(
        ("http://x", "/", {}, {}),
        4,
        [32, 128, 512],
        1.0,
        "python",
        settle=lambda: settles.append(1),
        rounds=3,
        run_load=fake_load,
    )
    assert calls == [4, 32, 128, 512, 512, 128, 32, 4, 4, 32, 128, 512]
    assert len(settles) == len(calls)  # settled before every load
    by_level = {m["concurrency"]: m for m in out["throughput"]}
    assert {c: m["rps"] for c, m in by_level.items()} == {32: 450.0, 128: 550.0, 512: 580.0}
    assert out["max_rps"] == 580.0
    assert out["latency"]["rps"] == 50.0  # the latency load is read over rounds too
    assert [r["rps"] for r in out["latency"]["rounds"]] == [50.0, 45.0, 60.0]
    assert by_level[512]["requests"] == 30
