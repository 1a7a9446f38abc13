"""Full weights from one sender to its receivers over a gloo group of their own.

The wire format of `weight_sync: collective` (docs/weight-sync.md). Both
sides of a transfer import this module: the trainer (the sender, rank 0) and
each inference server's worker (rank 1, 2, ...), which runs another
interpreter with its own torch, so it needs only the standard library and
torch and is put on the server's PYTHONPATH as `rlgate_weight_wire`.

A transfer:

1. The sender opens a `TCPStore` (it is the master, on a free port) and
   describes it as a `Rendezvous`: host, port, a fresh transfer id, the
   world size (1 + receivers) and the version being sent.
2. It writes the plan under the transfer's prefix: every tensor's name,
   dtype, shape and byte range in one of a few flat uint8 buckets of at most
   `BUCKET_BYTES`. Bytes, not typed tensors, travel, so any dtype works and
   the receivers need no other metadata.
3. Every member builds a `ProcessGroupGloo` on that store (no
   `init_process_group`: a vLLM worker already has a default group of its
   own, and so does a torchrun rank) and the sender broadcasts the buckets
   one after another.
4. A receiver keeps every bucket until the last one has arrived, then hands
   out the tensors (views into the buckets). A transfer that fails half way
   therefore leaves the server's weights untouched: it never serves half of
   a version.

SGLang's receiver (`/init_weights_update_group`,
`/update_weights_from_distributed`) speaks another protocol, "torch": the
group is formed the way RL trainers pair with it (torch's `tcp://`
rendezvous on the sender's port, the store prefixed with the group's name,
`_new_process_group_helper`), and each tensor is broadcast on its own, typed,
in the order of the names the server was given (`join_named_group`,
`send_tensors`).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import socket
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

BUCKET_BYTES = 256 << 20  # one broadcast; bounds the sender's staging copy
ALIGN = 64  # byte offset of each tensor in its bucket (any dtype's view is aligned)
PLAN_KEY = "plan"


@dataclass(frozen=True)
class Rendezvous:
    """Where a transfer's members meet, and what it carries."""

    host: str
    port: int
    transfer_id: str
    world_size: int  # the sender (rank 0) and its receivers
    version: int
    group_name: str = ""  # protocol "torch": the process group's name

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Mapping) -> Rendezvous:
        return cls(
            host=str(raw["host"]),
            port=int(raw["port"]),
            transfer_id=str(raw["transfer_id"]),
            world_size=int(raw["world_size"]),
            version=int(raw["version"]),
            group_name=str(raw.get("group_name") or ""),
        )


def local_address(peer: str) -> str:
    """This host's address on the route to `peer` (what gloo binds, so the peer can reach it)."""
    if peer in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)) as s:
        s.connect((peer, 9))  # UDP: no packet is sent
        return s.getsockname()[0]


def open_store(host: str, receivers: int, version: int, timeout_s: float) -> tuple:
    """The sender's store on a free port of `host`, and the `Rendezvous` describing it."""
    store = dist.TCPStore(
        host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
    )
    rdv = Rendezvous(host, store.port, uuid.uuid4().hex, 1 + receivers, version)
    return store, rdv


def _group(store: dist.Store, rdv: Rendezvous, rank: int, timeout_s: float) -> Any:
    # gloo's options class is private in torch's stubs; the constructor is the public way in
    opts = cast(Any, dist.ProcessGroupGloo)._Options()
    opts._timeout = timedelta(seconds=timeout_s)
    bind = rdv.host if rank == 0 else local_address(rdv.host)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind)]
    prefixed = dist.PrefixStore(f"rlgate/{rdv.transfer_id}/", store)
    return dist.ProcessGroupGloo(prefixed, rank, rdv.world_size, opts)


