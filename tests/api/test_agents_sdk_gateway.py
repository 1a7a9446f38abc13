"""agents_sdk against a real gateway (uvicorn, the tiny model): episodes, groups, rewards, retries.

The unit tests (tests/unit/test_agents_sdk.py) script the gateway's answers; these check
that the SDK and the server agree: the scoped URLs file calls under the right episode and
group, the acknowledgements parse, idempotency keys are honoured across the SDK's own
retries, and error bodies map to the SDK's exceptions. Lost connections come from a proxy
that breaks its first connection, either before the request reaches the gateway or after
the gateway has answered (the answer is lost, so the retry must be a duplicate).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import httpx
import pytest

from agents_sdk import (
    APIConnectionError,
    AsyncRLGate,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    NotFoundError,
    RLGate,
)
from rlgate.stack import free_port
from tests.faults.tcp_proxy import TcpProxy

pytestmark = pytest.mark.integration

USER = [{"role": "user", "content": "what is one plus two?"}]
SDK_DOC = Path(__file__).resolve().parents[2] / "docs" / "sdk.md"


class FlakyProxy(TcpProxy):
    """A TcpProxy whose first `failures` connections break.

    `when="before"`: reset on accept, so nothing reaches the gateway.
    `when="after"`: forward the request, reset the client as the gateway's reply starts,
    so the gateway did the work but the client never hears of it.
    """

    def __init__(self, target_port: int, when: Literal["before", "after"], failures: int = 1):
        super().__init__("127.0.0.1", target_port, free_port())
        self.when, self.failures = when, failures
        self.broken = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.broken >= self.failures:
            return await super()._handle(reader, writer)
        self.broken += 1
        if self.when == "before":
            writer.transport.abort()
            return
        up_reader, up_writer = await asyncio.open_connection(*self.target)

        async def forward() -> None:
            with contextlib.suppress(OSError):
                while data := await reader.read(65536):
                    up_writer.write(data)
                    await up_writer.drain()

        sending = asyncio.ensure_future(forward())
        await up_reader.read(1)  # the gateway has answered: it stored what it acknowledges
        sending.cancel()
        writer.transport.abort()
        up_writer.transport.abort()


@contextlib.contextmanager
def flaky(gateway_server, when: Literal["before", "after"]) -> Iterator[FlakyProxy]:
    port = int(gateway_server.url.rsplit(":", 1)[1])
    proxy = FlakyProxy(port, when).start()
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.fixture(scope="module")
def run(gateway_server) -> dict:
    return gateway_server.create_run(name="sdk-gateway")


def stored_rewards(gateway_server, key: str) -> list[tuple]:
    return gateway_server.query(
        "SELECT episode_id, completion_id, value FROM rewards WHERE idempotency_key = ?", (key,)
    )


def test_sync_group_files_calls_and_rewards_under_its_episodes(gateway_server, run) -> None:
    with RLGate(run["base_url"], run["api_key"]) as gate:
        group = gate.group("sdk-task-1")
        episodes = [group.episode() for _ in range(2)]
        for k, episode in enumerate(episodes):
            reply = episode.openai().chat.completions.create(
                model=run["name"], messages=USER, max_tokens=4, seed=k
            )
            assert reply.choices[0].message.content is not None
            stored = gateway_server.completion(reply.id)
            assert stored is not None and stored["episode_id"] == episode.id
            ack = episode.reward(float(k), idempotency_key=f"{episode.id}-reward")
            assert (ack.episode_id, ack.reward, ack.duplicate) == (episode.id, float(k), False)
            assert ack.episode_status == "rewarded"
            assert ack.progress is not None and ack.progress["group"]["id"] == group.id
    rows = gateway_server.query(
        "SELECT id, status, reward FROM episodes WHERE group_id = ? ORDER BY reward", (group.id,)
    )
    assert rows == [(episodes[0].id, "rewarded", 0.0), (episodes[1].id, "rewarded", 1.0)]


def test_evaluation_episodes_are_held_out_and_scored(gateway_server, run) -> None:
    with RLGate(run["base_url"], run["api_key"]) as gate:
        held = gate.evaluation(version=0)  # the current version, pinned
        reply = held.openai().chat.completions.create(
            model=run["name"], messages=USER, max_tokens=4
        )
        assert gateway_server.completion(reply.id)["episode_id"] == held.id
        ack = held.reward(0.5)
        assert (ack.episode_id, ack.episode_status) == (held.id, "eval")
    rows = gateway_server.query("SELECT status, reward FROM episodes WHERE id = ?", (held.id,))
    assert rows == [("eval", 0.5)]


def test_reward_completion_and_a_repeated_key_is_stored_once(gateway_server, run) -> None:
    with RLGate(run["base_url"], run["api_key"]) as gate:
        episode = gate.episode()
        reply = episode.openai().chat.completions.create(
            model=run["name"], messages=USER, max_tokens=4
        )
        key = f"{episode.id}-once"
        first = episode.reward_completion(reply.id, 0.5, idempotency_key=key)
        again = episode.reward_completion(reply.id, 0.5, idempotency_key=key)
        assert (first.completion_id, first.episode_id, first.duplicate) == (
            reply.id,
            episode.id,
            False,
        )
        assert again.duplicate and again.id == first.id
        with pytest.raises(ConflictError) as err:  # the same key with another value
            episode.reward_completion(reply.id, 0.7, idempotency_key=key)
        assert err.value.code == "idempotency_conflict"
    assert stored_rewards(gateway_server, key) == [(episode.id, reply.id, 0.5)]


def test_ids_that_need_escaping_arrive_as_given(gateway_server, run) -> None:
    with RLGate(run["base_url"], run["api_key"]) as gate:
        episode = gate.group("sdk group ü?#").episode("sdk episode 100% é&x=1")
        reply = episode.openai().chat.completions.create(
            model=run["name"], messages=USER, max_tokens=2
        )
        assert episode.reward(1.0).episode_id == episode.id
    assert gateway_server.completion(reply.id)["episode_id"] == "sdk episode 100% é&x=1"
    assert gateway_server.query(
        "SELECT group_id FROM episodes WHERE id = ?", ("sdk episode 100% é&x=1",)
    ) == [("sdk group ü?#",)]


@pytest.mark.parametrize(
    "value",
    ["plain", "emoji 🎲", "x" * 100, "x" * 101, "~reserved", "mid~tilde", "tab\there",
     "zero\u200bwidth", "nbsp\u00a0", "a/b", ".", "..", ""],
)  # fmt: skip
def test_the_sdk_refuses_exactly_the_ids_the_gateway_refuses(gateway_server, run, value) -> None:
    try:
        RLGate(run["base_url"], run["api_key"]).group(value)
    except ValueError:
        sdk_accepts = False
    else:
        sdk_accepts = True
    # `metadata` carries any string to the gateway's one id rule, unlike a path or a header.
    reply = httpx.post(
        run["base_url"] + "/chat/completions",
        json={
            "model": run["name"],
            "messages": USER,
            "max_tokens": 1,
            "metadata": {"episode_id": f"sdk-parity-{len(value)}", "group_id": value},
        },
        headers={"Authorization": f"Bearer {run['api_key']}"},
        timeout=60,
    )
    assert reply.status_code in (200, 400), reply.text
    assert sdk_accepts == (reply.status_code == 200), reply.text


def test_gateway_errors_map_to_sdk_exceptions(gateway_server, run) -> None:
    with RLGate(run["base_url"], run["api_key"], max_retries=0) as gate:
        with pytest.raises(NotFoundError) as missing:
            gate.episode("sdk-never-called").reward(1.0)
        assert missing.value.param == "episode_id"
        with pytest.raises(NotFoundError):
            gate.reward(1.0, completion_id="chatcmpl-does-not-exist")
    with (
        RLGate(run["base_url"], "rlg-wrong-key", max_retries=0) as gate,
        pytest.raises(AuthenticationError),
    ):
        gate.reward(1.0, episode_id="sdk-anything")
    bounded = gateway_server.create_run(name="sdk-bounded", config={"reward_max": 1.0})
    with RLGate(bounded["base_url"], bounded["api_key"]) as gate:
        episode = gate.episode()
        episode.openai().chat.completions.create(model=bounded["name"], messages=USER, max_tokens=2)
        with pytest.raises(BadRequestError) as bad:  # 422, not retried
            episode.reward(2.0)
        assert bad.value.status == 422 and bad.value.code == "reward_out_of_bounds"


@pytest.mark.parametrize("when", ["before", "after"])
def test_sync_reward_retries_a_broken_connection_and_is_stored_once(
    gateway_server, run, when
) -> None:
    with RLGate(run["base_url"], run["api_key"]) as direct:
        episode = direct.episode()
        episode.openai().chat.completions.create(model=run["name"], messages=USER, max_tokens=2)
    key = f"{episode.id}-retried"
    with (
        flaky(gateway_server, when) as proxy,
        RLGate(proxy.url + "/v1", run["api_key"], backoff=0.01) as gate,
    ):
        ack = gate.reward(1.0, episode_id=episode.id, idempotency_key=key)
        assert (proxy.broken, proxy.connections) == (1, 1)  # one broken, one retry
    # The lost answer's retry finds the reward already stored: a duplicate, not a second row.
    assert ack.duplicate is (when == "after")
    assert ack.episode_status == "rewarded"
    assert stored_rewards(gateway_server, key) == [(episode.id, None, 1.0)]


def test_retries_run_out_on_a_gateway_that_stays_away(gateway_server, run) -> None:
    with flaky(gateway_server, "before") as proxy:
        proxy.cut()  # nothing listens: every attempt is refused
        gate = RLGate(proxy.url, run["api_key"], max_retries=2, backoff=0.01)
        with gate, pytest.raises(APIConnectionError):
            gate.reward(1.0, episode_id="sdk-unreachable", idempotency_key="sdk-unreachable")
    assert stored_rewards(gateway_server, "sdk-unreachable") == []


async def test_async_group_concurrent_episodes_and_a_lost_answer(gateway_server, run) -> None:
    async with AsyncRLGate(run["base_url"], run["api_key"]) as gate:
        group = gate.group()

        async def attempt(k: int) -> tuple[str, str]:
            episode = group.episode()
            async with episode.openai() as client:
                reply = await client.chat.completions.create(
                    model=run["name"], messages=USER, max_tokens=4, seed=k
                )
            await episode.reward(float(k % 2), idempotency_key=f"{episode.id}-r")
            return episode.id, reply.id

        attempts = await asyncio.gather(*(attempt(k) for k in range(3)))
    for episode_id, completion_id in attempts:
        assert gateway_server.completion(completion_id)["episode_id"] == episode_id
    statuses = gateway_server.query("SELECT status FROM episodes WHERE group_id = ?", (group.id,))
    assert sorted(statuses) == [("rewarded",)] * 3

    episode_id, key = attempts[0][0], f"{attempts[0][0]}-again"
    with flaky(gateway_server, "after") as proxy:
        async with AsyncRLGate(proxy.url, run["api_key"], backoff=0.01) as flaky_gate:
            ack = await flaky_gate.episode(episode_id, group.id).reward(0.0, idempotency_key=key)
    assert ack.duplicate and proxy.broken == 1
    assert stored_rewards(gateway_server, key) == [(episode_id, None, 0.0)]


def doc_examples() -> list[str]:
    """The python blocks of docs/sdk.md that run against a gateway (they read RLGATE_BASE_URL)."""
    blocks = re.findall(r"```python\n(.*?)```", SDK_DOC.read_text(), flags=re.S)
    return [b for b in blocks if "RLGATE_BASE_URL" in b]


@pytest.mark.parametrize("index", [0, 1], ids=["sync", "async"])
def test_the_docs_examples_run(gateway_server, run, index) -> None:
    examples = doc_examples()
    assert len(examples) == 2, "docs/sdk.md has a sync and an async runnable example"
    env = dict(
        os.environ,
        RLGATE_BASE_URL=run["base_url"],
        RLGATE_API_KEY=run["api_key"],
        RLGATE_MODEL=run["name"],
    )
    out = subprocess.run(
        [sys.executable, "-c", examples[index]],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    printed = out.stdout.strip().splitlines()
    if index == 0:
        assert len(printed) == 4 and all(" rewarded " in line for line in printed), printed
    else:
        assert len(printed) == 1 and printed[0].startswith("["), printed
