"""The worker's resident rank groups: one per run, formed on demand, released by rule.

Rules (docs/trainer.md, "Resident ranks"):

- **Reuse.** A step of run R at version N uses R's group when it is alive, at
  version N and of the run's world size; otherwise the old group is released
  and a new one formed from version N's checkpoint (and AdamW's state saved
  for version N, if any).
- **Release**, a version that was only offered (`weight_sync: collective`)
  and AdamW's state saved first: when the run is no longer active
  (paused, stopped, failed), when the group has been idle `idle_s`, and when
  the worker shuts down. A reaper thread checks every few seconds; it never
  touches a group that is in a step. A run with `save_optimizer_state` also
  saves it after every step, so that a crash loses nothing.
- **Crash.** A group that fails (a rank died, a timeout, a protocol error)
  is killed without saving: its in-memory state may be a step ahead of the
  store. The retry forms a new group from the newest recorded version's
  checkpoint, with AdamW's state only if one was saved for exactly that
  version (else fresh, logged, `optimizer_resumed: 0`). So no update is
  applied twice and none is half-applied; what a crash can lose, without
  `save_optimizer_state`, is AdamW's moments since the last release.
- **Several nodes.** One group at a time: the rendezvous endpoint is one
  port, so forming a group for another run releases the current one first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.config import NodeSpec
from trainer import resident_protocol as proto
from trainer.batch import Sample
from trainer.resident import ResidentGroup

logger = logging.getLogger(__name__)


@dataclass
class Slot:
    """A run's group, the lock a step or a release holds, and where AdamW goes on release."""

    group: ResidentGroup
    optimizer_dir: Callable[[int], Path] | None  # version -> directory; None: never saved
    lock: threading.Lock = field(default_factory=threading.Lock)


class ResidentPool:
    """Resident groups by run id, and the reaper that releases them."""

    def __init__(
        self,
        node: NodeSpec,
        idle_s: float,
        run_active: Callable[[str], bool],
        check_s: float = 2.0,
    ) -> None:
        """`run_active(run_id)`: whether the run still trains (not paused or stopped)."""
        self.node, self.idle_s, self.run_active, self.check_s = node, idle_s, run_active, check_s
        self.slots: dict[str, Slot] = {}
        self._lock = threading.Lock()  # guards `slots`; a slot's own lock guards its group
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None

    def step(
        self,
        run_id: str,
        init: proto.Init,
        world_size: int,
        samples: list[Sample],
        out_dir: Path,
        tokenizer_dir: Path,
        *,
        optimizer_out: Path | None,
        release_optimizer: Callable[[int], Path] | None,
        threads_per_rank: int,
        timeout_s: float,
        save: bool = True,
        release: bool = False,
    ) -> dict[str, Any]:
        """One step of `run_id` from `init.version` on its resident group (formed if needed).

        `optimizer_out`: where this step's AdamW state goes (None: not saved with the
        step). `release_optimizer(version)`: where AdamW's state goes when the group is
        released (None: nowhere). `save`: write the new version's checkpoint (else only
        offered; written on release). `release`: release the group after the step. A
        failure kills the group and re-raises: the caller fails the attempt.
        """
        while True:
            slot = self._slot_for(run_id, init, world_size, release_optimizer, threads_per_rank)
            with slot.lock:
                if self.slots.get(run_id) is not slot:
                    continue  # the reaper released it between the two lines above
                try:
                    metrics = slot.group.step(
                        samples, out_dir, tokenizer_dir, timeout_s, optimizer_out, save=save
                    )
                except BaseException:
                    self.discard(run_id)
                    raise
            if release:
                self.release(run_id)
            return metrics

    def _slot_for(
        self,
        run_id: str,
        init: proto.Init,
        world_size: int,
        optimizer_dir: Callable[[int], Path] | None,
        threads_per_rank: int,
    ) -> Slot:
        with self._lock:
            slot = self.slots.get(run_id)
            if slot is not None:
                g = slot.group
                if g.alive() and g.version == init.version and g.world_size == world_size:
                    return slot
                why = "stopped" if not g.alive() else f"at v{g.version}, world size {g.world_size}"
                logger.info("run %s: re-forming its resident group (%s)", run_id, why)
            others = [r for r in self.slots if r != run_id] if self.node.nnodes > 1 else []
        if slot is not None:
            self.release(run_id)
        for other in others:  # several nodes: one rendezvous endpoint, one group at a time
            self.release(other)
        group = ResidentGroup(init, world_size, node=self.node, threads_per_rank=threads_per_rank)
        slot = Slot(group, optimizer_dir)
        with self._lock:
            self.slots[run_id] = slot
        self._start_reaper()
        return slot

    def release(self, run_id: str) -> None:
        """Save AdamW if the run keeps it, stop the ranks, forget the group."""
        with self._lock:
            slot = self.slots.pop(run_id, None)
        if slot is None:
            return
        with slot.lock:
            g = slot.group
            state = slot.optimizer_dir(g.version) if slot.optimizer_dir and g.alive() else None
            logger.info("run %s: releasing its resident group at v%d", run_id, g.version)
            g.release(state)

    def discard(self, run_id: str) -> None:
        """Kill the group without saving anything (after a failure). The slot's lock is held."""
        with self._lock:
            slot = self.slots.pop(run_id, None)
        if slot is not None:
            slot.group.kill()

    def close(self) -> None:
        """Release every group (worker shutdown) and stop the reaper."""
        self._stop.set()
        for run_id in list(self.slots):
            self.release(run_id)

    # --- the reaper

    def _start_reaper(self) -> None:
        if self._reaper is None:
            self._reaper = threading.Thread(
                target=self._reap_loop, name="resident-reaper", daemon=True
            )
            self._reaper.start()

    def _reap_loop(self) -> None:
        while not self._stop.wait(self.check_s):
            try:
                self.reap()
            except Exception:
                logger.exception("resident reaper")

    def reap(self) -> list[str]:
        """Release the groups that are idle or whose run stopped training; returns their runs."""
        now = time.monotonic()
        released = []
        for run_id, slot in list(self.slots.items()):
            if slot.lock.locked():
                continue  # in a step: it is neither idle nor to be cut off
            idle = now - slot.group.last_used > self.idle_s
            if idle or not slot.group.alive() or not self.run_active(run_id):
                why = "idle" if idle else "not active" if slot.group.alive() else "stopped"
                logger.info("run %s: resident group %s", run_id, why)
                self.release(run_id)
                released.append(run_id)
        return released
