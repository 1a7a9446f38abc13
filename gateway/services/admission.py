"""Staleness-aware admission: new conversations wait while the trainer cannot absorb them.

The rule. A run's *unconsumed* episodes are those a step may still take:
open, rewarded and queued ones, plus those this process admitted whose first
completion is not stored yet. A new episode (a new conversation; a later
turn of a stored episode always goes on) is admitted only while they stay
below the run's capacity

    capacity = (max_staleness + 1) x group_size x groups_per_step

or `max_pending_episodes` where a run sets it (an explicit override).

Why this capacity. A step takes `group_size x groups_per_step` episodes,
oldest groups first (`batch_policy`). An episode admitted at version v has
fewer than `capacity` unconsumed episodes ahead of it, the step in flight
(queued episodes) included: so it is taken at the latest by the
`max_staleness + 1`-th step counted from the one in flight, which claims at
version `v + max_staleness` and so still accepts samples of version v. No
admitted sample can age past `max_staleness` before a step takes it, and
stale drops stay near zero at the default `max_staleness` of 1 (what remains:
a group that waits for stragglers while younger groups overtake it, and the
moment between a version's commit and its hot swap). This is AReaL's rollout
capacity, `(max_head_offpolicyness + version + 1) x batch - samples`
(areal/core/staleness_manager.py), counted from the store instead of a
process-local counter, so it holds across gateway processes and restarts.

Two exceptions keep the hold from deadlocking:

* a member of a group that already has unconsumed members and is still short
  of `group_size` is admitted over capacity (bounded by the group's size):
  holding it could leave every slot to groups that wait for their last
  members, and then no step would ever free one;
* an episode is always admitted into an empty run, whatever its `n`.

Zero-variance, stale and incomplete groups are consumed by the scheduler's
pass like trained ones, and open episodes expire after `episode_timeout_s`,
so capacity always frees.

The hold. A request over capacity waits server-side (before a stream starts)
in a per-run FIFO. One poller per run with waiters re-counts the store every
`poll_s` (never one query per waiter) and admits waiters while capacity
allows. A waiter not admitted within the run's `admission_wait_s` gets 429
with `Retry-After: 60`, which the openai SDK honours (it retries twice by
default); a run paused or stopped meanwhile answers its usual 429 at once.

Reservations (admitted, not stored) are dropped when the episode shows up in
the store, or after `reservation_ttl_s` for a request that failed before
storing anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.errors import RateLimited
from gateway.services.episodes import Placement
from gateway.store.episodes import stored_episode_ids, unconsumed_episodes
from gateway.store.models import Run
from gateway.store.status import UNGROUPED
from trainer.config import RunConfig

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 60  # the most the openai SDK's default retries honour


def capacity(cfg: RunConfig) -> int:
    """Unconsumed episodes a run admits (see the module docstring for why)."""
    if cfg.max_pending_episodes is not None:
        return cfg.max_pending_episodes
    return (cfg.max_staleness + 1) * cfg.group_size * cfg.groups_per_step


def run_unavailable(run_id: str, status: str) -> RateLimited:
    """A paused, stopped or failed run's answer to agent calls."""
    return RateLimited(f"run {run_id} is {status}; retry later", retry_after_s=5)


def episode_ids(placement: Placement, n: int) -> list[str]:
    """The episodes a call opens: its own, or one per choice for n > 1 (see `ChatService`)."""
    if n == 1:
        return [placement.episode_id]
    return [f"{placement.episode_id[:95]}.n{i}" for i in range(n)]


@dataclass(frozen=True)
class Usage:
    capacity: int
    in_use: int  # unconsumed episodes, reservations included
    held: int  # new conversations this process holds for the run right now


@dataclass
class _Waiter:
    ids: list[str]
    group_id: str | None
    admitted: asyncio.Future[None]


@dataclass
class _Gate:
    """One run's admission state in this process."""

    reserved: dict[str, tuple[float, str | None]] = field(default_factory=dict)  # id -> (ttl, g)
    waiters: deque[_Waiter] = field(default_factory=deque)
    poller: asyncio.Task | None = None


