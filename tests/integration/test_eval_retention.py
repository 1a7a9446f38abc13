"""Evaluation retention (`gateway.control.eval_retention`) on PostgreSQL and SQLite.

Rows are written as the gateway writes them: episodes and completions through the
capture's store inserts, reward posts and stored responses as their services add
them. A run keeps its newest `eval_keep_episodes` evaluation episodes and, with
`eval_retention_s`, only those active within it; what goes, goes whole (its
completions, responses and reward posts), a conversation active in the last
`QUIET_S` stays, and training episodes are never touched whatever their age.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import async_sessionmaker

from core.store.completions import insert_completions
from core.store.db import make_async_engine
from core.store.episodes import insert_episodes
from core.store.evals import eval_figures
from core.store.models import Completion, Episode, Reward, Run
from core.store.responses import StoredResponse
from core.store.status import EpisodeStatus
from gateway.control import eval_retention
from gateway.control.eval_retention import EvalRetention, prune_all
from gateway.control.scheduler import TrainingScheduler
from tests.integration.conftest import migrated_store
from trainer.config import RunConfig

pytestmark = pytest.mark.integration

NOW = datetime.now(UTC).replace(microsecond=0)
OLD = NOW - timedelta(days=2)
TRAINING = ["trained", "dropped", "expired"]  # final statuses: no scheduler pass moves them


@pytest.fixture(params=["postgresql", "sqlite"])
def db_url(request, tmp_path) -> Iterator[str]:
    with migrated_store(request.param, tmp_path) as url:
        yield url


@pytest.fixture
async def sessions(db_url: str):
    engine = make_async_engine(db_url, 2)
    yield async_sessionmaker(engine, expire_on_commit=False)
    await engine.dispose()


async def make_run(sessions, run_id: str, status: str = "paused", **config) -> None:
    async with sessions.begin() as s:
        s.add(
            Run(
                id=run_id,
                name=run_id,
                model="tiny",
                model_path="/x",
                status=status,
                config=RunConfig(**config).model_dump(),
                counters={},
            )
        )


async def episode(
    sessions,
    run_id: str,
    ep: str,
    created: datetime,
    *,
    status: str = EpisodeStatus.EVAL,
    reward: float | None = 1.0,
    turns: int = 2,
    last_call: datetime | None = None,
    reward_at: datetime | None = None,
    version: int = 1,
) -> None:
    """An episode of `turns` calls (the last at `last_call`), a response for its first
    call and, with `reward`, one episode reward post at `reward_at`."""
    last_call = last_call or created
    calls = [
        Completion(
            id=f"{run_id}-{ep}-c{t}",
            run_id=run_id,
            episode_id=ep,
            messages=[{"role": "user", "content": f"{ep} turn {t}"}],
            prompt_token_ids=[1, 2, 3],
            output_token_ids=[4, 5],
            output_logprobs=[-0.5, -0.25],
            content="ok",
            finish_reason="stop",
            temperature=1.0,
            policy_version=version,
            created_at=created if t < turns - 1 else last_call,
        )
        for t in range(turns)
    ]
    async with sessions.begin() as s:
        row = {"run_id": run_id, "id": ep, "group_id": "g", "status": status, "created_at": created}
        await insert_episodes(s, [row])
        await insert_completions(s, calls, created)
        s.add(
            StoredResponse(
                id=f"resp-{run_id}-{ep}",
                run_id=run_id,
                completion_id=calls[0].id,
                items=[],
                response={},
                created_at=created,
            )
        )
        if reward is not None:
            at = reward_at or last_call
            s.add(Reward(run_id=run_id, episode_id=ep, value=reward, created_at=at))
            stored = await s.get_one(Episode, (run_id, ep))
            stored.reward, stored.rewarded_at = reward, at


async def stored(sessions, run_id: str) -> dict[str, tuple[str, int, int, int]]:
    """Episode id -> (status, completions, reward posts, responses) of every stored episode."""
    async with sessions() as s:
        eps = (
            await s.execute(select(Episode.id, Episode.status).where(Episode.run_id == run_id))
        ).all()
        out = {}
        for ep, status in eps:
            ids = select(Completion.id).where(
                Completion.run_id == run_id, Completion.episode_id == ep
            )
            n_calls = await s.scalar(select(func.count()).select_from(ids.subquery()))
            n_rewards = await s.scalar(
                select(func.count()).where(Reward.run_id == run_id, Reward.episode_id == ep)
            )
            n_responses = await s.scalar(
                select(func.count()).where(StoredResponse.completion_id.in_(ids))
            )
            out[ep] = (status, n_calls, n_rewards, n_responses)
    # nothing left behind by a deleted episode, anywhere in the run
    async with sessions() as s:
        for model, column in ((Completion, Completion.episode_id), (Reward, Reward.episode_id)):
            orphans = await s.scalar(
                select(func.count()).where(model.run_id == run_id, column.not_in(list(out) or [""]))
            )
            assert orphans == 0, model.__name__
        responses = await s.scalar(
            select(func.count()).where(
                StoredResponse.run_id == run_id,
                StoredResponse.completion_id.not_in(
                    select(Completion.id).where(Completion.run_id == run_id)
                ),
            )
        )
        assert responses == 0
    return out


async def add_training(sessions, run_id: str) -> set[str]:
    """Old training episodes of every final status (older than any evaluation one)."""
    names = set()
    for i, status in enumerate(TRAINING):
        name = f"train-{status}"
        await episode(sessions, run_id, name, OLD - timedelta(days=1, minutes=i), status=status)
        names.add(name)
    return names


async def test_the_newest_are_kept_the_rest_deleted_whole_training_untouched(
    sessions, monkeypatch
) -> None:
    monkeypatch.setattr(eval_retention, "CHUNK", 2)  # several transactions in one pass
    await make_run(sessions, "run_k", eval_keep_episodes=3)
    training = await add_training(sessions, "run_k")
    for i in range(8):  # e0 oldest ... e7 newest, by first call
        active = NOW - timedelta(seconds=60) if i == 0 else None  # e0: a call a minute ago
        await episode(
            sessions,
            "run_k",
            f"e{i}",
            OLD + timedelta(minutes=i),
            reward=float(i),
            last_call=active,
        )
    before = {f.version: f for f in await _figures(sessions, "run_k")}
    assert before[1].episodes == 8

    assert await prune_all(sessions, NOW) == 4

    after = await stored(sessions, "run_k")
    # the 3 newest, and e0: over the limit but still in conversation (QUIET_S)
    assert set(after) == training | {"e0", "e5", "e6", "e7"}
    for ep, (status, calls, rewards, responses) in after.items():
        assert (calls, rewards, responses) == (2, 1, 1), ep
        assert status == ("eval" if ep.startswith("e") else ep.removeprefix("train-"))
    (fig,) = await _figures(sessions, "run_k")
    assert (fig.episodes, fig.mean_reward) == (4, (0 + 5 + 6 + 7) / 4)
    assert await prune_all(sessions, NOW) == 0  # idempotent

    # once quiet, e0 goes too; a fresh pass keeps exactly the newest 3
    assert await prune_all(sessions, NOW + timedelta(seconds=eval_retention.QUIET_S)) == 1
    assert set(await stored(sessions, "run_k")) == training | {"e5", "e6", "e7"}


async def test_an_age_limit_deletes_the_quiet_ones_of_every_run(sessions) -> None:
    await make_run(sessions, "run_a", eval_retention_s=3600.0)
    await make_run(sessions, "run_b", status="stopped", eval_retention_s=3600.0)
    await make_run(sessions, "run_c")  # the defaults: 10000 kept, no age limit
    for run_id in ("run_a", "run_b", "run_c"):
        training = await add_training(sessions, run_id)
        await episode(sessions, run_id, "quiet", NOW - timedelta(hours=3))
        await episode(
            sessions,
            run_id,
            "late-call",
            NOW - timedelta(hours=3),
            last_call=NOW - timedelta(minutes=30),
        )
        await episode(
            sessions,
            run_id,
            "late-reward",
            NOW - timedelta(hours=3),
            reward_at=NOW - timedelta(minutes=5),
        )
        await episode(sessions, run_id, "unscored", NOW - timedelta(hours=2), reward=None)
        await episode(sessions, run_id, "fresh", NOW - timedelta(minutes=10))

    assert await prune_all(sessions, NOW) == 4  # quiet and unscored, of run_a and run_b

    for run_id in ("run_a", "run_b"):
        assert set(await stored(sessions, run_id)) == training | {
            "late-call",
            "late-reward",
            "fresh",
        }
    assert len(await stored(sessions, "run_c")) == len(training) + 5


async def test_the_leader_scheduler_runs_retention_and_a_follower_does_not(sessions) -> None:
    await make_run(sessions, "run_s", eval_keep_episodes=1)
    training = await add_training(sessions, "run_s")
    for i in range(3):
        await episode(sessions, "run_s", f"e{i}", OLD + timedelta(minutes=i))

    class Follower:
        is_leader = False

    follower = TrainingScheduler(sessions, celery=None, leader=Follower())  # type: ignore[arg-type]
    follower.eval_retention = EvalRetention(sessions, interval_s=0.0)
    await follower.schedule_once()
    assert len(await stored(sessions, "run_s")) == len(training) + 3

    leader = TrainingScheduler(sessions, celery=None)  # type: ignore[arg-type]
    assert await leader.eval_retention.maybe_prune() is None  # not due before one interval
    leader.eval_retention = EvalRetention(sessions, interval_s=3600.0)
    leader.eval_retention._next = 0.0  # due now, then not again for an hour
    await leader.schedule_once()
    assert set(await stored(sessions, "run_s")) == training | {"e2"}
    await episode(sessions, "run_s", "e3", OLD + timedelta(minutes=3))
    await leader.schedule_once()
    assert set(await stored(sessions, "run_s")) == training | {"e2", "e3"}  # not due yet


async def _figures(sessions, run_id: str):
    async with sessions() as s:
        return await eval_figures(s, run_id)
