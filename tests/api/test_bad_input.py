"""Bad input against a real gateway: OpenAI-shaped 4xx errors, never a 5xx, never a write.

Every bad call is wrapped in `no_writes`, which reads the gateway's SQLite file
before and after the call: a rejected request must leave the store untouched.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest

from inference.chat_template import ChatTemplate

if TYPE_CHECKING:
    from tests.conftest import GatewayServer

pytestmark = pytest.mark.integration

WATCHED = ("runs", "api_keys", "episodes", "completions", "rewards", "train_steps")
USER = [{"role": "user", "content": "what is one plus two?"}]
JSON = {"Content-Type": "application/json"}


# --- fixtures and helpers -------------------------------------------------------------


@pytest.fixture(scope="module")
def run(gateway_server: GatewayServer) -> dict:
    return gateway_server.create_run(name="bad-input")


@pytest.fixture(scope="module")
def other_run(gateway_server: GatewayServer) -> dict:
    return gateway_server.create_run(name="someone-else")


@pytest.fixture(scope="module")
def oai(run: dict) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=run["base_url"], api_key=run["api_key"], max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def http(gateway_server: GatewayServer, run: dict) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {run['api_key']}"}
    with httpx.Client(base_url=gateway_server.url, headers=headers, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def template(tiny_model_dir: Path) -> ChatTemplate:
    return ChatTemplate(tiny_model_dir)


def _chat(http: httpx.Client, run: dict, **fields: Any) -> dict:
    body = {"model": run["name"], "messages": USER, "max_tokens": 4, **fields}
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.fixture
def completion(http: httpx.Client, run: dict) -> dict:
    """A fresh, unrewarded completion of `run`."""
    return _chat(http, run)


@contextlib.contextmanager
def no_writes(server: GatewayServer) -> Iterator[None]:
    before = {t: server.count(t) for t in WATCHED}
    yield
    assert {t: server.count(t) for t in WATCHED} == before, "a rejected call wrote to the store"


def assert_error(
    resp: httpx.Response,
    status: int,
    *,
    type: str | None = None,
    param: Any = ...,
    code: Any = ...,
) -> dict:
    """The body is exactly OpenAI's {"error": {"message", "type", "param", "code"}}."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert err["param"] is None or isinstance(err["param"], str)
    assert err["code"] is None or isinstance(err["code"], str)
    if type is not None:
        assert err["type"] == type, err
    if param is not ...:
        assert err["param"] == param, err
    if code is not ...:
        assert err["code"] == code, err
    return err


def assert_openai_error(exc: openai.APIStatusError, status: int, **kw: Any) -> dict:
    return assert_error(exc.response, status, **kw)  # type: ignore[arg-type]


def _stored_reward(server: GatewayServer, completion_id: str) -> float | None:
    return server.query("SELECT reward FROM completions WHERE id = ?", (completion_id,))[0][0]


# --- the happy path, checked against the store ------------------------------------------


def test_chat_completion_is_stored_token_exact(
    oai: openai.OpenAI, run: dict, gateway_server: GatewayServer, template: ChatTemplate
) -> None:
    messages = [
        {"role": "system", "content": "reply with only the number."},
        {"role": "user", "content": "what is one plus two?"},
    ]
    n_before = gateway_server.count("completions")
    resp = oai.chat.completions.create(
        model=run["name"], messages=messages, max_tokens=16, temperature=0.8, seed=3, logprobs=True
    )
    content = resp.choices[0].message.content
    assert isinstance(content, str)
    assert resp.id.startswith("chatcmpl-")
    assert gateway_server.count("completions") == n_before + 1

    row = gateway_server.completion(resp.id)
    assert row is not None
    prompt_ids, out_ids, lps = (
        row["prompt_token_ids"],
        row["output_token_ids"],
        row["output_logprobs"],
    )
    stored_content, version, finish = row["content"], row["policy_version"], row["finish_reason"]
    temp, run_id, episode_id = row["temperature"], row["run_id"], row["episode_id"]

    assert prompt_ids == template.render(messages)
    assert 1 <= len(out_ids) <= 16
    assert len(lps) == len(out_ids)
    assert template.decode(out_ids) == content == stored_content
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.completion_tokens == len(out_ids)
    assert resp.usage.total_tokens == len(prompt_ids) + len(out_ids)
    assert [t.logprob for t in resp.choices[0].logprobs.content] == pytest.approx(lps, abs=1e-6)

    stopped = out_ids[-1] in template.stop_token_ids
    assert finish == ("stop" if stopped else "length")
    assert resp.choices[0].finish_reason == finish
    assert temp == 0.8 and run_id == run["run_id"]
    assert version == 0
    assert resp.system_fingerprint is not None
    assert resp.system_fingerprint.endswith(f"-v{version}")
    assert run["run_id"] in resp.system_fingerprint
    assert resp.model_extra["policy_version"] == version
    assert resp.model_extra["episode_id"] == episode_id
    status = gateway_server.query(
        "SELECT status FROM episodes WHERE run_id = ? AND id = ?", (run_id, episode_id)
    )
    assert status == [("open",)]


