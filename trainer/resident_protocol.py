"""The resident rank group's wire protocol: typed messages, one JSON object per frame.

Two hops, both tiny:

    worker ──(Unix socket, frames)──▶ leader rank ──(gloo broadcast)──▶ every rank

The worker (`trainer.resident.ResidentGroup`) talks only to the leader: the
rank with local rank 0 on the node that owns the Celery queue. The leader
re-broadcasts each command over a gloo group of its own (`broadcast_command`),
so the other ranks, on this node or another, need no socket and no shared
scratch directory; the samples travel inside the `Step` command.

Frames are a 4-byte big-endian length and a UTF-8 JSON object with an `op`
naming its class. Every command gets exactly one reply frame from the leader
(`Ready` once at start, then `Done` per command). A rank that fails does not
reply: it exits, torchrun stops the group, and the worker reads the end of
the stream (see `trainer.resident`).
"""

from __future__ import annotations

import dataclasses
import json
import socket
import struct
from dataclasses import dataclass, field
from typing import Any

MAX_FRAME = 1 << 30  # a batch of samples is megabytes; anything near this is a bug


@dataclass(frozen=True)
class Init:
    """What every rank needs to build its engine; the leader publishes it in torchrun's store."""

    config: dict[str, Any]  # {"run": RunConfig, "parallel": ParallelConfig} as JSON
    checkpoint_dir: str  # version N
    version: int
    reference_dir: str | None = None
    optimizer_in: str | None = None  # AdamW state saved for version N, if any
    run_id: str = ""  # weight_sync collective: rank 0 offers the run's weights under this id
    weight_host: str = "127.0.0.1"  # ... on this address of its host (weight_sync_host)
    op: str = "init"


@dataclass(frozen=True)
class Ready:
    """Leader -> worker, once the engine is built on every rank."""

    pids: list[int]  # every rank's pid, by global rank
    version: int
    optimizer_resumed: bool
    weight_url: str | None = None  # weight_sync collective: rank 0's weight server
    op: str = "ready"


@dataclass(frozen=True)
class Step:
    """One optimizer step from the group's version N to N+1, then the checkpoint of N+1."""

    samples: str  # a `trainer.torchrun.write_samples` file the leader can read
    out_dir: str
    tokenizer_dir: str
    version: int  # N: a group at any other version refuses (a worker bug, not a retry)
    optimizer_out: str | None = None  # also save AdamW's state for N+1 here (DCP)
    save: bool = True  # write N+1's checkpoint (weight_sync collective: only when due)
    op: str = "step"


@dataclass(frozen=True)
class SaveOptimizer:
    """Write AdamW's sharded state for the group's current version (DCP, collective)."""

    state_dir: str
    op: str = "save_optimizer"


@dataclass(frozen=True)
class SaveWeights:
    """Write the checkpoint of the group's current version (one a `Step` did not save)."""

    out_dir: str
    tokenizer_dir: str
    op: str = "save_weights"


@dataclass(frozen=True)
class Shutdown:
    """Leave the process group together and exit 0."""

    op: str = "shutdown"


@dataclass(frozen=True)
class Done:
    """Leader -> worker: the command finished on every rank."""

    metrics: dict[str, Any] = field(default_factory=dict)
    op: str = "done"


Message = Init | Ready | Step | SaveOptimizer | SaveWeights | Shutdown | Done
MESSAGES: dict[str, type] = {
    cls.op: cls for cls in (Init, Ready, Step, SaveOptimizer, SaveWeights, Shutdown, Done)
}


class ProtocolError(RuntimeError):
    """The peer closed the stream or sent something that is not a message."""


def encode(msg: Message) -> bytes:
    return json.dumps(dataclasses.asdict(msg)).encode()


def decode(data: bytes | str) -> Message:
    try:
        raw = json.loads(data)
        return MESSAGES[raw["op"]](**raw)
    except (ValueError, KeyError, TypeError) as exc:
        raise ProtocolError(f"not a resident-group message: {str(data)[:200]!r}") from exc


def send(sock: socket.socket, msg: Message) -> None:
    body = encode(msg)
    sock.sendall(struct.pack(">I", len(body)) + body)


def recv(sock: socket.socket) -> Message:
    """The next message; ProtocolError if the stream ends first."""
    (size,) = struct.unpack(">I", _read(sock, 4))
    if size > MAX_FRAME:
        raise ProtocolError(f"frame of {size} bytes")
    return decode(_read(sock, size))


def _read(sock: socket.socket, n: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < n:
        chunk = sock.recv(n - len(chunks))
        if not chunk:
            raise ProtocolError("the peer closed the stream")
        chunks += chunk
    return bytes(chunks)
