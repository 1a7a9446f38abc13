"""Browser fixtures: Debian's chromium driven by Playwright, and a run holding real data.

Playwright's own browser download cannot work on these machines, so the tests
launch /usr/bin/chromium. Without it they skip, unless RLGATE_REQUIRE_BROWSER=1
(set by CI), where a missing browser is a failure.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.browser.rl_run import RunFixture, trained_run

CHROMIUM = os.environ.get("RLGATE_CHROMIUM", "/usr/bin/chromium")  # Debian's package
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def _unavailable(reason: str) -> None:
    if os.environ.get("RLGATE_REQUIRE_BROWSER") == "1":
        pytest.fail(f"browser tests required (RLGATE_REQUIRE_BROWSER=1) but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    root = os.environ.get("RLGATE_ARTIFACTS")
    path = Path(root) if root else Path(__file__).resolve().parents[2] / "test-artifacts"
    out = path / "browser"
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if not Path(CHROMIUM).exists():
        _unavailable(f"{CHROMIUM} is missing (apt-get install -y chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("the playwright package is not installed (pip install -e '.[test]')")
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def real_run(tmp_path_factory, model_cache_dir, tiny_model_dir) -> Iterator[RunFixture]:
    """Gateway + worker + a run that trained two real steps on the tiny model.

    RLGATE_BROWSER_MODEL=smollm2 runs the same flow on SmolLM2-135M (slower; its
    token colours are more telling, so the docs' screenshots come from it).
    """
    model = os.environ.get("RLGATE_BROWSER_MODEL", "tiny")
    data = tmp_path_factory.mktemp("dashboard") / "data"
    with trained_run(data, model_cache_dir, model=model) as fx:
        yield fx