# --- malformed requests ---------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/rewards"])
@pytest.mark.parametrize(
    "raw", [b'{"model": "bad-input", "messages": [', b"not json at all", b'{"reward": 1,}']
)
def test_malformed_json_is_400(
    http: httpx.Client, gateway_server: GatewayServer, path: str, raw: bytes
) -> None:
    with no_writes(gateway_server):
        resp = http.post(path, content=raw, headers=JSON)
    assert_error(resp, 400, type="invalid_request_error", code="invalid_json")


def test_body_that_is_not_an_object_is_400(
    http: httpx.Client, gateway_server: GatewayServer
) -> None:
    with no_writes(gateway_server):
        for body in ([1, 2], "text", 3, None):
            assert_error(http.post("/v1/chat/completions", json=body), 400)
            assert_error(http.post("/v1/rewards", json=body), 400)


# --- authentication and isolation -----------------------------------------------------------


@pytest.mark.parametrize("auth", [None, "", "Bearer", "bearer", "Basic dXNlcjpwYXNz"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/rewards", "/v1/models"])
def test_missing_key_is_401(
    gateway_server: GatewayServer, run: dict, auth: str | None, path: str
) -> None:
    headers = {} if auth is None else {"Authorization": auth}
    body = {"model": run["name"], "messages": USER, "max_tokens": 2}
    with no_writes(gateway_server):
        if path == "/v1/models":
            resp = httpx.get(gateway_server.url + path, headers=headers)
        else:
            resp = httpx.post(gateway_server.url + path, json=body, headers=headers)
    assert_error(resp, 401, type="authentication_error", code="missing_api_key")


def test_unknown_key_is_401(run: dict, gateway_server: GatewayServer) -> None:
    with (
        no_writes(gateway_server),
        openai.OpenAI(base_url=run["base_url"], api_key="rlg-unknown", max_retries=0) as c,
    ):
        with pytest.raises(openai.AuthenticationError) as exc:
            c.chat.completions.create(model=run["name"], messages=USER, max_tokens=2)
        assert exc.value.status_code == 401
        assert_openai_error(exc.value, 401, type="authentication_error", code="invalid_api_key")
        with pytest.raises(openai.AuthenticationError):
            c.models.list()
        resp = httpx.post(
            gateway_server.url + "/v1/rewards",
            json={"reward": 1.0, "episode_id": "x"},
            headers={"Authorization": "Bearer " + run["api_key"] + "x"},
        )
    assert_error(resp, 401, code="invalid_api_key")


def test_agent_key_on_admin_endpoints_is_401(gateway_server: GatewayServer, run: dict) -> None:
    agent = {"Authorization": f"Bearer {run['api_key']}"}
    base = gateway_server.url + "/admin/v1"
    with no_writes(gateway_server):
        calls = [
            httpx.get(base + "/runs", headers=agent),
            httpx.get(base + f"/runs/{run['run_id']}", headers=agent),
            httpx.get(base + f"/runs/{run['run_id']}/steps", headers=agent),
            httpx.post(base + "/runs", json={"name": "x", "model": "tiny"}, headers=agent),
            httpx.post(base + "/runs", json={"name": "x", "model": "tiny"}),
        ]
    for resp in calls:
        assert_error(resp, 401, type="authentication_error")
    assert calls[0].json()["error"]["code"] == "invalid_admin_key"
    # and the admin key is not an agent key
    with (
        no_writes(gateway_server),
        openai.OpenAI(
            base_url=run["base_url"], api_key=gateway_server.admin_key, max_retries=0
        ) as c,
        pytest.raises(openai.AuthenticationError),
    ):
        c.chat.completions.create(model=run["name"], messages=USER, max_tokens=2)


def test_admin_key_is_accepted(gateway_server: GatewayServer, run: dict) -> None:
    resp = httpx.get(
        gateway_server.url + f"/admin/v1/runs/{run['run_id']}",
        headers=gateway_server.admin_headers(),
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["run_id"] == run["run_id"]
    assert "api_key" not in resp.json()


def test_wrong_model_name_is_404(
    oai: openai.OpenAI, run: dict, other_run: dict, gateway_server: GatewayServer
) -> None:
    with no_writes(gateway_server):
        for model in ("gpt-4o", other_run["name"], other_run["run_id"], ""):
            with pytest.raises(openai.NotFoundError) as exc:
                oai.chat.completions.create(model=model, messages=USER, max_tokens=2)
            assert_openai_error(
                exc.value, 404, type="not_found_error", param="model", code="model_not_found"
            )


def test_models_lists_only_the_callers_run(oai: openai.OpenAI, run: dict) -> None:
    assert [m.id for m in oai.models.list()] == [run["name"]]


# --- rewards --------------------------------------------------------------------------------


def test_reward_for_unknown_target_is_404(
    http: httpx.Client, gateway_server: GatewayServer
) -> None:
    with no_writes(gateway_server):
        resp = http.post("/v1/rewards", json={"reward": 1.0, "completion_id": "chatcmpl-nope"})
        assert_error(resp, 404, type="not_found_error", param="completion_id")
        resp = http.post("/v1/rewards", json={"reward": 1.0, "episode_id": "ep-nope"})
        assert_error(resp, 404, type="not_found_error", param="episode_id")


def test_reward_for_another_runs_completion_is_404(
    http: httpx.Client, gateway_server: GatewayServer, other_run: dict
) -> None:
    theirs = httpx.post(
        gateway_server.url + "/v1/chat/completions",
        json={"model": other_run["name"], "messages": USER, "max_tokens": 2},
        headers={"Authorization": f"Bearer {other_run['api_key']}"},
        timeout=60,
    ).json()
    with no_writes(gateway_server):
        resp = http.post("/v1/rewards", json={"reward": 1.0, "completion_id": theirs["id"]})
        assert_error(resp, 404, param="completion_id")
        resp = http.post("/v1/rewards", json={"reward": 1.0, "episode_id": theirs["episode_id"]})
        assert_error(resp, 404, param="episode_id")
    assert _stored_reward(gateway_server, theirs["id"]) is None


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"])
@pytest.mark.parametrize("target", ["completion_id", "episode_id"])
def test_non_finite_reward_is_rejected(
    http: httpx.Client, gateway_server: GatewayServer, completion: dict, token: str, target: str
) -> None:
    value = completion["id"] if target == "completion_id" else completion["episode_id"]
    raw = f'{{"reward": {token}, "{target}": "{value}"}}'
    with no_writes(gateway_server):
        resp = http.post("/v1/rewards", content=raw, headers=JSON)
    # well-formed JSON with an unusable value: 422, as for rewards outside a run's bounds
    err = assert_error(resp, 422, type="invalid_request_error")
    assert err["param"] == "reward"
    assert _stored_reward(gateway_server, completion["id"]) is None
    episode = gateway_server.query(
        "SELECT status, reward FROM episodes WHERE id = ?", (completion["episode_id"],)
    )
    assert episode == [("open", None)]


@pytest.mark.parametrize("value", ["one", None, [1.0], {"v": 1}])
def test_reward_of_the_wrong_type_is_rejected(
    http: httpx.Client, gateway_server: GatewayServer, completion: dict, value: Any
) -> None:
    body = {"reward": value, "completion_id": completion["id"]}
    with no_writes(gateway_server):
        resp = http.post("/v1/rewards", json=body)
    assert_error(resp, 400, param="reward")


def test_reward_needs_exactly_one_target(
    http: httpx.Client, gateway_server: GatewayServer, completion: dict
) -> None:
    both = {
        "reward": 1.0,
        "completion_id": completion["id"],
        "episode_id": completion["episode_id"],
    }
    with no_writes(gateway_server):
        assert_error(http.post("/v1/rewards", json=both), 400, type="invalid_request_error")
        assert_error(http.post("/v1/rewards", json={"reward": 1.0}), 400)
        nulls = {"reward": 1.0, "completion_id": None, "episode_id": None}
        assert_error(http.post("/v1/rewards", json=nulls), 400)
        extra = {"reward": 1.0, "completion_id": completion["id"], "bonus": 2}
        assert_error(http.post("/v1/rewards", json=extra), 400)
    assert _stored_reward(gateway_server, completion["id"]) is None


def test_idempotency_key_reuse(
    http: httpx.Client, gateway_server: GatewayServer, completion: dict
) -> None:
    body = {"reward": 0.75, "completion_id": completion["id"], "idempotency_key": "retry-me"}
    n_rewards = gateway_server.count("rewards")
    first = http.post("/v1/rewards", json=body)
    assert first.status_code == 200, first.text
    assert first.json()["duplicate"] is False
    assert gateway_server.count("rewards") == n_rewards + 1

    with no_writes(gateway_server):
        again = http.post("/v1/rewards", json=body)
        assert again.status_code == 200, again.text
        assert again.json()["id"] == first.json()["id"]
        assert again.json()["duplicate"] is True
        assert again.json()["reward"] == 0.75

        changed = http.post("/v1/rewards", json={**body, "reward": 0.5})
        assert_error(
            changed,
            409,
            type="conflict_error",
            param="idempotency_key",
            code="idempotency_conflict",
        )
        elsewhere = {"reward": 0.75, "episode_id": "ep-other", "idempotency_key": "retry-me"}
        assert_error(http.post("/v1/rewards", json=elsewhere), 409, code="idempotency_conflict")
    assert _stored_reward(gateway_server, completion["id"]) == 0.75


# --- chat parameters --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "file", "file": {"file_id": "file-1"}},
        {"text": "no type at all"},
    ],
)
def test_unsupported_content_part_is_400(
    oai: openai.OpenAI, run: dict, gateway_server: GatewayServer, part: dict
) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "look:"}, part]}]
    with no_writes(gateway_server), pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model=run["name"], messages=messages, max_tokens=2)
    assert_openai_error(exc.value, 400, type="invalid_request_error", param="messages")


