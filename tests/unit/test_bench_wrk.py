"""Parsing `wrk --latency` output into the bench's figures (the text is wrk 4.2's format)."""

from __future__ import annotations

import pytest

from rlgate.bench_wrk import parse

OUT = """Running 6s test @ http://127.0.0.1:41000/v1/completions
  1 threads and 32 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   185.48ms  120.10ms   1.21s    78.30%
    Req/Sec   176.12     30.31   240.00     70.00%
  Latency Distribution
     50%  161.48ms
     75%  230.11ms
     90%  341.02ms
     99%    1.01s
  1046 requests in 6.04s, 1.43MB read
  Socket errors: connect 0, read 0, write 0, timeout 3
  Non-2xx or 3xx responses: 5
Requests/sec:    173.10
Transfer/sec:    242.38KB
"""


def test_parse_reads_counts_rate_and_percentiles() -> None:
    m = parse(OUT)
    assert m["requests"] == 1041  # 1046 answered, 5 of them not 2xx
    assert m["errors"] == 8  # 5 non-2xx + 3 timeouts
    assert m["rps"] == pytest.approx(173.10)
    assert m["p50_ms"] == pytest.approx(161.48)
    assert m["p90_ms"] == pytest.approx(341.02)
    assert m["p99_ms"] == pytest.approx(1010.0)


def test_parse_microseconds_and_no_errors() -> None:
    out = OUT.replace("     50%  161.48ms", "     50%  812.00us")
    out = out.replace("  Socket errors: connect 0, read 0, write 0, timeout 3\n", "")
    out = out.replace("  Non-2xx or 3xx responses: 5\n", "")
    m = parse(out)
    assert m["p50_ms"] == pytest.approx(0.812)
    assert m["errors"] == 0 and m["requests"] == 1046
