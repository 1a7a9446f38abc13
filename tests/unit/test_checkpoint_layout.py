"""The checkpoint layout: attempt names, and which leftovers the trainer's sweep removes."""

from __future__ import annotations

from pathlib import Path

from core.store.checkpoints import (
    attempt_dir,
    fsync_tree,
    garbage,
    legacy_optimizer_dir,
    legacy_version_dir,
    optimizer_dir,
)


def test_attempts_of_one_version_never_share_a_name(tmp_path: Path) -> None:
    names = {attempt_dir(tmp_path, "r", 3).name for _ in range(100)}
    assert len(names) == 100 and all(n.startswith("v3.") for n in names)
    a = attempt_dir(tmp_path, "r", 3)
    assert a.parent == tmp_path / "r"
    assert optimizer_dir(a) == a.with_name(a.name + ".optimizer")
    assert legacy_version_dir(tmp_path, "r", 3) == tmp_path / "r" / "v3"
    assert legacy_optimizer_dir(tmp_path, "r", 3, sharded=True) == tmp_path / "r/optimizer-fsdp/v3"
    assert legacy_optimizer_dir(tmp_path, "r", 3, sharded=False) == tmp_path / "r"


def test_garbage_is_only_unrecorded_attempts_that_can_no_longer_commit(tmp_path: Path) -> None:
    root = tmp_path / "r"
    root.mkdir()
    committed = attempt_dir(tmp_path, "r", 2)
    lost = attempt_dir(tmp_path, "r", 2)
    killed = attempt_dir(tmp_path, "r", 1)
    running = attempt_dir(tmp_path, "r", 3)  # the next step, maybe still being written
    for d in (committed, optimizer_dir(committed), lost, optimizer_dir(lost), running):
        d.mkdir()
    (root / f"{killed.name}.tmp").mkdir()
    (root / f"{lost.name}.offer.json").write_text("{}")
    for legacy in ("v1", "optimizer-fsdp", "optimizer.pt"):  # the old layout is never swept
        (root / legacy).mkdir()

    found = garbage(root, {committed, optimizer_dir(committed)}, newest=2)

    assert [p.name for p in found] == sorted(
        [f"{killed.name}.tmp", lost.name, f"{lost.name}.offer.json", f"{lost.name}.optimizer"]
    )
    assert garbage(tmp_path / "missing", set(), newest=5) == []


def test_fsync_tree_takes_files_and_directories(tmp_path: Path) -> None:
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "sub" / "f").write_bytes(b"x")
    (tmp_path / "g").write_bytes(b"y")
    fsync_tree(tmp_path / "d")
    fsync_tree(tmp_path / "g")
