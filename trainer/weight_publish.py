"""When a version's checkpoint is written under `weight_sync`, and how the gateway learns of it.

`disk`: every version, as the step ends. `collective`: every
`save_every_steps` versions (`save_due`), and the version left unsaved when
the run is paused or stopped, or the worker shuts down (`StepWeights`, for
the in-process engine; resident groups do the same on release,
`trainer.resident`). Each offered version gets an offer file next to its
checkpoint directory (`write_offer`), written before the version is
committed. After a crash the versions only offered are gone; a fresh engine
starts from `newest_saved` (docs/weight-sync.md).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from inference.weight_source import offer_path, saved
from trainer.config import RunConfig
from trainer.weight_server import WeightServer

logger = logging.getLogger(__name__)


def write_offer(checkpoint_dir: Path, url: str, version: int) -> Path:
    """The offer of `version` next to its checkpoint directory (atomically)."""
    path = offer_path(Path(checkpoint_dir))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"url": url, "version": version}))
    tmp.replace(path)
    return path


def save_due(cfg: RunConfig, version: int) -> bool:
    """Whether version `version`'s checkpoint is written when it is trained."""
    return cfg.weight_sync == "disk" or version % cfg.save_every_steps == 0


@dataclass
class Unsaved:
    """A version trained and offered but not yet written to its checkpoint directory."""

    version: int
    out_dir: Path
    save: Callable[[], None]  # writes it (the engine still holds exactly this version)


@dataclass
class StepWeights:
    """After each in-process step: write the checkpoint when due, offer the weights if
    collective; write what is still unsaved when asked (pause, stop, worker shutdown)."""

    host: str = "127.0.0.1"
    secret: str = field(default="", repr=False)  # the weight server's (weight_sync_secret)
    server: WeightServer | None = None
    unsaved: dict[str, Unsaved] = field(default_factory=dict)
    locks: dict[str, threading.Lock] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _watcher: threading.Thread | None = None

    def lock(self, run_id: str) -> threading.Lock:
        """Held while the run's engine steps or saves (the pause watcher saves from a thread)."""
        return self.locks.setdefault(run_id, threading.Lock())

    def after_step(
        self,
        run_id: str,
        cfg: RunConfig,
        version: int,
        out_dir: Path,
        save: Callable[[], None],
        state: Callable[[], dict[str, torch.Tensor]],
    ) -> dict[str, float]:
        """`version` was just trained: save and/or offer it. Returns the step's figures."""
        t0 = time.perf_counter()
        due = save_due(cfg, version)
        if due:
            save()
        t1 = time.perf_counter()
        if cfg.weight_sync == "collective":
            if self.server is None:
                self.server = WeightServer(self.host, secret=self.secret)
            self.server.publish(run_id, version, state())
            write_offer(out_dir, self.server.url_for(run_id), version)
            if due:
                self.unsaved.pop(run_id, None)
            else:
                self.unsaved[run_id] = Unsaved(version, out_dir, save)
        return {"saved": float(due), "save_s": t1 - t0, "offer_s": time.perf_counter() - t1}

    def save_unsaved(self, run_id: str) -> int | None:
        """Write the run's unsaved version, if any; returns it. Takes the run's lock."""
        with self.lock(run_id):
            entry = self.unsaved.pop(run_id, None)
            if entry is None or saved(entry.out_dir):
                return None
            entry.save()
        logger.info("run %s: saved v%d (it was only offered)", run_id, entry.version)
        return entry.version

    def watch(self, run_active: Callable[[str], bool], every_s: float = 2.0) -> None:
        """Save a run's unsaved version once it no longer trains (paused, stopped), from a
        thread checking every `every_s`; `close` stops it."""

        def loop() -> None:
            while not self._stop.wait(every_s):
                for run_id in list(self.unsaved):
                    try:
                        if not run_active(run_id):
                            self.save_unsaved(run_id)
                    except Exception:
                        logger.exception("run %s: saving its unsaved version failed", run_id)

        if self._watcher is None:
            self._watcher = threading.Thread(target=loop, name="unsaved-watch", daemon=True)
            self._watcher.start()

    def forget(self, run_id: str) -> None:
        """The run's engine is gone (a failed step): nothing of it can be saved or sent."""
        self.unsaved.pop(run_id, None)
        if self.server is not None:
            self.server.forget(run_id)

    def close(self) -> None:
        """Worker shutdown: write every unsaved version, stop serving."""
        self._stop.set()
        for run_id in list(self.unsaved):
            try:
                self.save_unsaved(run_id)
            except Exception:
                logger.exception("run %s: saving its unsaved version failed", run_id)
        if self.server is not None:
            self.server.close()


def newest_saved(session: Any, run_id: str, version: int) -> Any:
    """The newest `PolicyVersion` at or below `version` whose checkpoint is on disk, or None.

    After a crash the versions that were only offered are gone: a fresh engine
    starts from this one and keeps counting from `version` (docs/weight-sync.md).
    """
    from sqlalchemy import select

    from core.store.models import PolicyVersion

    stmt = (
        select(PolicyVersion)
        .where(PolicyVersion.run_id == run_id, PolicyVersion.version <= version)
        .order_by(PolicyVersion.version.desc())
    )
    for pv in session.execute(stmt).scalars():
        if pv.version == 0 or saved(Path(pv.checkpoint_path)):
            if pv.version != version:
                logger.warning(
                    "run %s: v%d was never saved; its trainer starts from v%d's weights",
                    run_id, version, pv.version,
                )  # fmt: skip
            return pv
    return None
