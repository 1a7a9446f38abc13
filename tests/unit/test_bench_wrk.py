"""The wrk script's figures: 2xx answers only are throughput; 429s and 5xx beside them."""

from __future__ import annotations

import json

import pytest

from rlgate.bench.wrk import MARK, parse, script

LINE = {
    "duration_us": 6_000_000,
    "warmup_us": 1_000_000,
    "statuses": {"200": 900, "429": 120, "503": 20, "404": 6},
    "warm_statuses": {"200": 150, "429": 3},
    "socket_errors": 3,
    "p50_us": 161_480,
    "p90_us": 341_020,
    "p99_us": 1_010_000,
}


def wrk_output(line: dict) -> str:
    """What wrk prints with the script: its own summary, then the script's line."""
    return (
        "Running 6s test @ http://127.0.0.1:41000\n"
        "  1 threads and 32 connections\n"
        "  1199 requests in 6.00s, 1.43MB read\n"
        "Requests/sec:    199.83\n"
        f"{MARK}{json.dumps(line)}\n"
    )


def test_parse_counts_only_2xx_as_throughput() -> None:
    m = parse(wrk_output(LINE))
    assert m["requests"] == 900
    assert m["rps"] == pytest.approx(180.0)  # 900 in the 5 s after warm-up; not wrk's 199.83
    assert m["warm_2xx"] == 150 and m["answers"] == 1046
    assert m["status_429"] == 120 and m["status_5xx"] == 20
    assert m["errors"] == 146 + 3  # every non-2xx answer and the socket errors
    assert m["statuses"] == {"200": 900, "404": 6, "429": 120, "503": 20}
    assert (m["p50_ms"], m["p90_ms"], m["p99_ms"]) == (161.48, 341.02, 1010.0)


def test_parse_no_answers() -> None:
    line = LINE | {"statuses": {}, "warm_statuses": {}, "socket_errors": 0}
    m = parse(wrk_output(line))
    assert m["rps"] == 0.0 and m["requests"] == 0 and m["errors"] == 0 and m["warm_2xx"] == 0


def test_script_numbers_the_path_only_when_asked() -> None:
    path = "/episodes/{n}/v1/chat/completions"
    numbered = script(path, {"a": 1}, {"Authorization": "Bearer k"}, prefix="ab12")
    assert "local numbered = true" in numbered
    assert "[==[/episodes/ab12-]==], [==[/v1/chat/completions]==]" in numbered
    assert '["Authorization"] = "Bearer k"' in numbered
    assert '["Content-Type"] = "application/json"' in numbered
    assert "local warmup = 0.0" in numbered
    fixed = script("/v1/completions", {"a": 1}, {}, warmup=2)
    assert "local numbered = false" in fixed and "local warmup = 2.0" in fixed
    assert '[==[{"a": 1}]==]' in fixed
