"""The package layers as a contract (docs/architecture.md, design.md's layout table).

    core        imports nothing of ours (only the Alembic scripts' `migrations` package)
    inference   imports core and itself
    trainer     imports core, inference and itself; never the gateway
    gateway     imports core, inference, itself and, of the trainer, only its
                task-submission API and config (`trainer.submit`, `trainer.config`)

`rlgate` (CLI, demo, benches) sits on top: none of the four imports it. Every import
counts, wherever it is written: at module level, inside a function (a lazy import
still ties the layers) and under `if TYPE_CHECKING:` (a type-checker still follows it).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = frozenset({"core", "gateway", "inference", "trainer", "rlgate", "agents_sdk", "migrations"})

# Layer -> the modules of ours it may import (each one and what sits under it).
ALLOWED: dict[str, tuple[str, ...]] = {
    "core": ("core", "migrations"),
    "inference": ("inference", "core"),
    "trainer": ("trainer", "core", "inference"),
    "gateway": ("gateway", "core", "inference", "trainer.submit", "trainer.config"),
}


def module_name(path: Path) -> str:
    """`core/store/db.py` -> `core.store.db`; a package's `__init__.py` is the package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The module a `from ... import` reads, relative levels resolved against `importer`."""
    if node.level == 0:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def imported_names(source: str, importer: str, is_package: bool) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of everything module `importer` imports, at any depth of `source`.

    `from a.b import c` yields `a.b.c`: `c` may be a module (`from trainer import
    tasks`) or a name in `a.b`; either way the prefix rules below decide.
    """
    for node in ast.walk(ast.parse(source, importer)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            origin = _absolute(node, importer, is_package)
            for alias in node.names:
                yield node.lineno, origin if alias.name == "*" else f"{origin}.{alias.name}"


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(layer: str) -> list[str]:
    """`file:line module -> forbidden import` for every import that breaks `layer`'s rule."""
    allowed = ALLOWED[layer]
    found = []
    for path in sorted((ROOT / layer).rglob("*.py")):
        importer = module_name(path)
        for line, name in imported_names(path.read_text(), importer, path.name == "__init__.py"):
            if name.split(".")[0] not in OURS or any(_under(name, ok) for ok in allowed):
                continue
            where = f"{path.relative_to(ROOT)}:{line}"
            found.append(f"{where} {importer} -> {name}")
    return found


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layer_imports_only_what_sits_below_it(layer: str) -> None:
    bad = violations(layer)
    rule = ", ".join(ALLOWED[layer])
    assert not bad, f"{layer}/ may import only {rule} of ours; found:\n" + "\n".join(bad)


def test_the_walk_sees_lazy_relative_and_type_checking_imports() -> None:
    """The scanner itself: imports in a function, a TYPE_CHECKING block or relative count."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from gateway.app import create_app\n"
        "def f():\n    import trainer.tasks\n"
        "from . import db\n"
        "from ..settings import Settings\n"
    )
    names = {name for _, name in imported_names(source, "core.store.probe", False)}
    assert names >= {
        "typing.TYPE_CHECKING",
        "gateway.app.create_app",
        "trainer.tasks",
        "core.store.db",
        "core.settings.Settings",
    }
    package = {name for _, name in imported_names("from . import db", "core.store", True)}
    assert package == {"core.store.db"}


def _imports_of(path: Path) -> set[str]:
    return {name for _, name in imported_names(path.read_text(), module_name(path), False)}


def test_routers_import_no_other_router() -> None:
    bad = [
        f"{path.name} imports {name}"
        for path in sorted((ROOT / "gateway/routes").glob("*.py"))
        for name in _imports_of(path)
        if _under(name, "gateway.routes")
    ]
    assert bad == []


def test_the_store_and_the_batch_policy_know_no_web_framework() -> None:
    """The store answers queries; which episodes train is a pure function of a snapshot."""
    web = ("fastapi", "starlette")
    for path in sorted((ROOT / "core/store").rglob("*.py")):
        assert not any(name.split(".")[0] in web for name in _imports_of(path)), path
    policy = _imports_of(ROOT / "gateway/control/batch_policy.py")
    assert not any(name.split(".")[0] in (*web, "sqlalchemy") for name in policy), policy
    # at run time only the status enums; the snapshot and run config types are annotations
    pure = ("core.store.status", "core.store.episodes.EpisodeSnapshot", "trainer.config.RunConfig")
    ours = {name for name in policy if name.split(".")[0] in OURS}
    assert all(any(_under(name, ok) for ok in pure) for name in ours), ours


@pytest.mark.parametrize("path", sorted((ROOT / "agents_sdk").rglob("*.py")), ids=lambda p: p.name)
def test_the_sdk_imports_only_openai_httpx_and_itself(path: Path) -> None:
    ours = {name for name in _imports_of(path) if name.split(".")[0] in OURS}
    assert all(_under(name, "agents_sdk") for name in ours), ours
