"""A key's daily token count is what the gateway stored for its calls, on every endpoint.

A real gateway with quotas on (real Redis). Each case uses a fresh run, so the
tokens stored for it are all of its completions' prompt and output token ids,
read back from the store; the key's `tokens_today` must equal their sum exactly.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.security._quota import key_id, quota, quota_gateway

pytestmark = pytest.mark.integration

MSGS = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def server(gateway_launcher, tmp_path_factory):
    yield from quota_gateway(gateway_launcher, tmp_path_factory, "usage")


def _stored_tokens(server, run: dict) -> int:
    rows = server.query(
        "SELECT prompt_token_ids, output_token_ids FROM completions WHERE run_id = ?",
        (run["run_id"],),
    )
    assert rows, "nothing was stored"
    return sum(len(np.frombuffer(p, "<i4")) + len(np.frombuffer(o, "<i4")) for p, o in rows)


def _call(server, run: dict, path: str, body: dict, headers: dict) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post(path, json=body, headers=headers)
        assert r.status_code == 200, r.text
        assert r.text  # a stream read to its end


@pytest.mark.parametrize(
    ("path", "body", "headers"),
    [
        (
            "/v1/responses",
            {"input": "hello there", "max_output_tokens": 6, "stream": True},
            {"Authorization": "Bearer {key}"},
        ),
        (
            "/v1/messages",
            {"messages": MSGS, "max_tokens": 6, "stream": True},
            {"x-api-key": "{key}", "anthropic-version": "2023-06-01"},
        ),
        (
            "/v1/chat/completions",
            {"messages": MSGS, "max_tokens": 6, "n": 2},
            {"Authorization": "Bearer {key}"},
        ),
    ],
    ids=["responses-stream", "messages-stream", "chat-n2"],
)
def test_tokens_counted_are_the_tokens_stored(server, path, body, headers) -> None:
    run = server.create_run(name="usage-" + path.rsplit("/", 1)[-1] + str(body.get("n", 1)))
    kid = key_id(server, run)
    headers = {k: v.format(key=run["api_key"]) for k, v in headers.items()}
    _call(server, run, path, {"model": run["name"], **body}, headers)
    stored = _stored_tokens(server, run)
    assert quota(server, run, kid)["tokens_today"] == stored
