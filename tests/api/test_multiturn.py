"""Multi-turn episodes: the design's token-exact splice and prefix linking (design.md, flow 3).

Both are specified but not implemented yet; these tests pin the expected behaviour.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from inference.chat_template import ChatTemplate

if TYPE_CHECKING:
    from tests.conftest import GatewayServer

pytestmark = pytest.mark.integration

FIRST = [{"role": "user", "content": "what is one plus two?"}]


@pytest.fixture(scope="module")
def run(gateway_server: GatewayServer) -> dict:
    return gateway_server.create_run(name="multi-turn")


@pytest.fixture(scope="module")
def http(gateway_server: GatewayServer, run: dict) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {run['api_key']}"}
    with httpx.Client(base_url=gateway_server.url, headers=headers, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def template(tiny_model_dir: Path) -> ChatTemplate:
    return ChatTemplate(tiny_model_dir)


def _post(http: httpx.Client, run: dict, messages: list, headers=None, **fields) -> dict:
    body = {"model": run["name"], "messages": messages, "max_tokens": 12, **fields}
    resp = http.post("/v1/chat/completions", json=body, headers=headers or {})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_explicit_episode_id_files_both_turns_together(
    http: httpx.Client, run: dict, gateway_server: GatewayServer
) -> None:
    headers = {"X-Episode-Id": "mt-explicit", "X-Group-Id": "task-1"}
    one = _post(http, run, FIRST, headers)
    second = [*FIRST, {"role": "assistant", "content": one["choices"][0]["message"]["content"]}]
    two = _post(http, run, [*second, {"role": "user", "content": "and?"}], headers)
    assert one["episode_id"] == two["episode_id"] == "mt-explicit"
    rows = gateway_server.query("SELECT group_id, status FROM episodes WHERE id = 'mt-explicit'")
    assert rows == [("task-1", "open")]
    assert gateway_server.query(
        "SELECT COUNT(*) FROM completions WHERE episode_id = 'mt-explicit'"
    ) == [(2,)]


def test_own_assistant_turn_is_spliced_back_as_sampled_ids(
    http: httpx.Client, run: dict, gateway_server: GatewayServer, template: ChatTemplate
) -> None:
    headers = {"X-Episode-Id": "mt-splice"}
    # A seeded sample of the tiny model (built from a fixed seed): the same ids on every run.
    one = _post(http, run, FIRST, headers, temperature=1.0, seed=1)
    first = gateway_server.completion(one["id"])
    p1, o1 = first["prompt_token_ids"], first["output_token_ids"]
    core = o1[:-1] if o1[-1] in template.stop_token_ids else o1
    history = [*FIRST, {"role": "assistant", "content": one["choices"][0]["message"]["content"]}]
    follow = [*history, {"role": "user", "content": "and?"}]
    # Re-tokenizing this sample's text gives other ids, so only a splice passes the checks below.
    assert template.render(follow)[len(p1) : len(p1) + len(core)] != core
    two = _post(http, run, follow, headers)
    p2 = gateway_server.completion(two["id"])["prompt_token_ids"]
    assert p2[: len(p1)] == p1
    assert p2[len(p1) : len(p1) + len(core)] == core


def test_continuation_is_linked_by_message_prefix(
    http: httpx.Client, run: dict, gateway_server: GatewayServer
) -> None:
    one = _post(http, run, [{"role": "user", "content": "a river runs past the garden"}])
    content = one["choices"][0]["message"]["content"]
    two = _post(
        http,
        run,
        [
            {"role": "user", "content": "a river runs past the garden"},
            {"role": "assistant", "content": content},
            {"role": "user", "content": "near the silver forest?"},
        ],
    )
    assert two["episode_id"] == one["episode_id"]
    assert gateway_server.completion(two["id"])["parent_id"] == one["id"]
