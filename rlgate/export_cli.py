"""`rlgate export`: stream a run's episodes from the gateway's admin API into a file.

The body goes to a temporary file next to `out` and is renamed over it only
once complete, so `out` never holds a partial export.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from urllib.parse import quote

import httpx

TIMEOUT = httpx.Timeout(30.0, read=600.0)  # a large Parquet export is built before it is sent


def run_export(args: argparse.Namespace) -> int:
    """The `rlgate export` command: gateway and admin key from the environment, like `runs`."""
    from rlgate.settings import DEV_ADMIN_KEY

    url = os.environ.get("RLGATE_URL", "http://127.0.0.1:8000")
    admin_key = os.environ.get("RLGATE_ADMIN_KEY") or DEV_ADMIN_KEY
    return export(
        url,
        admin_key,
        args.run,
        args.format,
        Path(args.out),
        status=args.status,
        min_version=args.min_version,
    )


def export(
    url: str,
    admin_key: str,
    run_id: str,
    fmt: str,
    out: Path,
    *,
    status: str | None = None,
    min_version: int | None = None,
) -> int:
    """Write the export to `out`; return the exit code (1 with a message on stderr on failure)."""
    params: dict[str, str | int] = {"format": fmt}
    if status is not None:
        params["status"] = status
    if min_version is not None:
        params["min_version"] = min_version
    endpoint = f"{url.rstrip('/')}/admin/v1/runs/{quote(run_id, safe='')}/export"
    tmp = out.with_name(f".{out.name}.{os.getpid()}.part")  # same directory: rename is atomic
    headers = {"Authorization": f"Bearer {admin_key}"}
    try:
        with httpx.stream("GET", endpoint, params=params, headers=headers, timeout=TIMEOUT) as resp:
            if resp.status_code >= 400:
                resp.read()
                print(f"export failed: {_describe(resp)}", file=sys.stderr)
                return 1
            with tmp.open("wb") as f:
                for chunk in resp.iter_bytes():
                    f.write(chunk)
        os.replace(tmp, out)
    except httpx.HTTPError as exc:
        print(f"export failed: cannot read from the gateway at {url}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"export failed: cannot write {out}: {exc}", file=sys.stderr)
        return 1
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    print(f"wrote {_count_episodes(out, fmt)} episodes to {out}")
    return 0


def _describe(resp: httpx.Response) -> str:
    try:
        message = resp.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = resp.text.strip() or resp.reason_phrase
    return f"HTTP {resp.status_code}: {message}"


def _count_episodes(path: Path, fmt: str) -> int:
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.read_metadata(path).num_rows
    with path.open("rb") as f:
        return sum(1 for _ in f)
