"""Staleness-aware admission on a real SQLite store: capacity, hold, deadline, later turns.

Each test seeds a run and its episodes with plain rows, then calls
`Admission.admit` as `ChatService.prepare` does, with a short poll interval.
Deadlines are the run's `admission_wait_s`; no test asserts a duration.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from core.store.db import make_async_engine
from core.store.migrate import upgrade
from core.store.models import Completion, Episode, Run
from core.store.status import UNGROUPED, EpisodeStatus
from gateway.agent.episodes import Placement
from gateway.control.admission import (
    RETRY_AFTER_S,
    Admission,
    Reservations,
    capacity,
    fits,
    group_capacity,
    units,
)
from gateway.errors import RateLimited, error_response
from trainer.config import RunConfig

RUN = "run_a"


@pytest.fixture
async def sessions(tmp_path: Path) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    url = f"sqlite:///{tmp_path / 'admission.db'}"
    await asyncio.to_thread(upgrade, url)
    engine = make_async_engine(url)
    yield async_sessionmaker(engine, expire_on_commit=False)
    await engine.dispose()


async def seed(
    sessions, config: dict, episodes: dict[str, tuple[str, EpisodeStatus]], version: int = 0
) -> Run:
    """The run at `version` and its episodes: id -> (group, status)."""
    async with sessions.begin() as s:
        run = Run(
            id=RUN,
            name="a",
            model="tiny",
            model_path="/x",
            config=config,
            counters={},
            current_version=version,
        )
        s.add(run)
        await s.flush()
        for eid, (group, status) in episodes.items():
            s.add(Episode(run_id=RUN, id=eid, group_id=group, status=status))
    return run


async def set_status(sessions, ids: list[str], **values) -> None:
    async with sessions.begin() as s:
        await s.execute(
            update(Episode).where(Episode.run_id == RUN, Episode.id.in_(ids)).values(**values)
        )


async def store_episode(sessions, eid: str, group: str = "~ungrouped") -> None:
    async with sessions.begin() as s:
        s.add(Episode(run_id=RUN, id=eid, group_id=group, status=EpisodeStatus.OPEN))


def new(eid: str, group: str | None = None, link: str = "path") -> Placement:
    return Placement(eid, group, link, None)


async def until_held(admission: Admission, sessions, cfg: RunConfig, held: int) -> None:
    while True:
        async with sessions() as s:
            if (await admission.usage(s, await s.get(Run, RUN), cfg)).held == held:
                return
        await asyncio.sleep(0.01)


def test_capacity_is_max_staleness_plus_one_steps_unless_overridden() -> None:
    assert capacity(RunConfig()) == (1 + 1) * 4 * 8  # defaults: staleness 1, group 4, 8 groups
    cfg = RunConfig(max_staleness=2, group_size=2, groups_per_step=3, micro_batch_size=2)
    assert capacity(cfg) == 3 * 2 * 3
    assert capacity(RunConfig(max_staleness=0, group_size=2, groups_per_step=1,
                              micro_batch_size=2)) == 2  # fmt: skip
    assert capacity(cfg.model_copy(update={"max_pending_episodes": 5})) == 5


async def test_only_unconsumed_episodes_and_reservations_fill_capacity(sessions) -> None:
    cfg = RunConfig(max_pending_episodes=4, admission_wait_s=0)
    run = await seed(
        sessions,
        cfg.model_dump(),
        {
            "o": ("g1", EpisodeStatus.OPEN),
            "r": ("g1", EpisodeStatus.REWARDED),
            "q": ("g2", EpisodeStatus.QUEUED),
            "t": ("g3", EpisodeStatus.TRAINED),  # consumed: trained,
            "d": ("g3", EpisodeStatus.DROPPED),  # dropped (zero variance, stale, incomplete)
            "x": ("g4", EpisodeStatus.EXPIRED),  # and expired episodes free their place
        },
    )
    admission = Admission(sessions, poll_s=0.02)
    async with sessions() as s:
        assert (await admission.usage(s, run, cfg)).in_use == 3
    await admission.admit(run, cfg, new("n1", link="new"))  # 3 + 1 <= 4: admitted
    async with sessions() as s:
        assert (await admission.usage(s, run, cfg)).in_use == 4  # its reservation counts
    with pytest.raises(RateLimited):
        await admission.admit(run, cfg, new("n2", link="new"))  # full: held 0 s, then 429
    await store_episode(sessions, "n1")  # its first completion stored: counted once, not twice
    async with sessions() as s:
        assert (await admission.usage(s, run, cfg)).in_use == 4


async def test_over_capacity_is_held_then_admitted_when_a_step_consumes(sessions) -> None:
    cfg = RunConfig(max_pending_episodes=2, admission_wait_s=300)
    run = await seed(
        sessions, cfg.model_dump(), {"a": ("g", EpisodeStatus.QUEUED), "b": ("g", "queued")}
    )
    admission = Admission(sessions, poll_s=0.02)
    held = asyncio.create_task(admission.admit(run, cfg, new("c", "h")))
    await until_held(admission, sessions, cfg, 1)
    assert not held.done()
    await set_status(sessions, ["a", "b"], status=EpisodeStatus.TRAINED)  # the step committed
    await held  # admitted, no error
    async with sessions() as s:
        usage = await admission.usage(s, run, cfg)
    assert (usage.held, usage.in_use) == (0, 1)


async def test_past_the_deadline_the_answer_is_429_with_a_retry_after_the_sdk_honours(
    sessions,
) -> None:
    cfg = RunConfig(max_pending_episodes=1, admission_wait_s=0.2)
    run = await seed(sessions, cfg.model_dump(), {"a": ("g", EpisodeStatus.OPEN)})
    admission = Admission(sessions, poll_s=0.02)
    with pytest.raises(RateLimited) as exc:
        await admission.admit(run, cfg, new("b", "h"))
    assert exc.value.retry_after_s == RETRY_AFTER_S <= 60  # the openai SDK honours <= 60 s
    response = error_response(exc.value)
    assert response.status_code == 429 and response.headers["Retry-After"] == "60"
    assert exc.value.code == "admission_capacity"
    async with sessions() as s:
        assert (await admission.usage(s, run, cfg)).held == 0  # it left the queue


async def test_later_turns_are_never_held(sessions) -> None:
    cfg = RunConfig(max_pending_episodes=1, admission_wait_s=0)
    run = await seed(sessions, cfg.model_dump(), {"a": ("g", EpisodeStatus.OPEN)})
    admission = Admission(sessions, poll_s=0.02)
    # a turn that continues a stored completion
    await admission.admit(run, cfg, Placement("a", None, "prefix", Completion(id="c1")))
    # a named episode that exists, even without a matching parent (e.g. an edited history)
    await admission.admit(run, cfg, new("a", "g", link="header"))
    # while a new conversation is turned away
    with pytest.raises(RateLimited):
        await admission.admit(run, cfg, new("b", "h"))


async def test_a_group_short_of_its_members_is_completed_over_capacity(sessions) -> None:
    # More groups than the capacity wait for their second member (as after a backend lag):
    # holding those members would stall the run until group_timeout_s. They pass; a new
    # group's episode waits.
    cfg = RunConfig(group_size=2, groups_per_step=1, micro_batch_size=2, admission_wait_s=0)
    assert capacity(cfg) == 4
    run = await seed(
        sessions,
        cfg.model_dump(),
        {f"{g}1": (g, EpisodeStatus.REWARDED) for g in "wxyz"},
    )
    admission = Admission(sessions, poll_s=0.02)
    await admission.admit(run, cfg, new("w2", "w"))
    with pytest.raises(RateLimited):
        await admission.admit(run, cfg, new("w3", "w"))  # w is complete now (1 + 1 reserved)
    with pytest.raises(RateLimited):
        await admission.admit(run, cfg, new("v1", "v"))  # a new group


async def test_waiters_are_admitted_in_arrival_order_as_capacity_frees(sessions) -> None:
    cfg = RunConfig(max_pending_episodes=2, admission_wait_s=300)
    run = await seed(
        sessions, cfg.model_dump(), {"a": ("g", EpisodeStatus.OPEN), "b": ("g", "open")}
    )
    admission = Admission(sessions, poll_s=0.02)
    first = asyncio.create_task(admission.admit(run, cfg, new("c", "h")))
    await until_held(admission, sessions, cfg, 1)
    second = asyncio.create_task(admission.admit(run, cfg, new("d", "k")))
    await until_held(admission, sessions, cfg, 2)
    await set_status(sessions, ["a"], status=EpisodeStatus.EXPIRED)  # one place frees
    await first
    await asyncio.sleep(0.1)  # several polls: the second still does not fit
    assert not second.done()
    await set_status(sessions, ["b"], status=EpisodeStatus.DROPPED)
    await second


async def test_a_held_call_of_a_run_that_is_paused_gets_the_runs_429(sessions) -> None:
    cfg = RunConfig(max_pending_episodes=1, admission_wait_s=300)
    run = await seed(sessions, cfg.model_dump(), {"a": ("g", EpisodeStatus.OPEN)})
    admission = Admission(sessions, poll_s=0.02)
    held = asyncio.create_task(admission.admit(run, cfg, new("b", "h")))
    await until_held(admission, sessions, cfg, 1)
    async with sessions.begin() as s:
        await s.execute(update(Run).where(Run.id == RUN).values(status="paused"))
    with pytest.raises(RateLimited) as exc:
        await held
    assert "paused" in exc.value.message and exc.value.retry_after_s == 5


async def test_a_backend_behind_the_store_shrinks_capacity_by_a_step_per_version(sessions) -> None:
    # Right after a step commits version 3, the backend still serves 2 until the hot swap:
    # what it samples now is already a version old, so one step of the budget is used up.
    cfg = RunConfig(group_size=2, groups_per_step=1, micro_batch_size=2, admission_wait_s=0)
    assert capacity(cfg) == 4 and capacity(cfg, lag=1) == 2 and capacity(cfg, lag=2) == 0
    run = await seed(
        sessions,
        cfg.model_dump(),
        {"a": ("g", EpisodeStatus.REWARDED), "b": ("g", EpisodeStatus.REWARDED)},
        version=3,
    )
    serving = {RUN: 2}
    admission = Admission(sessions, serving.get, poll_s=0.02)
    with pytest.raises(RateLimited):
        await admission.admit(run, cfg, new("c", "h"))  # 2 in use, capacity 2 while behind
    serving[RUN] = 3  # swapped in
    await admission.admit(run, cfg, new("c", "h"))


async def test_capacity_counts_groups_so_sequentially_filled_groups_do_not_overshoot(
    sessions,
) -> None:
    # Agents that start several groups at once and fill them one member at a time: only as
    # many groups open as two steps take; their second members always get in.
    cfg = RunConfig(group_size=2, groups_per_step=1, micro_batch_size=2, admission_wait_s=0)
    assert group_capacity(cfg) == 2 and capacity(cfg) == 4
    run = await seed(sessions, cfg.model_dump(), {})
    admission = Admission(sessions, poll_s=0.02)
    await admission.admit(run, cfg, new("a1", "a"))
    await admission.admit(run, cfg, new("b1", "b"))
    with pytest.raises(RateLimited):
        await admission.admit(run, cfg, new("c1", "c"))  # a third group: over two units
    await admission.admit(run, cfg, new("a2", "a"))
    await admission.admit(run, cfg, new("b2", "b"))
    with pytest.raises(RateLimited):
        await admission.admit(run, cfg, new("a3", "a"))  # a third member opens a unit
    # ungrouped episodes count as pool chunks of group_size
    assert fits(Counter({"a": 2}), UNGROUPED, 2, cfg)
    assert not fits(Counter({"a": 2, UNGROUPED: 2}), UNGROUPED, 1, cfg)
    assert fits(Counter({"a": 2, UNGROUPED: 1}), UNGROUPED, 1, cfg)  # fills its chunk
    assert units(Counter({"a": 3, UNGROUPED: 3}), 2) == 4


async def test_concurrent_new_conversations_share_one_count_of_the_store(
    sessions, monkeypatch
) -> None:
    # Counting the store per new conversation cost three reads each under load. Callers that
    # arrive together share one count; within `poll_s` a call that fits reads nothing.
    import gateway.control.admission as admission_module

    counts = 0
    real = admission_module.unconsumed_by_group

    async def counted(s, run_id):
        nonlocal counts
        counts += 1
        return await real(s, run_id)

    monkeypatch.setattr(admission_module, "unconsumed_by_group", counted)
    cfg = RunConfig(max_pending_episodes=100, admission_wait_s=0)
    run = await seed(sessions, cfg.model_dump(), {"a": ("g", EpisodeStatus.OPEN)})
    admission = Admission(sessions, poll_s=60)
    await asyncio.gather(*(admission.admit(run, cfg, new(f"n{i}", link="new")) for i in range(20)))
    assert counts == 1
    await asyncio.gather(*(admission.admit(run, cfg, new(f"m{i}", link="new")) for i in range(20)))
    assert counts == 1  # the kept count, with this process's 40 reservations on top
    async with sessions() as s:
        assert (await admission.usage(s, run, cfg)).in_use == 41  # usage always counts afresh
    assert counts == 2


async def test_a_call_the_kept_count_turns_away_is_checked_against_a_fresh_count(
    sessions,
) -> None:
    # The kept count only over-counts within a process (a step consumed since): a call it
    # would turn away is admitted if the store, counted again, has room.
    cfg = RunConfig(max_pending_episodes=2, admission_wait_s=0)
    run = await seed(
        sessions, cfg.model_dump(), {"a": ("g", EpisodeStatus.OPEN), "b": ("g", "open")}
    )
    admission = Admission(sessions, poll_s=60)
    with pytest.raises(RateLimited):
        await admission.admit(run, cfg, new("c", "h"))
    await set_status(sessions, ["a"], status=EpisodeStatus.TRAINED)  # a step consumed one
    await admission.admit(run, cfg, new("c", "h"))  # no 429 from the minute-old count


async def test_a_named_new_conversation_that_fits_reads_nothing_per_call(
    sessions, monkeypatch
) -> None:
    # An agent on /episodes/<new id>/v1 used to cost a read "does this episode exist?" per
    # call; now only a call that would be held asks (a later turn is never held).
    import gateway.control.admission as admission_module

    asked = 0
    real = admission_module.stored_episode_ids

    async def counted(s, run_id, ids):
        nonlocal asked
        asked += 1
        return await real(s, run_id, ids)

    monkeypatch.setattr(admission_module, "stored_episode_ids", counted)
    cfg = RunConfig(max_pending_episodes=100, admission_wait_s=0)
    run = await seed(sessions, cfg.model_dump(), {})
    admission = Admission(sessions, poll_s=60)
    await asyncio.gather(*(admission.admit(run, cfg, new(f"p{i}", link="path")) for i in range(10)))
    assert asked == 0


def test_reservations_count_per_group_as_they_change_and_expire_oldest_first() -> None:
    r = Reservations()
    r.add(["a", "b"], "g1", until=10.0)
    r.add(["c"], UNGROUPED, until=11.0)
    assert r.per_group == Counter({"g1": 2, UNGROUPED: 1}) and len(r) == 3
    r.drop("a")  # seen stored
    r.drop("a")  # twice is nothing
    assert r.per_group == Counter({"g1": 1, UNGROUPED: 1})
    r.add(["b"], "g2", until=12.0)  # reserved again: it moves, with its new expiry
    assert r.per_group == Counter({"g2": 1, UNGROUPED: 1})
    r.expire(11.5)  # b's first expiry (10) no longer holds; c's (11) does
    assert r.ids() == ["b"] and r.per_group == Counter({"g2": 1})
    r.expire(12.5)
    assert not r and r.per_group == Counter()


def test_reservations_dropped_in_bulk_do_not_pile_up_in_the_expiry_queue() -> None:
    r = Reservations()
    for i in range(5000):
        r.add([f"e{i}"], UNGROUPED, until=float(i))
        r.drop(f"e{i}")  # stored at once, as under load
    r.add(["last"], UNGROUPED, until=1e9)
    assert len(r._order) <= 2 * len(r) + 1024
    r.expire(1e8)
    assert r.ids() == ["last"] and r.per_group == Counter({UNGROUPED: 1})


class BlockableCount:
    """`unconsumed_by_group` that can be held once it has read the store, before the count
    goes back to `Admission._count` (which read the stored reservations before it)."""

    def __init__(self, monkeypatch) -> None:
        import gateway.control.admission as admission_module

        self.real = admission_module.unconsumed_by_group
        self.open = asyncio.Event()
        self.open.set()
        self.entered = asyncio.Event()
        self.counts = 0
        self.held_only_first = False
        monkeypatch.setattr(admission_module, "unconsumed_by_group", self)

    async def __call__(self, s, run_id):
        self.counts += 1
        found = await self.real(s, run_id)
        if self.entered.is_set() and self.held_only_first:
            return found
        self.entered.set()
        await self.open.wait()
        return found

    def hold(self, only_the_next: bool = False) -> None:
        """Hold the counts from now on until `open` is set (`only_the_next`: one count)."""
        self.open.clear()
        self.entered.clear()
        self.held_only_first = only_the_next


async def test_a_recount_in_flight_does_not_hold_calls_under_a_recent_count(
    sessions, monkeypatch
) -> None:
    # Waiting for the recount stalled every new conversation of the process for the
    # query's time, twice a second; within `stale_s` calls go on under the kept count.
    count = BlockableCount(monkeypatch)
    cfg = RunConfig(max_pending_episodes=100, admission_wait_s=0)
    run = await seed(sessions, cfg.model_dump(), {})
    admission = Admission(sessions, poll_s=0.01, stale_s=3600)
    await admission.admit(run, cfg, new("a", link="new"))
    await asyncio.sleep(0.02)  # the kept count is past poll_s now
    count.hold()
    # a hang guard, not a timing: under the old rule this call waited for the held count
    await asyncio.wait_for(admission.admit(run, cfg, new("b", link="new")), 30)
    await count.entered.wait()  # ... and it started the recount, in the background
    assert count.counts == 2
    count.open.set()


async def test_calls_during_a_recount_never_see_an_under_count(sessions, monkeypatch) -> None:
    # The recount reads which reservations are stored, then counts. Dropping those
    # reservations before the new count is in place left a moment when an admitted,
    # stored episode was in neither: a call then was admitted past capacity.
    count = BlockableCount(monkeypatch)
    cfg = RunConfig(max_pending_episodes=1, admission_wait_s=0)
    run = await seed(sessions, cfg.model_dump(), {})
    admission = Admission(sessions, poll_s=0.01, stale_s=3600)
    await admission.admit(run, cfg, new("a", link="path"))
    await store_episode(sessions, "a")  # its first completion is stored
    await asyncio.sleep(0.02)
    count.hold()
    first = asyncio.create_task(admission.admit(run, cfg, new("b", link="path")))
    await count.entered.wait()  # the recount read the stored reservations and is held
    during = asyncio.create_task(admission.admit(run, cfg, new("c", link="path")))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not during.done()  # not admitted under "a" counted nowhere: waits for the count
    count.open.set()
    for call in (first, during):
        with pytest.raises(RateLimited):
            await call
    async with sessions() as s:
        assert (await admission.usage(s, run, cfg)).in_use == 1


async def test_a_count_that_started_before_the_one_applied_is_dropped(
    sessions, monkeypatch
) -> None:
    count = BlockableCount(monkeypatch)
    cfg = RunConfig(max_pending_episodes=100, admission_wait_s=0)
    run = await seed(sessions, cfg.model_dump(), {"a": ("g", EpisodeStatus.OPEN)})
    admission = Admission(sessions, poll_s=0.01, stale_s=3600)
    count.hold(only_the_next=True)
    async with sessions() as s:
        older = asyncio.create_task(admission.usage(s, run, cfg))
        await count.entered.wait()  # the older count has read the store's "a" and is held
        await set_status(sessions, ["a"], status=EpisodeStatus.TRAINED)
        async with sessions() as s2:
            newer = await admission.usage(s2, run, cfg)  # a newer one, after "a" trained
        assert newer.in_use == 0
        count.open.set()
        await older  # applied last
    load = await admission._load(RUN, admission._runs[RUN], 3600, 3600)
    assert load.total() == 0  # the older count did not bring "a" back