def _broadcast(group: dist.ProcessGroup, buf: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([buf], opts).wait()


def plan(state: Mapping[str, torch.Tensor]) -> list[dict]:
    """Buckets of (name, dtype, shape, offset, nbytes), in the order of `state`."""
    buckets: list[dict] = []
    cur: dict | None = None
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        start = 0 if cur is None else -(-cur["nbytes"] // ALIGN) * ALIGN
        if cur is None or (cur["tensors"] and start + nbytes > BUCKET_BYTES):
            cur = {"nbytes": 0, "tensors": []}
            buckets.append(cur)
            start = 0
        dtype = str(t.dtype).removeprefix("torch.")
        cur["tensors"].append([name, dtype, list(t.shape), start, nbytes])
        cur["nbytes"] = start + nbytes
    return buckets


@dataclass(frozen=True)
class Packed:
    """A snapshot of a state dict in its wire layout: the plan and one uint8 buffer per bucket.

    Packing is the snapshot's only copy: the sender broadcasts the buffers as they are.
    """

    buckets: list[dict]
    bufs: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.bufs)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) views into the buffers, in order."""
        return _unpack(self.buckets, self.bufs)


def pack(state: Mapping[str, torch.Tensor], into: Packed | None = None) -> Packed:
    """Copy `state` into its wire layout (a snapshot later changes to `state` do not reach).

    `into`: an older snapshot nobody reads any more, whose buffers are reused when the
    layout is the same (fresh pages cost more than the copy itself).
    """
    buckets = plan(state)
    old = into.bufs if into is not None and into.buckets == buckets else None
    bufs = []
    for i, bucket in enumerate(buckets):
        buf = old[i] if old is not None else torch.empty(bucket["nbytes"], dtype=torch.uint8)
        for name, _, _, offset, nbytes in bucket["tensors"]:
            src = state[name].detach().contiguous().reshape(-1).view(torch.uint8)
            buf[offset : offset + nbytes].copy_(src)
        bufs.append(buf)
    return Packed(buckets, bufs)


def send_weights(store: dist.Store, rdv: Rendezvous, packed: Packed, timeout_s: float) -> int:
    """Rank 0's side: publish the plan, wait for every receiver, broadcast. Returns bytes sent."""
    prefixed = dist.PrefixStore(f"rlgate/{rdv.transfer_id}/", store)
    prefixed.set(PLAN_KEY, json.dumps({"version": rdv.version, "buckets": packed.buckets}))
    group = _group(store, rdv, 0, timeout_s)
    for buf in packed.bufs:
        _broadcast(group, buf)
    return packed.nbytes


def receive_weights(
    rdv: Rendezvous, rank: int, timeout_s: float, spare: list[torch.Tensor] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """A receiver's side: every tensor of the transfer, yielded only once all have arrived.

    `spare`: buffers of an earlier transfer whose tensors are no longer used; reused
    where the sizes match, and replaced in the list by this transfer's buffers.
    """
    store = dist.TCPStore(rdv.host, rdv.port, is_master=False, timeout=timedelta(seconds=timeout_s))
    prefixed = dist.PrefixStore(f"rlgate/{rdv.transfer_id}/", store)
    meta = json.loads(prefixed.get(PLAN_KEY))
    if int(meta["version"]) != rdv.version:
        raise RuntimeError(
            f"transfer {rdv.transfer_id} carries v{meta['version']}, not v{rdv.version}"
        )
    group = _group(store, rdv, rank, timeout_s)
    bufs = []
    old = list(spare or [])
    for i, bucket in enumerate(meta["buckets"]):
        fits = i < len(old) and old[i].numel() == bucket["nbytes"]
        buf = old[i] if fits else torch.empty(bucket["nbytes"], dtype=torch.uint8)
        _broadcast(group, buf)
        bufs.append(buf)
    if spare is not None:
        spare[:] = bufs
    return _unpack(meta["buckets"], bufs)


def _unpack(buckets: list[dict], bufs: list[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    for bucket, buf in zip(buckets, bufs, strict=True):
        for name, dtype, shape, offset, nbytes in bucket["tensors"]:
            raw = buf[offset : offset + nbytes]
            yield name, raw.view(getattr(torch, dtype)).reshape(shape)


# --- protocol "torch": SGLang's update_weights_from_distributed


def free_port(host: str) -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def named_rendezvous(host: str, receivers: int, version: int) -> Rendezvous:
    """A rendezvous for `join_named_group` on a free port of `host` (rank 0 listens on it)."""
    tid = uuid.uuid4().hex
    return Rendezvous(host, free_port(host), tid, 1 + receivers, version, f"rlgate-{tid}")


def join_named_group(rdv: Rendezvous, rank: int, backend: str, timeout_s: float) -> Any:
    """A process group of its own, joined as SGLang's `init_weights_update_group` joins one."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(seconds=timeout_s)
    url = f"tcp://{rdv.host}:{rdv.port}"
    store, rank, world = next(rendezvous(url, rank, rdv.world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(rdv.group_name, store)
    params = inspect.signature(_new_process_group_helper).parameters
    options = "backend_options" if "backend_options" in params else "pg_options"
    group, _ = _new_process_group_helper(
        world,
        rank,
        [],
        Backend(backend),
        store,
        group_name=cast(Any, rdv.group_name),  # a str at run time; GroupName is a NewType
        **{options: None},
        timeout=timeout,
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world)}
    return group


def tensor_list(packed: Packed) -> list[list]:
    """(name, dtype, shape) of each tensor, in sending order: what SGLang is told to expect."""
    return [
        [name, dtype, shape] for b in packed.buckets for name, dtype, shape, _, _ in b["tensors"]
    ]


def send_tensors(rdv: Rendezvous, packed: Packed, backend: str, timeout_s: float) -> int:
    """Rank 0 of a named group: broadcast each tensor in order, typed. Returns bytes sent."""
    group = join_named_group(rdv, 0, backend, timeout_s)
    try:
        for _, t in packed.tensors():
            dist.broadcast(t.contiguous(), src=0, group=group)
    finally:
        dist.destroy_process_group(group)
    return packed.nbytes
