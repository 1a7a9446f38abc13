"""One stream's stop strings cannot stall the gateway: a 300,000-character stop string is
refused, and streams with stop strings at the caps leave `/health` answering as fast as
streams without them."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import httpx
import pytest

from gateway.request_caps import CAPS

if TYPE_CHECKING:
    from tests.conftest import GatewayServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

USER = [{"role": "user", "content": "write a long story"}]


@pytest.fixture(scope="module")
def run(gateway_server: GatewayServer) -> dict:
    return gateway_server.create_run(name="stops")


@pytest.fixture(scope="module")
def http(gateway_server: GatewayServer, run: dict) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {run['api_key']}"}
    with httpx.Client(base_url=gateway_server.url, headers=headers, timeout=120) as c:
        yield c


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages"])
def test_a_300000_character_stop_string_is_refused(http: httpx.Client, run: dict, path) -> None:
    body: dict = {"model": run["name"], "max_tokens": 64, "stream": True}
    if path == "/v1/completions":
        body |= {"prompt": "once", "stop": "a" * 300_000}
    elif path == "/v1/messages":
        body |= {"messages": USER, "stop_sequences": ["a" * 300_000]}
    else:
        body |= {"messages": USER, "stop": ["a" * 300_000]}
    t0 = time.perf_counter()
    resp = http.post(path, json=body)
    assert resp.status_code == 400, resp.text[:300]
    assert time.perf_counter() - t0 < 5


def _at_the_caps() -> list[str]:
    """Stop strings as many and as long as allowed, that random text keeps half-matching."""
    return ["a" * (CAPS.stop_string_chars - 1 - i) + "b" for i in range(CAPS.stop_strings)]


def _health_p99_while_streaming(
    gateway_server: GatewayServer, http: httpx.Client, run: dict, stop: list[str] | None
) -> float:
    """/health's p99 latency while 3 streams of at least 100 events run (with `stop`), from
    at least 50 probes: the streams go on until both are true."""
    body = {
        "model": run["name"],
        "messages": USER,
        "max_tokens": 900,  # most of the tiny model's 1,024-token context: seconds of stream
        "temperature": 1.0,
        "stream": True,
        **({"stop": stop} if stop else {}),
    }
    streamed: list[int] = []
    probed = threading.Event()  # the prober has its 50 samples

    def stream() -> None:
        """Streams until 100 events went out and the prober has its samples: the random tiny
        model may sample its end-of-text token early, so one request alone may end after a
        few tokens (at most 20 requests)."""
        url, headers = gateway_server.url, http.headers
        events = 0
        with httpx.Client(base_url=url, headers=headers, timeout=120) as c:
            for _ in range(20):
                with c.stream("POST", "/v1/chat/completions", json=body) as resp:
                    assert resp.status_code == 200
                    events += sum(1 for line in resp.iter_lines() if line.startswith("data:"))
                if events > 100 and probed.is_set():
                    break
        streamed.append(events)

    threads = [threading.Thread(target=stream) for _ in range(3)]
    for t in threads:
        t.start()
    latencies = []
    with httpx.Client(base_url=gateway_server.url, timeout=10) as probe:
        while any(t.is_alive() for t in threads):
            t0 = time.perf_counter()
            assert probe.get("/health").status_code == 200
            latencies.append(time.perf_counter() - t0)
            if len(latencies) >= 50:
                probed.set()
            time.sleep(0.02)
    for t in threads:
        t.join()
    assert len(streamed) == 3 and min(streamed) > 100, streamed  # they did stream
    assert len(latencies) >= 50, len(latencies)
    latencies.sort()
    return latencies[int(0.99 * (len(latencies) - 1))]


def test_health_stays_fast_while_streams_run_with_stop_strings_at_the_caps(
    gateway_server: GatewayServer, http: httpx.Client, run: dict
) -> None:
    """Against the same streams without stop strings, measured in the same run (a load on
    the machine grows both): stop matching at the caps may cost the event loop a little,
    never a stall."""
    base = _health_p99_while_streaming(gateway_server, http, run, None)
    capped = _health_p99_while_streaming(gateway_server, http, run, _at_the_caps())
    assert capped <= 2 * base + 0.05, (
        f"/health p99 {capped * 1000:.0f} ms with stop strings at the caps, "
        f"{base * 1000:.0f} ms without"
    )
