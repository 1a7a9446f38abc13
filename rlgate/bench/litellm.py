"""LiteLLM's proxy for `rlgate bench gateway`: a pinned release in its own venv, and its config.

LiteLLM pins packages that conflict with rlgate's, so it lives in
`~/.cache/rlgate/litellm-venv`, made on first use and remade when the
installed release is not `LITELLM_VERSION` (figures are only comparable
against one release).
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

LITELLM_VERSION = "1.108.7"  # the release the published figures were taken against
LITELLM_VENV = Path.home() / ".cache" / "rlgate" / "litellm-venv"
TEXT_MODEL = "stub-model"  # /v1/completions, forwarded as is (token-id prompts included)
CHAT_MODEL = "stub-chat"  # /v1/chat/completions, forwarded to the stub's chat route


def installed_version(venv: Path = LITELLM_VENV) -> str | None:
    """The litellm release installed in `venv`, or None."""
    python = venv / "bin" / "python"
    if not python.exists():
        return None
    code = "import importlib.metadata as m; print(m.version('litellm'))"
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def litellm_binary(venv: Path = LITELLM_VENV, version: str = LITELLM_VERSION) -> Path:
    """LiteLLM's proxy at `version` in `venv`, installed (pip, minutes) when it is not there."""
    if installed_version(venv) != version:
        logger.warning("installing litellm[proxy]==%s into %s (minutes, once)", version, venv)
        if not (venv / "bin" / "python").exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, f"litellm[proxy]=={version}"], check=True)
    return venv / "bin" / "litellm"


def write_config(path: Path, stub: str, master_key: str) -> None:
    """Both of the stub's routes behind LiteLLM; the master key checked on every request.

    `text-completion-openai/` forwards /v1/completions as is; `openai/` sends
    chat to the stub's /v1/chat/completions. The key: LiteLLM checks a
    credential per request, as rlgate checks the run key.
    """
    path.write_text(
        "model_list:\n"
        f"  - model_name: {TEXT_MODEL}\n"
        "    litellm_params:\n"
        "      model: text-completion-openai/stub-model\n"
        f"      api_base: {stub}/v1\n"
        "      api_key: none\n"
        f"  - model_name: {CHAT_MODEL}\n"
        "    litellm_params:\n"
        "      model: openai/stub-model\n"
        f"      api_base: {stub}/v1\n"
        "      api_key: none\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
        "general_settings:\n"
        f"  master_key: {master_key}\n"
    )
