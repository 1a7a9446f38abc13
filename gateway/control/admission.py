"""Staleness-aware admission: new conversations wait while the trainer cannot absorb them.

The rule. A run's *unconsumed* episodes are those a step may still take:
open, rewarded and queued ones, plus those this process admitted whose first
completion is not stored yet. They are counted in *group units*: a group
counts `ceil(members / group_size)`, and ungrouped episodes (which the batch
policy pools in chunks of `group_size`) `ceil(episodes / group_size)` in all.
A new episode (a new conversation; a later turn of a stored episode always
goes on) is admitted while the units, itself included, stay within

    group capacity = (max_staleness + 1) x groups_per_step

that is `(max_staleness + 1) x group_size x groups_per_step` episodes. An
episode that joins a group short of `group_size` adds no unit, so it is
admitted even when the run is full: holding it would leave every place to
groups waiting for their last members, and no step could ever free one.
`max_pending_episodes` overrides all this with a plain episode count (named
groups short of members still complete).

Why this capacity. A step takes `groups_per_step` groups, oldest first
(`batch_policy`). A group admitted at version v has fewer than the capacity's
units ahead of it, the step in flight (queued episodes) included, so the
`max_staleness + 1`-th step counted from the one in flight takes it at the
latest; that step claims at version `v + max_staleness` and still accepts
samples of v. Nothing admitted can age past `max_staleness` before a step
takes it, so stale drops stay near zero at the default `max_staleness` of 1.
Counting in groups, not episodes, matters: agents that start many groups at
once and fill them one member at a time would otherwise open twice as many
groups as the trainer absorbs in time.

A sample records the version its backend served, which trails the store's
newest between a step's commit and the hot swap (`SwapLoop`). Each version
the backend is behind uses up one step of the budget: the capacity in force
is `(max_staleness + 1 - lag) x groups_per_step` units, so right after a step
commits, new conversations wait for the swap rather than sample on weights
that are already a version old.

This is AReaL's rollout capacity, `(max_head_offpolicyness + version + 1) x
batch - samples` (areal/core/staleness_manager.py), counted from the store
instead of a process counter, so it holds across gateway processes.
Zero-variance, stale and incomplete groups are consumed by the scheduler's
pass like trained ones, and open episodes expire after `episode_timeout_s`,
so capacity always frees.

The hold. A request over capacity waits server-side (before a stream starts)
in a per-run FIFO. One poller per run with waiters re-counts the store every
`poll_s` (never one query per waiter) and admits waiters while they fit. A
waiter not admitted within the run's `admission_wait_s` gets 429 with
`Retry-After: 60`, which the openai SDK honours (it retries twice by
default); a run paused or stopped meanwhile answers its usual 429 at once.
A waiter holds none of the process's overload slots while it waits
(`gateway.middleware.overload.SlotLease`): it takes them again, in line, once
admitted, so a run whose trainer is behind cannot starve the other runs.
Reservations (admitted, not stored) end when the episode shows up in the
store, or after `reservation_ttl_s` for a request that failed before storing.

The count. Counting the store for every new conversation would cost three
reads each (a third of the gateway's CPU under load, growing with the run's
open episodes). So each process keeps one count per run, taken by one query that
every concurrent caller shares, and a call that fits under a count at most
`poll_s` old is admitted without reading the store. A count older than that
is taken again in the background while calls go on under the kept one, for
up to `stale_s`: a caller that waited for the recount would stall every new
conversation of the process for the query's time (which grows with the run's
open episodes), twice a second. Within one
process the kept count never under-counts: what it admitted since is in its
reservations, and what the trainer consumed since only makes the true load
smaller. That holds while a recount is in flight because the recount drops
the reservations it found stored and replaces the count at one instant,
after its last read, and only if no later-started count was applied first.
A call that does not fit under the kept count is checked against a fresh
one before it waits. What other gateway processes admitted shows up once their
episodes are stored and the count is retaken (at most `poll_s` later), as
their reservations never did; the capacity is a soft bound across processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from core.store.episodes import stored_episode_ids, unconsumed_by_group
from core.store.models import Run
from core.store.runs import run_version
from core.store.status import UNGROUPED
from gateway.agent.episodes import Placement
from gateway.errors import RateLimited
from gateway.middleware.overload import slots_stepped_out
from trainer.config import RunConfig

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 60  # the most the openai SDK's default retries honour


def group_capacity(cfg: RunConfig, lag: int = 0) -> int | None:
    """Group units a run admits while its backend serves `lag` versions behind the store's
    newest; None under a `max_pending_episodes` override."""
    return None if cfg.max_pending_episodes is not None else _staleness_groups(cfg, lag)


def _staleness_groups(cfg: RunConfig, lag: int) -> int:
    return max(0, cfg.max_staleness + 1 - lag) * cfg.groups_per_step


def capacity(cfg: RunConfig, lag: int = 0) -> int:
    """The same in episodes: `(max_staleness + 1 - lag) x group_size x groups_per_step`."""
    if cfg.max_pending_episodes is not None:
        return cfg.max_pending_episodes
    return _staleness_groups(cfg, lag) * cfg.group_size


def units(load: Counter[str], group_size: int) -> int:
    """Group units of unconsumed episodes counted per group id (see the module docstring)."""
    return sum(-(-n // group_size) for n in load.values())


def fits(load: Counter[str], group: str, n: int, cfg: RunConfig, lag: int = 0) -> bool:
    """Whether `n` new episodes of `group` (UNGROUPED: none named) may start now."""
    before = units(load, cfg.group_size)
    if before == 0:
        return True  # an empty run takes any call, whatever its n
    after = units(load + Counter({group: n}), cfg.group_size)
    joins = after == before and load[group] > 0  # fills a group short of members
    if cfg.max_pending_episodes is not None:
        return (joins and group != UNGROUPED) or (load.total() + n <= cfg.max_pending_episodes)
    return joins or after <= _staleness_groups(cfg, lag)


def run_unavailable(run_id: str, status: str) -> RateLimited:
    """A paused, stopped or failed run's answer to agent calls."""
    return RateLimited(f"run {run_id} is {status}; retry later", retry_after_s=5)


