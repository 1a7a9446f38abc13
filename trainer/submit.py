"""The trainer's submission API: all of the trainer that the gateway imports (with its config).

The gateway queues steps (`make_celery`, `submit_train_step`), asks whether a
run's engine can run on this machine (`engine_unavailable`) and shows what
advantages a group's episodes would get (`preview_advantages`). Nothing here
imports torch at module level: the gateway's import path stays free of it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from celery import Celery

from core.store.models import Completion, Episode
from core.store.status import EpisodeStatus
from trainer.celery_app import TRAIN_STEP_TASK, make_celery
from trainer.config import RunConfig
from trainer.engine_check import engine_unavailable

__all__ = [
    "AdvantagePreview",
    "engine_unavailable",
    "make_celery",
    "preview_advantages",
    "submit_train_step",
]

# Members that no step will train: their rewards leave the group's statistics.
_LEFT_OUT = (EpisodeStatus.DROPPED, EpisodeStatus.EXPIRED)


def submit_train_step(app: Celery, run_id: str, step: int) -> str:
    """Enqueue training step `step` of `run_id`; the task id is deterministic per (run, step).

    Blocking (broker I/O): call it off the event loop.
    """
    task_id = f"{run_id}-step-{step}"
    app.send_task(TRAIN_STEP_TASK, args=[run_id, step], task_id=task_id)
    return task_id


@dataclass(frozen=True)
class AdvantagePreview:
    """The return and advantage a step gives one episode of a group, and each of its turns."""

    episode_return: float | None  # None: no reward, or the episode was dropped or expired
    advantage: float | None  # of the episode's return within its peers
    peers: int  # returns it is normalised with, its own included; 0 without a return
    turn_returns: dict[str, float | None]  # completion id -> its return (None: not trained)
    turn_advantages: dict[str, float | None]  # completion id -> its advantage


def preview_advantages(
    cfg: RunConfig,
    episodes: Sequence[Episode],
    turns: dict[str, list[Completion]],
    reward_posts: dict[str, float],
) -> dict[str, AdvantagePreview]:
    """Per episode id, what the trainer's own functions give the group's members.

    `turns`: each episode's completions in creation order; `reward_posts`: its
    newest episode-level reward post, if any (what the trainer calls explicit).
    Returns follow `cfg.reward_policy` (`trainer.returns`), advantages
    `cfg.advantage_estimator` (`trainer.advantages.group_advantage`), so a view
    built on this cannot drift from what a step trains on.

    Who is normalised together: the trainer takes a group's statistics over the
    members that one step trains. A member that a step took (it has a
    `train_step`) is normalised with the members of that step; a member no step
    has taken yet with the other rewarded, untaken members, as the next step
    would if it took them all. A member without a reward has no return and no
    advantage; a cancelled turn is context, never trained: no return, no advantage.
    """
    from trainer.advantages import group_advantage  # imports torch: only when a group is asked
    from trainer.returns import Node, completion_returns, episode_return

    nodes = {
        ep.id: [Node(c.id, c.parent_id, c.reward) for c in turns.get(ep.id, [])] for ep in episodes
    }
    rewarded = [e for e in episodes if e.reward is not None and e.status not in _LEFT_OUT]
    returns = {
        e.id: episode_return(nodes[e.id], reward_posts.get(e.id), cfg.reward_policy, cfg.gamma)
        for e in rewarded
    }
    peers: dict[int | None, list[float]] = defaultdict(list)
    for e in rewarded:
        peers[e.train_step].append(returns[e.id])

    def advantage(value: float | None, ep: Episode) -> float | None:
        if value is None or ep.id not in returns:
            return None
        return group_advantage(value, peers[ep.train_step], cfg.advantage_estimator, cfg.adv_eps)

    out = {}
    for ep in episodes:
        g = completion_returns(nodes[ep.id], reward_posts.get(ep.id), cfg.reward_policy, cfg.gamma)
        trained = {
            c.id: None if c.finish_reason == "cancelled" else g.get(c.id)
            for c in turns.get(ep.id, [])
        }
        out[ep.id] = AdvantagePreview(
            episode_return=returns.get(ep.id),
            advantage=advantage(returns.get(ep.id), ep),
            peers=len(peers[ep.train_step]) if ep.id in returns else 0,
            turn_returns=trained,
            turn_advantages={cid: advantage(value, ep) for cid, value in trained.items()},
        )
    return out
