"""A closed-loop HTTP load from `wrk` (C, one thread): the bench's load generator when present.

On a 2-core machine a Python load generator is itself the ceiling (it tops
out near 230 requests/s against a stub that can serve 3,600 with `wrk`), which
squeezes every target towards the same figure. `wrk` leaves the CPU to the
servers being measured. The result has the shape of `bench_gateway._load`.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

_SCRIPT = """wrk.method = "POST"
wrk.body = [==[{body}]==]
wrk.headers["Content-Type"] = "application/json"
{headers}
"""
_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0, "m": 60_000.0}


def available() -> bool:
    return shutil.which("wrk") is not None


def _ms(value: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)(us|ms|s|m)", value.strip()).groups()
    return float(number) * _UNITS[unit]


def parse(out: str) -> dict:
    """Requests, errors, requests/s and the p50/p90/p99 latencies of `wrk --latency` output."""
    pct = {int(m[1]): _ms(m[2]) for m in re.finditer(r"^\s+(\d+)%\s+(\S+)\s*$", out, re.M)}
    requests = int(re.search(r"^\s+(\d+) requests in", out, re.M)[1])
    failed = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    failed = int(failed[1]) if failed else 0  # counted in "requests in" too
    errors = failed + sum(int(n) for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", out))
    return {
        "requests": requests - failed,
        "errors": errors,
        "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out)[1]),
        "p50_ms": round(pct[50], 3),
        "p90_ms": round(pct[90], 3),
        "p99_ms": round(pct[99], 3),
    }


def wrk_load(url: str, body: dict, headers: dict, concurrency: int, seconds: float) -> dict:
    """`concurrency` connections, each sending its next request when one ends, for `seconds`."""
    lines = "\n".join(f'wrk.headers["{k}"] = "{v}"' for k, v in headers.items())
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "post.lua"
        script.write_text(_SCRIPT.format(body=json.dumps(body), headers=lines))
        cmd = ["wrk", "-t1", f"-c{concurrency}", f"-d{max(1, round(seconds))}s", "--latency"]
        cmd += ["--timeout", "30s", "-s", str(script), url]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return {"concurrency": concurrency, **parse(out)}
