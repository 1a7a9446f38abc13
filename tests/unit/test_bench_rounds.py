"""`load.measure_together`: levels interleaved over rounds, each level read as its rounds'
median; several targets loaded in lockstep, the lead alternating."""

from __future__ import annotations

from typing import Any

from rlgate.bench.load import alternating, combine_rounds, measure_together


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
    assert alternating([32, 128, 512], 3) == [[32, 128, 512], [512, 128, 32], [32, 128, 512]]
    assert alternating([8], 2) == [[8], [8]]


def test_a_level_is_its_rounds_median_and_its_counts_their_sum() -> None:
    level = combine_rounds([one_load(100.0, 10), one_load(300.0, 30), one_load(120.0, 12)])
    assert level["rps"] == 120.0 and level["p99_ms"] == 60.0  # medians, not the best round
    assert level["requests"] == 52 and level["warm_2xx"] == 9 and level["warm_ok"] == 3
    assert level["status_429"] == 3 and level["statuses"] == {"200": 52, "429": 3}
    assert [r["rps"] for r in level["rounds"]] == [100.0, 300.0, 120.0]


def test_one_round_is_the_load_itself() -> None:
    load = one_load(100.0, 10)
    assert combine_rounds([load]) == load


def test_every_level_is_loaded_once_per_round_in_alternating_order() -> None:
    calls: list[int] = []
    settles: list[int] = []
    rates = {32: [500.0, 400.0, 450.0], 128: [600.0, 300.0, 550.0], 512: [580.0, 590.0, 100.0]}
    latencies = [50.0, 45.0, 60.0]

    def fake_load(target: Any, c: int, seconds: float, loader: str, warmup: float) -> dict:
        calls.append(c)
        if c == 4:
            return one_load(latencies.pop(0), 5, concurrency=4)
        return one_load(rates[c].pop(0), 10, concurrency=c)

    out = measure_together(
        {"x": ("http://x", "/", {}, {})},
        4,
        [32, 128, 512],
        1.0,
        "python",
        settle=lambda: settles.append(1),
        rounds=3,
        run_load=fake_load,
    )["x"]
    assert calls == [4, 32, 128, 512, 512, 128, 32, 4, 4, 32, 128, 512]
    assert len(settles) == len(calls)  # settled before every load
    by_level = {m["concurrency"]: m for m in out["throughput"]}
    assert {c: m["rps"] for c, m in by_level.items()} == {32: 450.0, 128: 550.0, 512: 580.0}
    assert out["max_rps"] == 580.0
    assert out["latency"]["rps"] == 50.0  # the latency load is read over rounds too
    assert [r["rps"] for r in out["latency"]["rounds"]] == [50.0, 45.0, 60.0]
    assert by_level[512]["requests"] == 30


def test_targets_alternate_their_order_load_by_load() -> None:
    assert alternating(["a", "b", "c"], 3) == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]
    assert alternating(["a"], 2) == [["a"], ["a"]]


def test_targets_measured_together_take_each_load_back_to_back_each_first_in_turn() -> None:
    calls: list[tuple[str, int]] = []
    settles: list[int] = []

    def fake_load(target: Any, c: int, seconds: float, loader: str, warmup: float) -> dict:
        name = target[0]
        calls.append((name, c))
        # "after" answers 10 % more than "before" at every level, round after round
        rps = float(c) * (1.1 if name == "after" else 1.0) + len(calls)
        return one_load(rps, 10, concurrency=c)

    out = measure_together(
        {"before": ("before", "/", {}, {}), "after": ("after", "/", {}, {})},
        4,
        [32, 128],
        1.0,
        "python",
        settle=lambda: settles.append(1),
        rounds=2,
        run_load=fake_load,
    )
    # every load on both targets before the next load; the first target alternates
    assert calls == [
        ("before", 4), ("after", 4),
        ("after", 32), ("before", 32),
        ("before", 128), ("after", 128),
        ("after", 128), ("before", 128),
        ("before", 32), ("after", 32),
        ("after", 4), ("before", 4),
    ]  # fmt: skip
    assert len(settles) == len(calls)
    firsts = [calls[i][0] for i in range(0, len(calls), 2)]
    assert firsts.count("before") == firsts.count("after")
    assert set(out) == {"before", "after"}
    for name, m in out.items():
        assert [level["concurrency"] for level in m["throughput"]] == [32, 128]
        assert len(m["latency"]["rounds"]) == 2 and m["throughput"][1]["requests"] == 20
        assert m["max_rps"] == m["throughput"][1]["rps"], name
    # each level is its two rounds' median, the calls' own numbers included
    assert out["before"]["throughput"][1]["rps"] == (128 + 5 + 128 + 8) / 2
    assert out["after"]["throughput"][1]["rps"] == (128 * 1.1 + 6 + 128 * 1.1 + 7) / 2