def episode_ids(placement: Placement, n: int) -> list[str]:
    """The episodes a call opens: its own, or one per choice for n > 1 (see `ChatService`)."""
    if n == 1:
        return [placement.episode_id]
    return [f"{placement.episode_id[:95]}.n{i}" for i in range(n)]


@dataclass(frozen=True)
class CapacityUsage:
    """A run's admission capacity in force and what fills it (`Admission.usage`)."""

    capacity: int  # episodes
    in_use: int  # unconsumed episodes, reservations included
    group_capacity: int | None  # group units (None: max_pending_episodes overrides)
    groups_in_use: int
    held: int  # new conversations this process holds for the run right now


@dataclass
class _Waiter:
    ids: list[str]
    group: str
    admitted: asyncio.Future[None]


class Reservations:
    """Episodes admitted here whose first completion is not seen stored yet.

    Kept per group as they change, so what a call reads of them costs the same with ten
    reservations or ten thousand (a burst of new conversations reserves one each, and
    every new conversation reads them): expiry takes the oldest off a queue in order
    (one TTL for all, so the queue is in expiry order), the count per group is updated
    on each change.
    """

    def __init__(self) -> None:
        self._until: dict[str, tuple[float, str]] = {}  # id -> (until, group)
        self.per_group: Counter[str] = Counter()
        self._order: deque[tuple[float, str]] = deque()  # (until, id), oldest first

    def __contains__(self, episode_id: str) -> bool:
        return episode_id in self._until

    def __len__(self) -> int:
        return len(self._until)

    def ids(self) -> list[str]:
        return list(self._until)

    def add(self, ids: list[str], group: str, until: float) -> None:
        for i in ids:
            self.drop(i)
            self._until[i] = (until, group)
            self.per_group[group] += 1
            self._order.append((until, i))
        if len(self._order) > 2 * len(self._until) + 1024:  # mostly ids dropped since
            self._order = deque(sorted((u, i) for i, (u, _) in self._until.items()))

    def drop(self, episode_id: str) -> None:
        entry = self._until.pop(episode_id, None)
        if entry is not None:
            group = entry[1]
            self.per_group[group] -= 1
            if not self.per_group[group]:
                del self.per_group[group]

    def expire(self, now: float) -> None:
        """Drop those reserved until before `now` (a request that failed before storing)."""
        while self._order and self._order[0][0] < now:
            until, i = self._order.popleft()
            entry = self._until.get(i)
            if entry is not None and entry[0] == until:
                self.drop(i)