def test_text_content_parts_are_accepted(oai: openai.OpenAI, run: dict) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    resp = oai.chat.completions.create(model=run["name"], messages=messages, max_tokens=2)
    assert resp.usage.completion_tokens >= 1


def test_oversize_body_is_413(http: httpx.Client, gateway_server: GatewayServer, run: dict) -> None:
    limit = gateway_server.settings.max_body_bytes
    body = {"model": run["name"], "messages": [{"role": "user", "content": "a" * limit}]}
    raw = json.dumps(body).encode()
    assert len(raw) > limit
    with no_writes(gateway_server):
        resp = http.post("/v1/chat/completions", content=raw, headers=JSON)
        assert_error(resp, 413)
        resp = http.post("/v1/rewards", content=raw, headers=JSON)
        assert_error(resp, 413)


def test_oversize_chunked_body_is_413(
    http: httpx.Client, gateway_server: GatewayServer, run: dict
) -> None:
    limit = gateway_server.settings.max_body_bytes
    raw = json.dumps({"model": "nope", "messages": USER, "pad": "a" * limit}).encode()

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(raw), 65536):
            yield raw[i : i + 65536]

    with no_writes(gateway_server):
        resp = http.post("/v1/chat/completions", content=chunks(), headers=JSON)
    assert "content-length" not in {k.lower() for k in resp.request.headers}
    assert_error(resp, 413)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 2.5),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("n", 17),
        ("max_tokens", 0),
        ("max_completion_tokens", -3),
        ("top_logprobs", 21),
    ],
)
def test_out_of_range_parameter_is_400_naming_it(
    oai: openai.OpenAI, run: dict, gateway_server: GatewayServer, field: str, value: Any
) -> None:
    with no_writes(gateway_server), pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(
            model=run["name"], messages=USER, **{"max_tokens": 2, field: value}
        )
    assert_openai_error(exc.value, 400, type="invalid_request_error", param=field)


