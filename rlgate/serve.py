"""Run the gateway under uvicorn with Settings from the environment."""

from __future__ import annotations

import argparse
import logging

import uvicorn

from gateway.app import create_app
from rlgate.lifeline import die_with_parent
from rlgate.settings import Settings


def serve(settings: Settings, host: str, port: int) -> None:
    """Blocks until uvicorn stops (SIGTERM or SIGINT: in-flight requests finish first).

    Raises ValueError, before anything listens, when the admin credential does not fit
    the bind (the development key off loopback).
    """
    settings.resolved_admin_key(host)
    die_with_parent()  # when started by the demo, a bench or a test: stop with it
    uvicorn.run(create_app(settings), host=host, port=port, log_level="info", access_log=False)


def main() -> None:
    parser = argparse.ArgumentParser(description="rlgate gateway")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per backend call otherwise
    try:
        serve(Settings(), args.host, args.port)
    except ValueError as exc:
        raise SystemExit(f"rlgate gateway: {exc}") from None


if __name__ == "__main__":
    main()
