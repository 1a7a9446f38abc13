"""Held-out figures from the store: scores, versions, the spanning row, on SQLite and PostgreSQL."""

from __future__ import annotations

import math
import statistics
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session

from core.store.db import make_async_engine, make_sync_engine
from core.store.evals import EvalFigures, eval_figures, eval_figures_sync, sampling_versions
from core.store.models import Completion, Episode, Run
from core.store.status import EpisodeStatus
from tests.integration.conftest import migrated_store


def _turn(cid: str, episode: str, version: int, n_tokens: int = 2, **kw) -> Completion:
    return Completion(
        id=cid,
        run_id="r",
        episode_id=episode,
        messages=[],
        prompt_token_ids=[1],
        output_token_ids=list(range(n_tokens)),
        output_logprobs=[-0.1] * n_tokens,
        content="",
        finish_reason="stop",
        temperature=1.0,
        policy_version=version,
        **kw,
    )


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.integration)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    with migrated_store(request.param, tmp_path) as url:
        yield url


@pytest.fixture
async def sessions(store_url: str) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    engine = make_async_engine(store_url)
    factory = async_sessionmaker(engine, expire_on_commit=False)
    async with factory.begin() as s:
        s.add(Run(id="r", name="r", model="tiny", model_path="/m"))
        s.add(Run(id="other", name="other", model="tiny", model_path="/m"))
    yield factory
    await engine.dispose()


def _eval(ep: str, reward: float | None = None, run_id: str = "r") -> Episode:
    return Episode(run_id=run_id, id=ep, group_id="g", status=EpisodeStatus.EVAL, reward=reward)


async def _seed(sessions: async_sessionmaker[AsyncSession]) -> None:
    async with sessions.begin() as s:
        s.add_all(
            [
                _eval("a", 1.0),  # episode reward, version 0
                _eval("b", 0.0),  # episode reward wins over its turn's reward, version 0
                _eval("c"),  # two turn rewards summed, version 0 (two turns, one version)
                _eval("d", 2.0),  # version 1, alone: no stderr
                _eval("e"),  # unscored: not counted
                _eval("f", 5.0),  # spans a swap inside one completion
                _eval("g", 7.0),  # spans across its turns (v1 then v2)
                _eval("h", 3.0),  # a swap recorded after its last token: version 1 only
                # A training episode at version 0 with a reward: never an evaluation figure.
                Episode(run_id="r", id="t", group_id="g", status="rewarded", reward=100.0),
                _eval("o", 50.0, run_id="other"),  # another run's
            ]
        )
    async with sessions.begin() as s:
        s.add_all(
            [
                _turn("a1", "a", 0),
                _turn("b1", "b", 0, reward=9.0),
                _turn("c1", "c", 0, reward=0.25),
                _turn("c2", "c", 0, reward=0.5),
                _turn("c3", "c", 0),
                _turn("d1", "d", 1),
                _turn("e1", "e", 0),
                _turn("f1", "f", 0, n_tokens=4, version_starts=[[0, 0], [2, 1]]),
                _turn("g1", "g", 1),
                _turn("g2", "g", 2),
                _turn("h1", "h", 1, n_tokens=2, version_starts=[[0, 1], [2, 2]]),
                _turn("t1", "t", 0),
                _turn_other(),
            ]
        )


def _turn_other() -> Completion:
    turn = _turn("o1", "o", 0)
    turn.run_id = "other"
    return turn


def _expected() -> list[EvalFigures]:
    v0 = [1.0, 0.0, 0.75]
    v1 = [2.0, 3.0]
    span = [5.0, 7.0]
    return [
        EvalFigures(0, 3, statistics.fmean(v0), statistics.stdev(v0) / math.sqrt(3)),
        EvalFigures(1, 2, 2.5, statistics.stdev(v1) / math.sqrt(2)),
        EvalFigures(None, 2, 6.0, statistics.stdev(span) / math.sqrt(2)),
    ]


async def test_figures_per_version_then_the_spanning_row(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    await _seed(sessions)
    async with sessions() as s:
        assert await eval_figures(s, "r") == _expected()
        assert await eval_figures(s, "missing") == []


async def test_the_sync_twin_gives_the_same_rows(
    sessions: async_sessionmaker[AsyncSession], store_url: str
) -> None:
    await _seed(sessions)
    engine = make_sync_engine(store_url)
    try:
        with Session(engine) as s:
            assert eval_figures_sync(s, "r") == _expected()
    finally:
        engine.dispose()


async def test_a_revised_reward_changes_the_figures(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    async with sessions.begin() as s:
        s.add(_eval("a"))
    async with sessions.begin() as s:
        s.add(_turn("a1", "a", 3, reward=1.0))
    async with sessions() as s:
        assert await eval_figures(s, "r") == [EvalFigures(3, 1, 1.0, None)]
    async with sessions.begin() as s:
        turn = await s.get_one(Completion, "a1")
        turn.reward = -1.0
    async with sessions() as s:
        assert await eval_figures(s, "r") == [EvalFigures(3, 1, -1.0, None)]
    async with sessions.begin() as s:
        (await s.get_one(Episode, ("r", "a"))).reward = 4.0  # an episode reward overrides
    async with sessions() as s:
        assert await eval_figures(s, "r") == [EvalFigures(3, 1, 4.0, None)]


def test_sampling_versions_count_only_spans_with_tokens() -> None:
    assert sampling_versions(2, None, 3) == {2}
    assert sampling_versions(2, None, 0) == set()
    assert sampling_versions(0, [[0, 0], [2, 1]], 4) == {0, 1}
    assert sampling_versions(0, [[0, 0], [0, 1]], 4) == {1}  # swapped before the first token
    assert sampling_versions(0, [[0, 0], [4, 1]], 4) == {0}  # swapped after the last one
