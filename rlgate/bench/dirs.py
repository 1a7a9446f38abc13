"""Where the `rlgate bench` commands write their files and find their models.

A bench never writes into the directory it was started from: its data, checkpoints
and logs go to a fresh temporary directory that is removed at the end, unless
`--work-dir` names one to keep. Models are cached in the data directory, like the
gateway's (`RLGATE_MODEL_CACHE_DIR`, else `RLGATE_DATA_DIR`), unless `--cache-dir`
names another.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from core.settings import Settings


@contextlib.contextmanager
def work_dir(bench: str, keep: str | Path | None = None) -> Iterator[Path]:
    """`keep` (created if missing, left in place), or a temporary directory removed at exit."""
    if keep is not None:
        path = Path(keep).resolve()
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    path = Path(tempfile.mkdtemp(prefix=f"rlgate-bench-{bench}-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def model_cache(path: str | Path | None = None) -> Path:
    """`path`, or the data directory's model cache (as `Settings().models_dir` reads it)."""
    if path is not None:
        return Path(path)
    from core.settings import Settings  # pydantic-settings: only when a bench runs

    return Settings().models_dir


def add_dir_arguments(p: argparse.ArgumentParser, work: str | None = None) -> None:
    """`--cache-dir`, and `--work-dir` when the bench writes files (`work` says which)."""
    p.add_argument(
        "--cache-dir", type=Path, default=None, help="model cache (default: the data dir's)"
    )
    if work is not None:
        p.add_argument(
            "--work-dir",
            type=Path,
            default=None,
            help=f"{work}, kept afterwards (default: a temporary directory, removed at the end)",
        )


def stack_settings(work: Path, cache: Path, admin_key: str) -> Settings:
    """Settings of a bench's embedded stack: its data under `work`, no development key, and
    a swap loop that looks every 0.2 s so a new version is served without idling."""
    from core.settings import Settings

    return Settings(
        data_dir=work / "data",
        admin_key=admin_key,
        dev_mode=False,
        model_cache_dir=cache.resolve(),
        sync_interval_s=0.2,
    )
