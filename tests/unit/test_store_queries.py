"""The store's small queries on a migrated SQLite file: guarded updates, reward posts, ranks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session

from core.store.completions import best_candidate
from core.store.db import make_async_engine, make_sync_engine
from core.store.episodes import episode_reward_posts, refresh_episode_status
from core.store.migrate import upgrade
from core.store.models import Completion, Episode, Reward, Run, RunReplica
from core.store.replicas import remove_replica, replica_urls
from core.store.runs import advance_version, advance_version_sync
from core.store.status import EpisodeStatus

T0 = datetime(2024, 1, 1, tzinfo=UTC)


def _turn(cid: str, episode: str, reward: float | None = None, **kw) -> Completion:
    return Completion(
        id=cid,
        run_id="r",
        episode_id=episode,
        messages=[],
        prompt_token_ids=[1],
        output_token_ids=[2],
        output_logprobs=[-0.1],
        content="",
        finish_reason="stop",
        temperature=1.0,
        policy_version=0,
        reward=reward,
        **kw,
    )


@pytest.fixture
async def sessions(tmp_path: Path) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    upgrade(url)
    engine = make_async_engine(url)
    factory = async_sessionmaker(engine, expire_on_commit=False)
    async with factory.begin() as s:
        s.add(Run(id="r", name="r", model="tiny", model_path="/m"))
    yield factory
    await engine.dispose()


async def test_a_version_advances_once_from_where_it_was(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    async with sessions.begin() as s:
        assert await advance_version(s, "r", 0) is True
        assert await advance_version(s, "r", 0) is False  # already at 1: matched no row
    url = str(sessions.kw["bind"].url).replace("+aiosqlite", "")
    engine = make_sync_engine(url)
    with Session(engine) as s, s.begin():
        assert advance_version_sync(s, "r", 1) is True
        assert advance_version_sync(s, "r", 1) is False
    engine.dispose()


async def test_removing_a_replica_reports_whether_it_was_there(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    async with sessions.begin() as s:
        s.add(RunReplica(run_id="r", url="http://a"))
    async with sessions.begin() as s:
        assert await replica_urls(s, "r") == ["http://a"]
        assert await remove_replica(s, "r", "http://a") is True
        assert await remove_replica(s, "r", "http://a") is False


async def test_an_episode_is_rewarded_once_every_turn_is(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    async with sessions.begin() as s:
        s.add(Episode(run_id="r", id="e", group_id="g"))
    async with sessions.begin() as s:  # after the episode: the turns' foreign key
        s.add_all([_turn("c1", "e", 1.0), _turn("c2", "e", None)])
    async with sessions.begin() as s:
        ep = await s.get(Episode, ("r", "e"))
        assert ep is not None
        await refresh_episode_status(s, ep)
        assert (ep.status, ep.reward) == (EpisodeStatus.OPEN, None)  # c2 has no reward yet
        c2 = await s.get(Completion, "c2")
        assert c2 is not None
        c2.reward = 0.5
        await s.flush()
        await refresh_episode_status(s, ep)
        assert (ep.status, ep.reward) == (EpisodeStatus.REWARDED, 1.5)


async def test_the_newest_episode_level_post_wins(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    async with sessions.begin() as s:
        s.add_all(
            [
                Reward(run_id="r", episode_id="e", value=1.0),
                Reward(run_id="r", episode_id="e", value=2.0),
                Reward(run_id="r", episode_id="e", completion_id="c1", value=9.0),  # per turn
                Reward(run_id="r", episode_id="f", completion_id="c2", value=9.0),
            ]
        )
    async with sessions() as s:
        assert await episode_reward_posts(s, "r", ["e", "f"]) == {"e": 2.0}
        assert await episode_reward_posts(s, "r", []) == {}


def test_the_best_candidate_is_the_newest_of_the_highest_rank() -> None:
    old = _turn("old", "e", conv_hash="h1", created_at=T0)
    new = _turn("new", "e", conv_hash="h1", created_at=T0 + timedelta(seconds=1))
    shorter = _turn("short", "e", conv_hash="h0", created_at=T0 + timedelta(seconds=2))
    assert best_candidate([old, new, shorter], {"h1": 2, "h0": 1}) is new
    assert best_candidate([], {"h1": 2}) is None
