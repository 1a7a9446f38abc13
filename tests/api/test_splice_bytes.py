"""Issue #22 (2): answers whose sampled ids do not survive a trip through text still splice.

A byte token cut from its character (a CJK character or an emoji cut by
`max_tokens`), an invalid UTF-8 byte, a NUL (sent as U+FFFD) or a special
token sampled mid-answer decode to text that re-encodes to other ids. The
agent echoes exactly the text rlgate sent; the next turn must continue the
exact sampled ids (spliced, no drift) on the local backend and on the vLLM
client (against the stand-in vLLM server, which answers with chosen ids).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from inference.chat_template import ChatTemplate
from inference.stub_server import launch
from rlgate.stack import free_port, stop, wait_healthy
from tests.forced_tokens import (
    FIRST,
    assert_spliced,
    byte_id,
    byte_model,
    byte_script,
    play,
    play_responses,
)

if TYPE_CHECKING:
    from tests.conftest import GatewayServer

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def template(tiny_model_dir: Path) -> ChatTemplate:
    return ChatTemplate(tiny_model_dir)


@pytest.fixture(scope="module")
def scripted_run(
    gateway_server: GatewayServer, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict:
    """A run on the local backend whose model answers `byte_script` to every turn."""
    model = byte_model(tiny_model_dir, tmp_path_factory.mktemp("scripted") / "model")
    resp = httpx.post(
        gateway_server.url + "/admin/v1/runs",
        json={"name": "byte-splice", "model": str(model), "config": {}},
        headers=gateway_server.admin_headers(),
        timeout=60,
    )
    assert resp.status_code == 201, resp.text
    return resp.json()


@pytest.fixture(scope="module")
def stub_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The stand-in vLLM server answering ids 188..191 only: bytes 0xFD, 0xFE, 0xFF, 0x00."""
    port = free_port()
    log = tmp_path_factory.mktemp("stub-vllm") / "stub.log"
    extra = ("--token-base=188", "--vocab-size=192")
    proc = launch("vllm", port, output_tokens=6, extra=extra, log=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout_s=60)
        yield url
    finally:
        stop(proc)


@pytest.mark.parametrize("max_tokens", [8, 16], ids=["cut-by-max-tokens", "stopped"])
def test_local_backend_splices_byte_tokens(
    gateway_server, scripted_run, template, max_tokens
) -> None:
    script = byte_script(template)
    rows = play(gateway_server, scripted_run, 3, max_tokens=max_tokens)
    stop_id = template.tokenizer.convert_tokens_to_ids("<|im_end|>")
    forced = script[:8] if max_tokens == 8 else [*script, stop_id]
    assert all(r["output_token_ids"] == forced for r in rows)  # the script was sampled
    # the ids do not survive text: decoding and re-encoding gives other ids
    assert template.encode(template.decode(forced)) != forced
    assert_spliced(rows)


def test_local_backend_splices_byte_tokens_streamed(gateway_server, scripted_run) -> None:
    assert_spliced(play(gateway_server, scripted_run, 3, stream=True, max_tokens=8))


def test_an_answer_the_agent_changed_is_rendered_from_its_text(
    gateway_server, scripted_run, template
) -> None:
    headers = {"Authorization": f"Bearer {scripted_run['api_key']}", "X-Episode-Id": "bytes-edit"}
    body = {"model": scripted_run["name"], "max_tokens": 8, "temperature": 0}
    with httpx.Client(base_url=gateway_server.url, headers=headers, timeout=60) as http:
        one = http.post("/v1/chat/completions", json={**body, "messages": FIRST}).json()
        edited = one["choices"][0]["message"]["content"].replace("\ufffd", "?")
        follow = [*FIRST, {"role": "assistant", "content": edited}]
        follow.append({"role": "user", "content": "and?"})
        two = http.post("/v1/chat/completions", json={**body, "messages": follow}).json()
    row = gateway_server.completion(two["id"])
    # not the answer rlgate sent: nothing to continue, the template renders the client's text
    assert row["parent_id"] is None and not row["spliced"]
    assert row["prompt_token_ids"] == template.render(follow)


def test_responses_api_splices_byte_tokens(gateway_server, scripted_run) -> None:
    rows, texts = play_responses(gateway_server, scripted_run, 3)
    assert all("\ufffd" in text for text in texts)
    assert_spliced(rows)


def test_vllm_client_splices_byte_tokens(gateway_server, stub_vllm, template) -> None:
    resp = httpx.post(
        gateway_server.url + "/admin/v1/runs",
        json={"name": "byte-splice-vllm", "model": "tiny", "backend": "vllm",
              "replicas": [stub_vllm], "config": {}},
        headers=gateway_server.admin_headers(),
        timeout=60,
    )  # fmt: skip
    assert resp.status_code == 201, resp.text
    rows = play(gateway_server, resp.json(), 3, max_tokens=6)
    served = {byte_id(template, b) for b in (0xFD, 0xFE, 0xFF, 0x00)}
    assert served == set(range(188, 192))  # what the stand-in was told to answer
    assert all(set(r["output_token_ids"]) <= served for r in rows)
    assert any(byte_id(template, 0x00) in r["output_token_ids"] for r in rows[:-1])
    assert_spliced(rows)
