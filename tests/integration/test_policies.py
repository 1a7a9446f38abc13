"""Two policies in one run, one episode calling both, each trained on its own turns.

Real processes: a uvicorn gateway (local backend: one SmolLM2, one adapter per
policy), a Celery worker on Redis, PostgreSQL as the store; the real `openai`
client as the agent (tests/integration/policy_agents.py).

- Rewards scoped to the planner that favour answers away from its base greedy
  answer change the planner's greedy answer; the coder's greedy answer stays
  identical token for token and its version stays where it was.
- The same with the rewards swapped: the coder moves, the planner stays.
- Episode rewards (no policy named) train both: both versions move.
- Each trained turn of the coder was spliced onto the planner's sampled ids.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.policy_agents import Team, create_team, scoped_then_whole
from tests.integration.vllm_lora_stack import lora_gateway

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def team(
    redis_url: str, module_postgres_url: str, smollm2_cache: Path, tmp_path_factory
) -> Iterator[Team]:
    with lora_gateway(
        "policies", redis_url, module_postgres_url, smollm2_cache, tmp_path_factory
    ) as stack:
        yield create_team(stack, module_postgres_url)


def test_scoped_rewards_move_one_role_and_episode_rewards_move_both(team: Team) -> None:
    scoped_then_whole(team)


def test_the_coders_turns_were_spliced_onto_the_planners_ids(
    team: Team, module_postgres_url: str
) -> None:
    import psycopg

    with psycopg.connect(module_postgres_url) as conn:
        rows = conn.execute(
            "SELECT c.spliced, c.link, p.run_id <> c.run_id FROM completions c"
            " JOIN completions p ON p.id = c.parent_id"
            " JOIN runs r ON r.id = c.run_id WHERE r.policy = 'coder'"
        ).fetchall()
    assert rows, "no coder turn continued a planner turn"
    assert all(spliced and cross for spliced, _, cross in rows), rows[:5]
