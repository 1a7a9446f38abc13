"""Browser fixtures: Debian's chromium driven by Playwright, and a run holding real data.

Playwright's own browser download cannot work on these machines, so the tests
launch /usr/bin/chromium. Without it they skip, unless RLGATE_REQUIRE_BROWSER=1
or CI=true (CI sets both), where a missing browser is a failure.

Screenshots go to the test-artifact directory; with RLGATE_SCREENSHOTS=1 the
ones the docs show are also written to docs/img/ (so a plain test run never
changes the git tree).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.browser.rl_run import RunFixture, add_trained_run, trained_run

CHROMIUM = os.environ.get("RLGATE_CHROMIUM", "/usr/bin/chromium")  # Debian's package
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


DOCS_IMG = Path(__file__).resolve().parents[2] / "docs" / "img"


def _unavailable(reason: str) -> None:
    if os.environ.get("RLGATE_REQUIRE_BROWSER") == "1" or os.environ.get("CI") == "true":
        pytest.fail(f"browser tests required (RLGATE_REQUIRE_BROWSER=1 or CI=true) but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    root = os.environ.get("RLGATE_ARTIFACTS")
    path = Path(root) if root else Path(__file__).resolve().parents[2] / "test-artifacts"
    out = path / "browser"
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.fixture(scope="session")
def shoot(artifacts_dir: Path) -> Callable[..., None]:
    """`shoot(page, name, docs=True)`: a full-page screenshot to the artifacts, and (a docs
    image) to docs/img/dashboard-{name}.png when RLGATE_SCREENSHOTS=1."""
    to_docs = os.environ.get("RLGATE_SCREENSHOTS") == "1"

    def shoot(page, name: str, docs: bool = True) -> None:
        page.screenshot(path=str(artifacts_dir / f"{name}.png"), full_page=True)
        if docs and to_docs:
            page.screenshot(path=str(DOCS_IMG / f"dashboard-{name}.png"), full_page=True)

    return shoot


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


@pytest.fixture(scope="session")  # one stack for every browser test module
def real_run(tmp_path_factory, model_cache_dir, tiny_model_dir) -> Iterator[RunFixture]:
    """Gateway + worker + a run that trained two real steps on the tiny model.

    RLGATE_BROWSER_MODEL=smollm2 runs the same flow on SmolLM2-135M (slower; its
    token colours are more telling, so the docs' screenshots come from it).
    """
    model = os.environ.get("RLGATE_BROWSER_MODEL", "tiny")
    data = tmp_path_factory.mktemp("dashboard") / "data"
    with trained_run(data, model_cache_dir, model=model) as fx:
        yield fx


@pytest.fixture(scope="session")
def second_run(real_run: RunFixture) -> dict:
    """A second real run on the same stack (rewards 0 and 2): the compare view's other line."""
    model = os.environ.get("RLGATE_BROWSER_MODEL", "tiny")
    return add_trained_run(real_run, "browser-run-2", model=model, scale=2.0)