class Admission:
    """Admits, holds or turns away new conversations, per run (see the module docstring)."""

    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        poll_s: float = 0.5,
        reservation_ttl_s: float = 300.0,
    ) -> None:
        self.sessions = sessions
        self.poll_s = poll_s
        self.reservation_ttl_s = reservation_ttl_s
        self._gates: dict[str, _Gate] = {}

    async def admit(self, run: Run, cfg: RunConfig, placement: Placement, n: int = 1) -> None:
        """Return once the call may sample; raise RateLimited past `admission_wait_s`."""
        if placement.parent is not None:
            return  # a later turn of a stored episode
        gate = self._gates.setdefault(run.id, _Gate())
        ids = episode_ids(placement, n)
        if any(i in gate.reserved for i in ids):
            return  # a concurrent turn of an episode admitted here, not stored yet
        group = placement.group_id if placement.group_id not in (None, UNGROUPED) else None
        async with self.sessions() as s:
            if placement.link != "new" and await stored_episode_ids(s, run.id, ids):
                return  # a named episode that exists: a later turn
            if not gate.waiters:  # FIFO: nobody overtakes those already waiting
                in_use = await self._in_use(s, run.id, gate)
                if _has_room(in_use, len(ids), capacity(cfg)) or await self._completes_group(
                    s, run.id, gate, group, cfg.group_size
                ):
                    self._reserve(gate, ids, group)
                    return
        if cfg.admission_wait_s == 0:
            raise _over_capacity(run, cfg)
        waiter = _Waiter(ids, group, asyncio.get_running_loop().create_future())
        gate.waiters.append(waiter)
        if gate.poller is None or gate.poller.done():
            gate.poller = asyncio.create_task(self._poll(run.id, gate), name=f"admit-{run.id}")
        try:
            await asyncio.wait_for(asyncio.shield(waiter.admitted), cfg.admission_wait_s)
        except TimeoutError:
            if waiter.admitted.done() and not waiter.admitted.cancelled():
                waiter.admitted.result()  # admitted at the very deadline (or the run stopped)
                return
            waiter.admitted.cancel()  # the poller skips it from now on
            raise _over_capacity(run, cfg) from None
        finally:
            with contextlib.suppress(ValueError):
                gate.waiters.remove(waiter)

    async def usage(self, s: AsyncSession, run_id: str, cfg: RunConfig) -> Usage:
        """The run's capacity and what fills it, as this process sees it."""
        gate = self._gates.get(run_id) or _Gate()
        in_use = await self._in_use(s, run_id, gate)
        return Usage(capacity(cfg), in_use, len(gate.waiters))

    async def _poll(self, run_id: str, gate: _Gate) -> None:
        """Re-count the store every `poll_s` and admit waiters in order while they fit."""
        while gate.waiters:
            await asyncio.sleep(self.poll_s)
            try:
                await self._admit_waiters(run_id, gate)
            except Exception:  # the database away: keep holding, the deadline still applies
                logger.exception("admission poll for run %s failed; retrying", run_id)

    async def _admit_waiters(self, run_id: str, gate: _Gate) -> None:
        async with self.sessions() as s:
            run = await s.get(Run, run_id)
            if run is None or run.status != "active":
                error = run_unavailable(run_id, run.status if run else "deleted")
                for w in gate.waiters:
                    if not w.admitted.done():
                        w.admitted.set_exception(error)
                gate.waiters.clear()
                return
            cfg = RunConfig.model_validate(run.config)
            in_use = await self._in_use(s, run_id, gate)
            blocked = False  # once one waiter does not fit, only group members pass it
            for w in list(gate.waiters):
                if w.admitted.done():
                    continue
                fits = not blocked and _has_room(in_use, len(w.ids), capacity(cfg))
                if not fits:
                    fits = await self._completes_group(s, run_id, gate, w.group_id, cfg.group_size)
                if w.admitted.done():
                    continue  # timed out while we counted
                if not fits:
                    blocked = True
                    continue
                self._reserve(gate, w.ids, w.group_id)
                in_use += len(w.ids)
                w.admitted.set_result(None)
                gate.waiters.remove(w)

    async def _completes_group(
        self, s: AsyncSession, run_id: str, gate: _Gate, group: str | None, group_size: int
    ) -> bool:
        """A group with unconsumed members, still short of group_size: let the next one in."""
        if group is None:
            return False
        members = await unconsumed_episodes(s, run_id, group)
        members += sum(1 for _, g in gate.reserved.values() if g == group)
        return 0 < members < group_size

    def _reserve(self, gate: _Gate, ids: list[str], group: str | None) -> None:
        until = time.monotonic() + self.reservation_ttl_s
        for i in ids:
            gate.reserved[i] = (until, group)

    async def _in_use(self, s: AsyncSession, run_id: str, gate: _Gate) -> int:
        """Unconsumed episodes in the store plus this process's reservations not stored yet."""
        now = time.monotonic()
        for i in [i for i, (until, _) in gate.reserved.items() if until < now]:
            del gate.reserved[i]
        if gate.reserved:
            for i in await stored_episode_ids(s, run_id, list(gate.reserved)):
                gate.reserved.pop(i, None)
        return await unconsumed_episodes(s, run_id) + len(gate.reserved)


def _over_capacity(run: Run, cfg: RunConfig) -> RateLimited:
    return RateLimited(
        f"run {run.id} is at its admission capacity of {capacity(cfg)} unconsumed episodes "
        f"(the trainer is behind); held {cfg.admission_wait_s:g} s, retry after "
        f"{RETRY_AFTER_S} s",
        retry_after_s=RETRY_AFTER_S,
        code="admission_capacity",
    )


def _has_room(in_use: int, n: int, cap: int) -> bool:
    """Below capacity after admitting `n`; an empty run always takes a call, whatever its n."""
    return in_use == 0 or in_use + n <= cap
