"""Load for the fault suite: concurrent agents on the official `openai` client.

Each agent plays two-turn episodes (the second turn echoes the first answer,
so the gateway must find the first turn as its parent), streaming or not,
and rewards each episode. What the client received is recorded, so the test
can check it against the database afterwards.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field

import httpx
import openai


@dataclass
class Received:
    """What the clients got: answered completions and acknowledged rewards."""

    completions: set[str] = field(default_factory=set)
    turns: list[tuple[str, str]] = field(default_factory=list)  # (first turn id, second turn id)
    rewards: set[str] = field(default_factory=set)  # idempotency keys acknowledged
    errors: list[BaseException] = field(default_factory=list)
    streams_unfinished: int = 0
    stop: bool = False  # set by the test to end the load early


async def _turn(client: openai.AsyncOpenAI, model: str, messages: list, stream: bool, got):
    if not stream:
        resp = await client.chat.completions.create(model=model, messages=messages, max_tokens=6)
        return resp.id, resp.choices[0].message.content or ""
    chunks = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=6, stream=True
    )
    cid, text, finished = None, [], False
    async for chunk in chunks:
        cid = chunk.id
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finished = finished or choice.finish_reason is not None
    if not finished:  # the stream was cut: the client did not receive a whole answer
        got.streams_unfinished += 1
        raise RuntimeError("stream ended without a finish_reason")
    return cid, "".join(text)


async def agent(
    base_url: str,
    api_key: str,
    model: str,
    deadline: float,
    stream: bool,
    got: Received,
    http,
    retries: int = 0,
) -> None:
    client = openai.AsyncOpenAI(
        base_url=base_url, api_key=api_key, http_client=http, max_retries=retries, timeout=60
    )
    while time.monotonic() < deadline and not got.stop:
        task = f"task {uuid.uuid4().hex[:8]}"
        messages = [{"role": "user", "content": task}]
        try:
            first, answer = await _turn(client, model, messages, stream, got)
            got.completions.add(first)
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "?"}]
            second, _ = await _turn(client, model, messages, stream, got)
            got.completions.add(second)
            got.turns.append((first, second))
            key = "rw-" + uuid.uuid4().hex
            await client.post(
                "/rewards",
                body={"completion_id": second, "reward": 1.0, "idempotency_key": key},
                cast_to=object,
            )
            got.rewards.add(key)
        except (openai.APIError, RuntimeError, httpx.HTTPError) as exc:
            got.errors.append(exc)
            await asyncio.sleep(0.2)


async def run_agents(
    base_url: str,
    api_key: str,
    model: str,
    n: int,
    seconds: float,
    stream: bool,
    got: Received | None = None,
    retries: int = 0,
) -> Received:
    """`retries`: the SDK's own retries (its default is 2); 0 lets every error show."""
    got = got or Received()
    # Idle connections expire client-side before uvicorn's 5 s keep-alive closes them, so a
    # request is never sent on a connection the server is closing (a ReadError otherwise).
    limits = httpx.Limits(
        max_connections=n + 10, max_keepalive_connections=n + 10, keepalive_expiry=2.0
    )
    async with httpx.AsyncClient(limits=limits, timeout=60) as http:
        deadline = time.monotonic() + seconds
        await asyncio.gather(
            *(
                agent(base_url, api_key, model, deadline, stream, got, http, retries)
                for _ in range(n)
            )
        )
    return got


def warm_up(run: dict) -> None:
    """One call, so the model is loaded before the load (and the clock) starts."""
    client = openai.OpenAI(base_url=run["base_url"], api_key=run["api_key"], timeout=120)
    client.chat.completions.create(
        model=run["name"], messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )


def start_stub(
    port: int, latency_ms: int = 20, tokens: int = 8, token_latency_ms: int = 0, *extra: str
) -> subprocess.Popen:
    """The stand-in vLLM server (`inference.stub_server`) on `port`, once it answers;
    `extra` are more of its options."""
    cmd = [sys.executable, "-m", "inference.stub_server", "--flavor", "vllm", "--port", str(port)]
    cmd += ["--token-latency-ms", str(token_latency_ms), *extra]
    proc = subprocess.Popen(
        [*cmd, "--latency-ms", str(latency_ms), "--output-tokens", str(tokens)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the stub server did not start")
