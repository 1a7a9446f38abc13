"""`docker-compose.yml` as docs/security.md describes it, read with PyYAML (no docker daemon).

Only the gateway publishes a port; PostgreSQL, Redis and the inference servers sit on
an internal network only; every secret is required from the environment
(`${VAR:?message}`: compose refuses to start without it, and there is no default to
leak); vLLM and SGLang require the inference API key that the gateway is given.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

COMPOSE = Path(__file__).resolve().parents[2] / "docker-compose.yml"
PRIVATE = ("postgres", "redis", "vllm", "sglang")
INFERENCE = ("vllm", "sglang")
SECRET_NAME = re.compile(r"(KEY|SECRET|PASSWORD|PASSWD|TOKEN|AUTH)", re.I)
# ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?message}, ${NAME?message}, $NAME
REFERENCE = re.compile(
    r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?P<op>:?[-?+])?[^}]*\}|\$(?P<bare>[A-Za-z_]\w*)"
)
REQUIRED = ":?"


@pytest.fixture(scope="module")
def text() -> str:
    return COMPOSE.read_text()


@pytest.fixture(scope="module")
def compose(text: str) -> dict[str, Any]:
    return yaml.safe_load(text)


def _networks(service: dict[str, Any]) -> list[str]:
    nets = service.get("networks", ["default"])
    return list(nets) if isinstance(nets, list | dict) else [nets]


def test_only_the_gateway_publishes_a_port(compose) -> None:
    published = {name for name, svc in compose["services"].items() if svc.get("ports")}
    assert published == {"gateway"}
    for name in PRIVATE:
        svc = compose["services"][name]
        assert "ports" not in svc, name
        assert svc.get("network_mode") is None, f"{name}: network_mode bypasses the networks"


def test_private_services_sit_on_internal_networks_only(compose) -> None:
    networks = compose.get("networks") or {}
    internal = {name for name, cfg in networks.items() if (cfg or {}).get("internal") is True}
    assert internal, "no network is marked internal: true"
    for name in PRIVATE:
        nets = _networks(compose["services"][name])
        assert nets and set(nets) <= internal, (name, nets)
    # the gateway reaches them, and is the one that is reachable
    assert set(_networks(compose["services"]["gateway"])) & internal


def test_every_secret_is_required_from_the_environment(text: str, compose) -> None:
    secrets_seen = set()
    for match in REFERENCE.finditer(text):
        name = match.group("name") or match.group("bare")
        if not SECRET_NAME.search(name):
            continue
        secrets_seen.add(name)
        assert match.group("bare") is None, f"${name}: use ${{{name}:?message}}"
        assert match.group("op") == REQUIRED, f"{match.group(0)}: a secret needs ':?', no default"
    assert secrets_seen >= {
        "RLGATE_ADMIN_KEY",
        "RLGATE_POSTGRES_PASSWORD",
        "RLGATE_REDIS_PASSWORD",
        "RLGATE_INFERENCE_API_KEY",
        "RLGATE_WEIGHT_SYNC_SECRET",
    }


def test_no_secret_is_written_into_the_file(compose) -> None:
    """Every environment variable named like a secret gets its value from a `${...:?}`."""

    def envs(node: Any) -> list[tuple[str, Any]]:
        if isinstance(node, dict):
            return list(node.items())
        return [tuple(item.split("=", 1)) for item in node or [] if "=" in item]

    for name, svc in compose["services"].items():
        for var, value in envs(svc.get("environment")):
            if SECRET_NAME.search(var):
                assert isinstance(value, str) and "${" in value and ":?" in value, (name, var)
    for key, block in compose.items():
        if key.startswith("x-") and isinstance(block, dict):
            for var, value in block.items():
                if SECRET_NAME.search(var):
                    assert "${" in str(value) and ":?" in str(value), (key, var)
    # the database and broker URLs carry their passwords only as required references
    env = compose["x-rlgate-env"]
    for var in ("RLGATE_DATABASE_URL", "RLGATE_BROKER_URL"):
        userinfo = env[var].split("://", 1)[1].rsplit("@", 1)[0]
        password = userinfo.split(":", 1)[1]
        assert password.startswith("${") and ":?" in password, (var, password)


@pytest.mark.parametrize("name", INFERENCE)
def test_inference_servers_require_the_key_the_gateway_sends(compose, name: str) -> None:
    command = [str(part) for part in compose["services"][name]["command"]]
    assert "--api-key" in command, name
    key = command[command.index("--api-key") + 1]
    assert key.startswith("${RLGATE_INFERENCE_API_KEY:?"), key
    gateway_env = compose["services"]["gateway"]["environment"]
    assert gateway_env["RLGATE_INFERENCE_API_KEY"].startswith("${RLGATE_INFERENCE_API_KEY:?")
