"""What keeps the product code readable, checked on every run (docs/architecture.md):
short functions, typed gateway code, benches in one package, one swap protocol, and docs
and code that state what is (the history is in git and CHANGELOG.md).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_FUNCTION_LINES = 80
# where users and readers of the code look: they get current facts, not a diary
CURRENT_ONLY = (
    *("README.md", "docs", "examples"),
    *("core", "gateway", "inference", "trainer", "rlgate", "agents_sdk"),
)
HISTORY = re.compile(
    r"\bissues? #?\d+\b|\bsessions? \d+\b|\bstops? \d+\b|\b20\d\d-\d\d-\d\d\b", re.IGNORECASE
)


def long_functions(folder: Path) -> list[str]:
    """Functions (decorators excluded, docstrings included) longer than the limit."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (fn.end_lineno or fn.lineno) - fn.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(folder.parent)}:{fn.lineno} {fn.name} ({n})")
    return found


def type_ignores(folder: Path) -> list[str]:
    return [
        f"{path.relative_to(folder.parent)}:{i}"
        for path in sorted(folder.rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"#\s*type:\s*ignore", line)
    ]


@pytest.mark.parametrize("package", ["core", "gateway", "inference", "trainer"])
def test_no_function_is_longer_than_80_lines(package: str) -> None:
    """A function that long does more than one thing."""
    assert not (long := long_functions(ROOT / package)), long


def history_lines(root: Path, names: tuple[str, ...] = CURRENT_ONLY) -> list[str]:
    """Lines that cite an issue, a session or a stop by number, or a date."""
    paths = [root / n for n in names if (root / n).is_file()]
    paths += [p for n in names if (root / n).is_dir() for p in sorted((root / n).rglob("*"))]
    return [
        f"{path.relative_to(root)}:{i}: {line.strip()}"
        for path in paths
        if path.suffix in {".md", ".py", ".html", ".js"}
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if HISTORY.search(line)
    ]


def test_docs_and_product_code_tell_no_history() -> None:
    """No issue numbers, session or stop ordinals or dated snapshots in the docs, README or
    the product packages: they give today's figures and why; CHANGELOG.md and git hold
    what changed when."""
    assert not (found := history_lines(ROOT)), found


def test_the_gateway_silences_no_type_error() -> None:
    assert not (ignored := type_ignores(ROOT / "gateway")), ignored


def test_benches_live_in_the_bench_package() -> None:
    assert not list((ROOT / "rlgate").glob("bench_*.py"))
    assert (ROOT / "rlgate" / "bench" / "gateway.py").is_file()


def test_the_swap_loop_asks_no_backend_what_it_is() -> None:
    """Each run's swapper is chosen once when it is loaded (`inference.swap`); the loop that
    swaps calls it without asking the pool or the backend for its kind."""
    tree = ast.parse((ROOT / "gateway" / "control" / "swapper.py").read_text())
    asks = [
        f"{node.func.id} at line {node.lineno}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in {"getattr", "hasattr", "isinstance", "type"}
    ]
    assert not asks, asks


def test_the_walks_see_what_they_look_for(tmp_path: Path) -> None:
    """A planted 81-line function and a planted ignore are found; 80 lines pass."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES - 1))
    (pkg / "ok.py").write_text(f"def f():\n{body}\n")
    assert long_functions(pkg) == []
    (pkg / "long.py").write_text(f"async def g():\n{body}\n    return 0\n")
    assert long_functions(pkg) == [f"pkg/long.py:1 g ({MAX_FUNCTION_LINES + 1})"]
    (pkg / "ok.py").write_text("x = f()  # type:ignore[arg-type]\n")
    assert type_ignores(pkg) == ["pkg/ok.py:1"]
    (tmp_path / "README.md").write_text("A run of the bench.\nAs of 2026-11-28, 14x.\n")
    (pkg / "doc.md").write_text("Fixed in issue 39.\nIssue #40 too.\nSee the stop 7 figures.\n")
    assert history_lines(tmp_path, ("README.md", "pkg")) == [
        "README.md:2: As of 2026-11-28, 14x.",
        "pkg/doc.md:1: Fixed in issue 39.",
        "pkg/doc.md:2: Issue #40 too.",
        "pkg/doc.md:3: See the stop 7 figures.",
    ]
