"""`rlgate export`: stream a run's episodes (or, `--merged`, its model) from the admin API.

The body goes to a temporary file next to `out` and is renamed over it only
once complete, so `out` never holds a partial export. `--merged` writes a
version (default: the current one) as a plain Hugging Face directory: a LoRA
run's adapter merged into its base model by the gateway, a full fine-tune's
checkpoint as it is; the tar is unpacked next to `out` and renamed over it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tarfile
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import quote

import httpx

from core.store.checkpoints import fsync_dir, fsync_tree

TIMEOUT = httpx.Timeout(30.0, read=600.0)  # a large Parquet export is built before it is sent


def run_export(args: argparse.Namespace) -> int:
    """The `rlgate export` command: gateway and admin key from the environment, like `runs`."""
    from core.settings import DEV_ADMIN_KEY

    url = os.environ.get("RLGATE_URL", "http://127.0.0.1:8000")
    admin_key = os.environ.get("RLGATE_ADMIN_KEY") or DEV_ADMIN_KEY
    if args.merged:
        return export_model(url, admin_key, args.run, Path(args.out), version=args.version)
    query = ExportQuery(args.format, args.split, args.status, args.min_version)
    return export(url, admin_key, args.run, Path(args.out), query)


@dataclass(frozen=True)
class ExportQuery:
    """What the admin export is asked for: a format, a split (`train`: training episodes,
    `eval`: evaluation ones), and optionally one episode status and the oldest version."""

    format: str = "jsonl"
    split: str = "train"
    status: str | None = None
    min_version: int | None = None

    def params(self) -> dict[str, str | int]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def export(url: str, admin_key: str, run_id: str, out: Path, query: ExportQuery) -> int:
    """Write the export `query` asks for to `out`; return the exit code (1 with a message
    on stderr on failure)."""
    params = query.params()
    endpoint = f"{url.rstrip('/')}/admin/v1/runs/{quote(run_id, safe='')}/export"
    tmp = out.with_name(f".{out.name}.{os.getpid()}.part")  # same directory: rename is atomic
    headers = {"Authorization": f"Bearer {admin_key}"}
    try:
        refused = _download(endpoint, params, headers, tmp)
        if refused:
            print(f"export failed: {refused}", file=sys.stderr)
            return 1
        os.replace(tmp, out)
        fsync_dir(out.parent)  # the new name survives a crash, not only the bytes
    except httpx.HTTPError as exc:
        print(f"export failed: cannot read from the gateway at {url}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"export failed: cannot write {out}: {exc}", file=sys.stderr)
        return 1
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    print(f"wrote {_count_episodes(out, query.format)} episodes to {out}")
    return 0


def _download(endpoint: str, params: dict, headers: dict[str, str], dest: Path) -> str | None:
    """Stream a GET of `endpoint` into `dest`; the gateway's refusal, described, if it refuses."""
    with httpx.stream("GET", endpoint, params=params, headers=headers, timeout=TIMEOUT) as resp:
        if resp.status_code >= 400:
            resp.read()
            return _describe(resp)
        with dest.open("wb") as f:
            for chunk in resp.iter_bytes():
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())  # whole on disk before it replaces the old export
    return None


def export_model(
    url: str, admin_key: str, run_id: str, out: Path, *, version: int | None = None
) -> int:
    """Write `version` of the run (default: current) to the directory `out`, merged if LoRA."""
    base = f"{url.rstrip('/')}/admin/v1/runs/{quote(run_id, safe='')}"
    headers = {"Authorization": f"Bearer {admin_key}"}
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if version is None:
            resp = httpx.get(base, headers=headers, timeout=TIMEOUT)
            if resp.status_code >= 400:
                print(f"export failed: {_describe(resp)}", file=sys.stderr)
                return 1
            version = int(resp.json()["current_version"])
        endpoint = f"{base}/versions/{version}/checkpoint"
        tar_path = scratch / "model.tar"
        params = {"merged": "true"}
        refused = _download(endpoint, params, headers, tar_path)
        if refused:
            print(f"export failed: {refused}", file=sys.stderr)
            return 1
        with tarfile.open(tar_path) as tar:
            tar.extractall(scratch / "x", filter="data")
        (top,) = (scratch / "x").iterdir()  # one folder, "<run>-v<version>"
        fsync_tree(top)
        shutil.rmtree(out, ignore_errors=True)
        top.rename(out)
        fsync_dir(out.parent)
    except httpx.HTTPError as exc:
        print(f"export failed: cannot read from the gateway at {url}: {exc}", file=sys.stderr)
        return 1
    except (OSError, tarfile.TarError, ValueError) as exc:
        print(f"export failed: cannot write {out}: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"wrote version {version} of {run_id} as a Hugging Face model to {out}")
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
