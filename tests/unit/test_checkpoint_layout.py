"""The checkpoint layout: attempt names, and which leftovers the trainer's sweep removes."""

from __future__ import annotations

from pathlib import Path

from core.store.checkpoints import CheckpointLayout, fsync_tree


def test_attempts_of_one_version_never_share_a_name(tmp_path: Path) -> None:
    layout = CheckpointLayout(tmp_path)
    names = {layout.attempt_dir("r", 3).name for _ in range(100)}
    assert len(names) == 100 and all(n.startswith("v3.") for n in names)
    a = layout.attempt_dir("r", 3)
    assert a.parent == layout.run_dir("r") == tmp_path / "r"
    assert layout.optimizer_dir(a) == a.with_name(a.name + ".optimizer")
    assert layout.attempt_version(a) == 3 and layout.attempt_version(tmp_path / "v3") is None
    assert layout.legacy_version_dir("r", 3) == tmp_path / "r" / "v3"
    assert layout.legacy_optimizer_dir("r", 3, sharded=True) == tmp_path / "r/optimizer-fsdp/v3"
    assert layout.legacy_optimizer_dir("r", 3, sharded=False) == tmp_path / "r"


def test_an_attempts_files_are_the_ones_named_after_it(tmp_path: Path) -> None:
    layout = CheckpointLayout(tmp_path)
    mine, other = layout.attempt_dir("r", 2), layout.attempt_dir("r", 2)
    for d in (mine, layout.optimizer_dir(mine), other):
        d.mkdir(parents=True)
    (mine.parent / f"{mine.name}.offer.json").write_text("{}")
    assert [p.name for p in layout.attempt_files(mine)] == sorted(
        [mine.name, f"{mine.name}.offer.json", f"{mine.name}.optimizer"]
    )


def test_garbage_is_only_unrecorded_attempts_that_can_no_longer_commit(tmp_path: Path) -> None:
    layout = CheckpointLayout(tmp_path)
    root = layout.run_dir("r")
    root.mkdir()
    committed = layout.attempt_dir("r", 2)
    lost = layout.attempt_dir("r", 2)
    killed = layout.attempt_dir("r", 1)
    running = layout.attempt_dir("r", 3)  # the next step, maybe still being written
    optimizer_dir = layout.optimizer_dir
    for d in (committed, optimizer_dir(committed), lost, optimizer_dir(lost), running):
        d.mkdir()
    (root / f"{killed.name}.tmp").mkdir()
    (root / f"{lost.name}.offer.json").write_text("{}")
    for legacy in ("v1", "optimizer-fsdp", "optimizer.pt"):  # the old layout is never swept
        (root / legacy).mkdir()

    found = layout.garbage("r", {committed, optimizer_dir(committed)}, newest=2)

    assert [p.name for p in found] == sorted(
        [f"{killed.name}.tmp", lost.name, f"{lost.name}.offer.json", f"{lost.name}.optimizer"]
    )
    assert layout.garbage("missing", set(), newest=5) == []


def test_fsync_tree_takes_files_and_directories(tmp_path: Path) -> None:
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "sub" / "f").write_bytes(b"x")
    (tmp_path / "g").write_bytes(b"y")
    fsync_tree(tmp_path / "d")
    fsync_tree(tmp_path / "g")