@pytest.mark.parametrize("token", ["NaN", "Infinity", "1e999"])
def test_non_finite_temperature_is_400(
    http: httpx.Client, gateway_server: GatewayServer, run: dict, token: str
) -> None:
    raw = (
        f'{{"model": "{run["name"]}", "messages": {json.dumps(USER)}, '
        f'"max_tokens": 2, "temperature": {token}}}'
    )
    with no_writes(gateway_server):
        resp = http.post("/v1/chat/completions", content=raw, headers=JSON)
    assert_error(resp, 400, param="temperature")


def test_bad_messages_are_400(http: httpx.Client, gateway_server: GatewayServer, run: dict) -> None:
    bad = [
        [],
        [{"role": "wizard", "content": "hi"}],
        [{"content": "hi"}],
        [{"role": "user", "content": 5}],
        "hello",
    ]
    with no_writes(gateway_server):
        for messages in bad:
            resp = http.post(
                "/v1/chat/completions",
                json={"model": run["name"], "messages": messages, "max_tokens": 2},
            )
            err = assert_error(resp, 400, type="invalid_request_error")
            assert err["param"] is not None and err["param"].startswith("messages"), err


def test_streaming_with_several_choices_is_refused_cleanly(
    oai: openai.OpenAI, run: dict, gateway_server: GatewayServer
) -> None:
    with no_writes(gateway_server), pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(
            model=run["name"], messages=USER, max_tokens=2, stream=True, n=2
        )
    assert exc.value.param == "n"