@dataclass
class _RunAdmission:
    """One run's admission state in this process."""

    reserved: Reservations = field(default_factory=Reservations)
    waiters: deque[_Waiter] = field(default_factory=deque)
    poller: asyncio.Task | None = None
    stored: Counter[str] = field(default_factory=Counter)  # unconsumed per group, last count
    version: int = 0  # the run's newest version, read with the count
    counted_at: float = float("-inf")  # monotonic time the last count started
    counting: asyncio.Task[None] | None = None  # the count in flight, shared by its callers


class Admission:
    """Admits, holds or turns away new conversations, per run (see the module docstring)."""

    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        serving_version: Callable[[str], int | None] = lambda run_id: None,
        poll_s: float = 0.5,
        reservation_ttl_s: float = 300.0,
        stale_s: float = 5.0,
    ) -> None:
        self.sessions = sessions
        self.serving_version = serving_version  # run id -> the version its backend serves
        self.poll_s = poll_s
        self.stale_s = max(stale_s, poll_s)  # calls go on under a count this old, no older
        self.reservation_ttl_s = reservation_ttl_s
        self._runs: dict[str, _RunAdmission] = {}

    async def admit(self, run: Run, cfg: RunConfig, placement: Placement, n: int = 1) -> None:
        """Return once the call may sample; raise RateLimited past `admission_wait_s`."""
        if placement.parent is not None or placement.joined:
            return  # a later turn of a stored episode (of this policy, or another of its run)
        state = self._runs.setdefault(run.id, _RunAdmission())
        ids = episode_ids(placement, n)
        if any(i in state.reserved for i in ids):
            return  # a concurrent turn of an episode admitted here, not stored yet
        group = placement.group_id or UNGROUPED
        if not state.waiters:  # FIFO: nobody overtakes those already waiting
            # the kept count first; a call it turns away gets a fresh count before it waits
            for max_age_s, stale_s in ((self.poll_s, self.stale_s), (0.0, 0.0)):
                load = await self._load(run.id, state, max_age_s, stale_s)
                if fits(load, group, len(ids), cfg, self._lag_of(run, state)):
                    # A named episode may exist already (a later turn): it is reserved all
                    # the same, counted twice until the next count finds it stored. Asking
                    # the store first would cost every new named conversation a read.
                    self._reserve(state, ids, group)
                    return
        if placement.link != "new":
            async with self.sessions() as s:
                if await stored_episode_ids(s, run.id, ids):
                    return  # a named episode that exists: a later turn, never held
        if cfg.admission_wait_s == 0:
            raise _over_capacity(run, cfg)
        # A held call waits without its overload slots: it does no work meanwhile, and a run
        # whose trainer is behind must not hold every slot of the process (the slots are
        # taken again, in line, once it is admitted).
        async with slots_stepped_out():
            waiter = _Waiter(ids, group, asyncio.get_running_loop().create_future())
            await self._wait(run, cfg, state, waiter)

    async def _wait(self, run: Run, cfg: RunConfig, state: _RunAdmission, waiter: _Waiter) -> None:
        """In line until the poller admits `waiter`; RateLimited past `admission_wait_s`."""
        state.waiters.append(waiter)
        if state.poller is None or state.poller.done():
            state.poller = asyncio.create_task(self._poll(run.id, state), name=f"admit-{run.id}")
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
                state.waiters.remove(waiter)

    async def usage(self, s: AsyncSession, run: Run, cfg: RunConfig) -> CapacityUsage:
        """The run's capacity in force and what fills it, as this process sees it."""
        state = self._runs.setdefault(run.id, _RunAdmission())
        # Counted on the caller's session: it holds a connection already, and asking the
        # pool for a second one while holding it could starve a full pool (every caller
        # holding one, waiting for one more).
        await self._count(run.id, state, s)
        load = self._current(state)
        lag = self._lag_of(run, state)
        return CapacityUsage(
            capacity=capacity(cfg, lag),
            in_use=load.total(),
            group_capacity=group_capacity(cfg, lag),
            groups_in_use=units(load, cfg.group_size),
            held=len(state.waiters),
        )

    async def _poll(self, run_id: str, state: _RunAdmission) -> None:
        """Re-count the store every `poll_s` and admit waiters in order while they fit."""
        while state.waiters:
            await asyncio.sleep(self.poll_s)
            try:
                await self._admit_waiters(run_id, state)
            except Exception:  # the database away: keep holding, the deadline still applies
                logger.exception("admission poll for run %s failed; retrying", run_id)

    async def _admit_waiters(self, run_id: str, state: _RunAdmission) -> None:
        async with self.sessions() as s:
            run = await s.get(Run, run_id)
            if run is None or run.status != "active":
                error = run_unavailable(run_id, run.status if run else "deleted")
                for w in state.waiters:
                    if not w.admitted.done():
                        w.admitted.set_exception(error)
                state.waiters.clear()
                return
            cfg = RunConfig.model_validate(run.config)
        load = await self._load(run_id, state, 0.0)
        lag = self._lag_of(run, state)
        blocked = False  # once one waiter does not fit, only those joining a group pass it
        for w in list(state.waiters):
            if w.admitted.done():
                continue
            if not fits(load, w.group, len(w.ids), cfg, lag) or (
                blocked
                and units(load + Counter({w.group: len(w.ids)}), cfg.group_size)
                > units(load, cfg.group_size)
            ):
                blocked = True
                continue
            self._reserve(state, w.ids, w.group)
            load[w.group] += len(w.ids)
            w.admitted.set_result(None)
            state.waiters.remove(w)

    def _lag_of(self, run: Run, state: _RunAdmission) -> int:
        """Versions the run's backend in this process serves behind the store's newest
        (the caller's run may be a cached copy: the newer of it and the count's)."""
        serving = self.serving_version(run.id)
        newest = max(run.current_version, state.version)
        return 0 if serving is None else max(0, newest - serving)

    def _reserve(self, state: _RunAdmission, ids: list[str], group: str) -> None:
        state.reserved.add(ids, group, time.monotonic() + self.reservation_ttl_s)

    async def _load(
        self, run_id: str, state: _RunAdmission, max_age_s: float, stale_s: float = 0.0
    ) -> Counter[str]:
        """Unconsumed episodes per group: the store's as counted at most `max_age_s` ago
        (counted again otherwise, and waited for unless the kept count is at most
        `stale_s` old), plus reservations not stored yet."""
        age = time.monotonic() - state.counted_at
        if age > max_age_s:
            if state.counting is None or state.counting.done():
                state.counting = asyncio.create_task(self._count(run_id, state))
                state.counting.add_done_callback(_log_count_failure)
            if age > stale_s:
                await asyncio.shield(state.counting)  # one count for every caller waiting on it
        return self._current(state)

    @staticmethod
    def _current(state: _RunAdmission) -> Counter[str]:
        """The kept count plus the reservations not stored yet (expired ones dropped)."""
        state.reserved.expire(time.monotonic())
        load = Counter(state.stored)
        load.update(state.reserved.per_group)
        return load

    async def _count(
        self, run_id: str, state: _RunAdmission, session: AsyncSession | None = None
    ) -> None:
        """Count the store once (on `session`, else a session of its own), then at one
        instant drop the reservations found stored and keep the per-group count.

        Stored reservations are read before the count, so an episode stored between
        the two reads is counted twice (for a moment, the safe way), never not at all.
        Until the count is applied, what it found stored stays reserved too, so callers
        admitted meanwhile under the kept count over-count, never under-count. A count
        that started before the one applied last is dropped: its reads are older.
        """
        started = time.monotonic()
        async with contextlib.AsyncExitStack() as stack:
            if session is None:
                session = await stack.enter_async_context(self.sessions())
            ids = state.reserved.ids()
            found = await stored_episode_ids(session, run_id, ids) if ids else []
            stored = Counter(await unconsumed_by_group(session, run_id))
            version = await run_version(session, run_id)
        state.version = max(state.version, version or 0)
        if started <= state.counted_at:
            return
        for i in found:
            state.reserved.drop(i)
        state.stored, state.counted_at = stored, started


def _log_count_failure(task: asyncio.Task[None]) -> None:
    """A background count's error (callers that waited for it got it too)."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        logger.warning("admission count failed: %s", exc)


def _over_capacity(run: Run, cfg: RunConfig) -> RateLimited:
    return RateLimited(
        f"run {run.id} is at its admission capacity of {capacity(cfg)} unconsumed episodes "
        f"(the trainer is behind); held {cfg.admission_wait_s:g} s, retry after "
        f"{RETRY_AFTER_S} s",
        retry_after_s=RETRY_AFTER_S,
        code="admission_capacity",
    )
