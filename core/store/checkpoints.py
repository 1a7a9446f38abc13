"""Where a run's checkpoints live on disk, and how a version's files are made durable.

The store records each version's checkpoint directory (`PolicyVersion.checkpoint_path`)
and, when the run keeps it, its AdamW state (`PolicyVersion.optimizer_path`); every
reader goes through those paths, never through a name built here. Under
`<checkpoints_dir>/<run_id>/`:

- `v<N>.<attempt>/`: version N as written by one step attempt (a full HF directory or
  a LoRA adapter), first as `v<N>.<attempt>.tmp/`, renamed when whole.
- `v<N>.<attempt>.optimizer/`: that attempt's AdamW state.
- `v<N>.<attempt>.offer.json`: `weight_sync: collective`, the offer of version N.
- `v<N>/`, `optimizer.pt`, `optimizer-fsdp/v<N>/`: the layout before attempt
  directories, still read for versions recorded that way (`optimizer_path` null).

Every attempt writes only below its own name, fsyncs it, then commits with the store's
conditional version bump, which records the directory. Nothing is renamed after the
commit, so a crash between the two leaves at most an unrecorded attempt directory,
and a losing or late attempt can never touch the committed one. Unrecorded attempt
directories of versions already committed are garbage: the losing attempt removes its
own, and `CheckpointLayout.garbage` finds what a killed one left (the trainer sweeps
after each commit).
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

OPTIMIZER_SUFFIX = ".optimizer"
LEGACY_SHARDED_OPTIMIZER = "optimizer-fsdp"

# v<N>.<attempt> and the files named after it (.tmp, .optimizer, .optimizer.tmp, .offer.json)
_ATTEMPT = re.compile(r"^v(?P<version>\d+)\.(?P<attempt>[0-9a-f]{12})(?P<rest>\..*)?$")


class CheckpointLayout:
    """Every checkpoint, adapter and AdamW path of every run under one `root` directory.

    A version's directory holds a full Hugging Face model or, for a LoRA run, its
    adapter (`adapter_config.json` + `adapter_model.safetensors`): the same name either
    way, so nothing here depends on the kind of run. Paths are built here and only
    here; once recorded in the store, readers go through the recorded path.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def run_dir(self, run_id: str) -> Path:
        """Every file of the run (deleting the run deletes this)."""
        return self.root / run_id

    def attempt_dir(self, run_id: str, version: int) -> Path:
        """A fresh directory name for one attempt at writing `version` (not created here)."""
        return self.run_dir(run_id) / f"v{version}.{uuid.uuid4().hex[:12]}"

    @staticmethod
    def optimizer_dir(checkpoint_dir: Path) -> Path:
        """The AdamW state written by the attempt that wrote `checkpoint_dir`."""
        checkpoint_dir = Path(checkpoint_dir)
        return checkpoint_dir.with_name(checkpoint_dir.name + OPTIMIZER_SUFFIX)

    @staticmethod
    def attempt_version(path: Path) -> int | None:
        """The version an attempt directory (or a file named after it) writes; None if
        `path` is not one."""
        m = _ATTEMPT.match(Path(path).name)
        return int(m["version"]) if m else None

    @staticmethod
    def attempt_files(checkpoint_dir: Path) -> list[Path]:
        """Every file and directory one attempt wrote under its own name (the checkpoint,
        its `.tmp`, its AdamW state, its offer)."""
        checkpoint_dir = Path(checkpoint_dir)
        return sorted(checkpoint_dir.parent.glob(f"{checkpoint_dir.name}*"))

    def legacy_version_dir(self, run_id: str, version: int) -> Path:
        """`v<N>`: where version N was written before attempt directories."""
        return self.run_dir(run_id) / f"v{version}"

    def legacy_optimizer_dir(self, run_id: str, version: int, sharded: bool) -> Path:
        """Where a version recorded without `optimizer_path` kept its AdamW state: one
        `optimizer.pt` in the run's root (in-process engines, overwritten each step), or
        one directory per version (sharded FSDP state)."""
        root = self.run_dir(run_id)
        return root / LEGACY_SHARDED_OPTIMIZER / f"v{version}" if sharded else root

    def garbage(self, run_id: str, recorded: set[Path], newest: int) -> list[Path]:
        """Attempt files of the run that no version records and none ever will.

        An attempt at version N <= `newest` can no longer commit (the conditional bump
        needs the run at N - 1), so whatever it left is garbage whether it lost, was
        killed or is still writing (it then fails its commit and removes its own).
        """
        root = self.run_dir(run_id)
        keep = {Path(p).name for p in recorded}
        out = []
        for path in root.iterdir() if root.is_dir() else ():
            m = _ATTEMPT.match(path.name)
            if m is None or int(m["version"]) > newest:
                continue
            if f"v{m['version']}.{m['attempt']}" not in keep:
                out.append(path)
        return sorted(out)


def fsync_tree(path: Path) -> None:
    """fsync every file below `path`, every directory, `path` itself and its parent, so a
    commit that records `path` never outlives its contents after a power loss."""
    path = Path(path)
    if path.is_file():
        _fsync(path, os.O_RDONLY)
    else:
        for here, _dirs, files in os.walk(path):
            for name in files:
                _fsync(Path(here) / name, os.O_RDONLY)
            _fsync(Path(here), os.O_RDONLY | os.O_DIRECTORY)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """fsync a directory: the names created, renamed or removed in it are on disk."""
    _fsync(Path(path), os.O_RDONLY | os.O_DIRECTORY)


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