def test_bad_stream_request_errors_before_the_stream_starts(
    http: httpx.Client, run: dict, gateway_server: GatewayServer
) -> None:
    # client errors of a streaming call come as a plain JSON error, not as an SSE body
    with no_writes(gateway_server):
        resp = http.post(
            "/v1/chat/completions",
            json={"model": run["name"], "messages": USER, "stream": True, "max_tokens": 10**9},
        )
    err = assert_error(resp, 400)
    assert err["code"] == "context_length_exceeded"


@pytest.mark.parametrize("max_tokens", [1024, 5000, 10**9])
def test_max_tokens_beyond_context_is_400(
    oai: openai.OpenAI, run: dict, gateway_server: GatewayServer, max_tokens: int
) -> None:
    with no_writes(gateway_server), pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model=run["name"], messages=USER, max_tokens=max_tokens)
    assert_openai_error(exc.value, 400, code="context_length_exceeded")


def test_prompt_beyond_context_is_400(
    oai: openai.OpenAI, run: dict, gateway_server: GatewayServer
) -> None:
    long = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog. " * 200}]
    with no_writes(gateway_server), pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model=run["name"], messages=long, max_tokens=1)
    assert_openai_error(exc.value, 400, code="context_length_exceeded")


@pytest.mark.parametrize("temperature", [1e-45, 5e-324])
def test_subnormal_temperature_is_not_a_5xx(
    http: httpx.Client, gateway_server: GatewayServer, run: dict, temperature: float
) -> None:
    body = {"model": run["name"], "messages": USER, "max_tokens": 2, "temperature": temperature}
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code < 500, resp.text


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_out_of_range_seed_is_a_4xx(
    http: httpx.Client, gateway_server: GatewayServer, run: dict, seed: int
) -> None:
    body = {"model": run["name"], "messages": USER, "max_tokens": 2, "seed": seed}
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code < 500, resp.text


def test_seed_at_the_edges_of_the_range_works(http: httpx.Client, run: dict) -> None:
    for seed in (0, -(2**63), 2**64 - 1):
        a = _chat(http, run, seed=seed, temperature=1.0)
        b = _chat(http, run, seed=seed, temperature=1.0)
        assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]


def test_unknown_fields_are_accepted(http: httpx.Client, run: dict) -> None:
    out = _chat(http, run, parallel_tool_calls=False, service_tier="auto", store=True, stop=["x"])
    assert out["object"] == "chat.completion"
    assert math.isfinite(out["usage"]["total_tokens"])


@pytest.mark.parametrize(
    ("method", "action"), [("POST", "revoke"), ("POST", "rotate"), ("PUT", "limits")]
)
def test_a_key_id_past_32_bits_is_400_not_500(
    gateway_server: GatewayServer, run, method: str, action: str
) -> None:
    """Found by the schema fuzzer: the id reached the database and overflowed its column."""
    url = f"{gateway_server.url}/admin/v1/runs/{run['run_id']}/keys/80063312531970064384/{action}"
    resp = httpx.request(method, url, headers=gateway_server.admin_headers(), json={}, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "key_id"
