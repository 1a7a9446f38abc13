"""Read W&B's offline run files back: the `.wandb` transaction log, record by record.

wandb >= 0.2x writes and reads this log in its Go core and no longer ships a
Python reader, so the tests read it here. The format is LevelDB's log format
with a W&B header: a 7-byte file header (`:W&B`, magic 0xBEE1, version 0),
then 32 KiB blocks of chunks, each with a 7-byte header (CRC-32, length,
type: full, first, middle, last); a block's tail shorter than a header is
zero padding. Each whole record is a `wandb_internal_pb2.Record`.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[Any]:
    """Every record of one `.wandb` file, in order; raises on a corrupt chunk."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"not a .wandb file: {path}"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # padding at the end of a block
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if (crc, length, kind) == (0, 0, 0):  # the rest of this block is padding
            pos += left
            continue
        chunk = data[pos + HEADER : pos + HEADER + length]
        # LevelDB's checksum covers the type byte and the payload
        assert zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF == crc, f"bad chunk at {pos}"
        pos += HEADER + length
        pending += chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


@dataclass
class OfflineRun:
    """One offline run directory: the W&B run's id, project and config, and its history rows."""

    run_id: str = ""
    project: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)


def read_offline_run(run_dir: Path) -> OfflineRun:
    (log,) = run_dir.glob("*.wandb")
    out = OfflineRun()
    for record in records(log):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out.run_id, out.project = record.run.run_id, record.run.project
            out.config |= {i.key: json.loads(i.value_json) for i in record.run.config.update}
        elif kind == "config":
            out.config |= {i.key: json.loads(i.value_json) for i in record.config.update}
        elif kind == "history":
            row = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in record.history.item
            }
            out.history.append(row)
    return out


def offline_runs(wandb_dir: Path, run_id: str) -> list[OfflineRun]:
    """Every offline directory of W&B run `run_id` under `WANDB_DIR`, oldest first."""
    return [
        read_offline_run(d) for d in sorted((wandb_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    ]
