"""A group's episodes side by side, with the advantages the trainer gives their turns.

The numbers come from the trainer's own functions (`trainer.returns` for the
returns under `RunConfig.reward_policy`, `trainer.advantages.group_advantage`
for the estimator), so the view cannot drift from what a step trains on.

Who is normalised together: the trainer takes a group's statistics over the
members that one step trains. So a member that a step took (it has a
`train_step`) is normalised with the members of the same step; a member no
step has taken yet is normalised with the other rewarded, untaken members, as
the next step would if it took them all. A member without a reward has no
return and no advantage. Cancelled turns are context, never trained: no advantage.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from core.store.models import Completion, Episode
from core.store.status import EpisodeStatus
from gateway.protocol_admin import EpisodeSummary, GroupMember, TurnAdvantage
from trainer.config import RunConfig

# Members that no step will train: their rewards leave the group's statistics.
_LEFT_OUT = (EpisodeStatus.DROPPED, EpisodeStatus.EXPIRED)


def group_members(
    cfg: RunConfig,
    episodes: list[Episode],
    summaries: dict[str, EpisodeSummary],
    turns: dict[str, list[Completion]],
    reward_posts: dict[str, float],
) -> list[GroupMember]:
    """One `GroupMember` per episode, in the order given.

    `turns`: each episode's completions in creation order; `reward_posts`: its
    newest episode-level reward post, if any (what the trainer calls explicit).
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

    out = []
    for ep in episodes:
        explicit = reward_posts.get(ep.id)
        g = completion_returns(nodes[ep.id], explicit, cfg.reward_policy, cfg.gamma)
        out.append(
            GroupMember(
                **summaries[ep.id].model_dump(),
                episode_return=returns.get(ep.id),
                advantage=advantage(returns.get(ep.id), ep),
                peers=len(peers[ep.train_step]) if ep.id in returns else 0,
                turns_detail=[_turn(c, g.get(c.id), ep, advantage) for c in turns.get(ep.id, [])],
            )
        )
    return out


def _turn(
    c: Completion,
    turn_return: float | None,
    ep: Episode,
    advantage: Callable[[float | None, Episode], float | None],
) -> TurnAdvantage:
    cancelled = c.finish_reason == "cancelled"
    return TurnAdvantage(
        completion_id=c.id,
        policy_version=c.policy_version,
        content=c.content,
        output_tokens=len(c.output_token_ids),
        finish_reason=c.finish_reason,
        reward=c.reward,
        turn_return=None if cancelled else turn_return,
        advantage=None if cancelled else advantage(turn_return, ep),
    )
