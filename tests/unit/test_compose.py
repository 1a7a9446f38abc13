"""docker-compose.yml: no engine runs here, so check what can be checked without one."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

from rlgate.cli import build_parser

COMPOSE = Path(__file__).resolve().parents[2] / "docker-compose.yml"


def _services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def _rlgate_commands(service: dict) -> list[list[str]]:
    """Each `rlgate ...` invocation in the service's shell command, as argv."""
    cmd = service.get("command") or []
    text = " ".join(cmd) if isinstance(cmd, list) else str(cmd)
    out = []
    for segment in re.split(r"&&|;|\n", text):
        tokens = shlex.split(segment)
        if "rlgate" in tokens:
            out.append(tokens[tokens.index("rlgate") :])
    return out


def test_every_service_has_an_image_and_a_healthcheck() -> None:
    for name, svc in _services().items():
        assert svc.get("image"), name
        assert svc.get("healthcheck"), f"{name} has no healthcheck"


def test_every_rlgate_command_parses_with_the_real_cli() -> None:
    parser = build_parser()
    seen = []
    for name, svc in _services().items():
        for argv in _rlgate_commands(svc):
            args = parser.parse_args(argv[1:])  # raises SystemExit on an unknown command/flag
            seen.append((name, args.command))
    assert ("gateway", "up") in seen and ("worker", "worker") in seen


def test_gateway_and_worker_share_the_checkpoint_volume() -> None:
    svcs = _services()
    vols = [set(svcs[s].get("volumes", [])) for s in ("gateway", "worker")]
    assert any("/data" in v for v in vols[0] & vols[1])
