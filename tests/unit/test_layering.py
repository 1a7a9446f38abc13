"""Who may import whom (docs/architecture.md): the rules read from the source, not trusted."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = ("gateway", "inference", "trainer", "rlgate", "agents_sdk", "migrations")


def _runtime_nodes(tree: ast.AST):
    """Every node, but not the bodies of `if TYPE_CHECKING:` (annotations import nothing)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            yield from (n for child in node.orelse for n in [child, *_runtime_nodes(child)])
            continue
        yield node
        yield from _runtime_nodes(node)


def imports_of(path: Path) -> set[str]:
    """Every module a file imports at run time, at any depth (lazy imports count too)."""
    found: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def offenders(folder: str, allowed) -> list[str]:
    bad = []
    for path in files(folder):
        for mod in imports_of(path):
            if mod.split(".")[0] in OURS and not allowed(mod):
                bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    return bad


def test_inference_imports_only_itself_and_settings() -> None:
    # `core.settings` is the one settings object (launchers read server pythons from it);
    # `core.lifeline` (stdlib only) ties the servers that launchers start to rlgate's life.
    allowed = ("inference", "core.settings", "core.lifeline")
    assert offenders("inference", lambda m: m.startswith(allowed)) == []


def test_the_store_never_imports_the_web_app_or_services() -> None:
    # migrate.py finds the Alembic scripts through the `migrations` package
    assert offenders("core/store", lambda m: m.startswith(("core.store", "migrations"))) == []
    for path in files("core/store"):
        assert not any(m.startswith(("fastapi", "starlette")) for m in imports_of(path)), path


def test_the_trainer_reaches_the_gateway_only_through_its_store() -> None:
    def allowed(mod: str) -> bool:
        return not mod.startswith("gateway") or mod.startswith("core.store")

    assert offenders("trainer", allowed) == []


def test_routers_import_no_other_router() -> None:
    bad = [
        f"{p.name} imports {m}"
        for p in files("gateway/routes")
        for m in imports_of(p)
        if m.startswith("gateway.routes")
    ]
    assert bad == []


def test_batch_policy_is_pure() -> None:
    mods = imports_of(ROOT / "gateway/control/batch_policy.py")
    assert not any(m.startswith(("sqlalchemy", "fastapi")) for m in mods), mods
    assert {m for m in mods if m.startswith("gateway")} <= {"core.store.status"}


@pytest.mark.parametrize("path", files("agents_sdk"), ids=lambda p: p.name)
def test_the_sdk_imports_only_openai_httpx_and_itself(path: Path) -> None:
    ours = {m for m in imports_of(path) if m.split(".")[0] in OURS}
    assert all(m.startswith("agents_sdk") for m in ours), ours
