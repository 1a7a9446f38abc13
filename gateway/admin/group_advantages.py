"""A group's episodes side by side, with the advantages the trainer gives their turns.

The numbers come from the trainer's submission API (`trainer.submit.preview_advantages`,
which calls the trainer's own returns and estimator), so the view cannot drift from
what a step trains on; who is normalised with whom is stated there.
"""

from __future__ import annotations

from core.store.models import Completion, Episode
from gateway.protocol_admin import EpisodeSummary, GroupMember, TurnAdvantage
from trainer.config import RunConfig
from trainer.submit import AdvantagePreview, preview_advantages


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
    previews = preview_advantages(cfg, episodes, turns, reward_posts)
    return [
        GroupMember(
            **summaries[ep.id].model_dump(),
            episode_return=previews[ep.id].episode_return,
            advantage=previews[ep.id].advantage,
            peers=previews[ep.id].peers,
            turns_detail=[_turn(c, previews[ep.id]) for c in turns.get(ep.id, [])],
        )
        for ep in episodes
    ]


def _turn(c: Completion, preview: AdvantagePreview) -> TurnAdvantage:
    return TurnAdvantage(
        completion_id=c.id,
        policy_version=c.policy_version,
        content=c.content,
        output_tokens=len(c.output_token_ids),
        finish_reason=c.finish_reason,
        reward=c.reward,
        turn_return=preview.turn_returns.get(c.id),
        advantage=preview.turn_advantages.get(c.id),
    )
