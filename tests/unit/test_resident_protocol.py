"""The resident group's wire protocol and node flags, without starting any rank."""

from __future__ import annotations

import socket

import pytest

from core.config import NodeSpec
from rlgate.cli import build_parser
from trainer import resident_protocol as proto


@pytest.mark.parametrize(
    "msg",
    [
        proto.Init({"run": {"engine": "fsdp"}}, "/ckpt/v3", 3, None, "/opt/v3"),
        proto.Ready([11, 12], 3, True),
        proto.Step("/w/samples.pt", "/ckpt/v4", "/base", 3, optimizer_out="/opt/v4"),
        proto.SaveOptimizer("/opt/v4"),
        proto.Shutdown(),
        proto.Done({"loss": 0.5, "version": 4}),
    ],
)
def test_every_message_survives_a_frame(msg: proto.Message) -> None:
    a, b = socket.socketpair()
    with a, b:
        proto.send(a, msg)
        assert proto.recv(b) == msg


def test_frames_arrive_in_order_and_a_closed_stream_is_a_protocol_error() -> None:
    a, b = socket.socketpair()
    with b:
        proto.send(a, proto.Shutdown())
        proto.send(a, proto.Done())
        a.close()
        assert isinstance(proto.recv(b), proto.Shutdown)
        assert isinstance(proto.recv(b), proto.Done)
        with pytest.raises(proto.ProtocolError, match="closed"):
            proto.recv(b)


@pytest.mark.parametrize("raw", [b"{}", b'{"op": "launch"}', b'{"op": "done", "x": 1}', b"[1"])
def test_what_is_not_a_message_is_refused(raw: bytes) -> None:
    with pytest.raises(proto.ProtocolError):
        proto.decode(raw)


def test_one_node_is_standalone_and_several_use_the_c10d_rendezvous() -> None:
    assert NodeSpec().torchrun_args() == ["--standalone"]
    args = NodeSpec(2, 1, "node0:29400").torchrun_args()
    assert "--rdzv-backend=c10d" in args and "--rdzv-endpoint=node0:29400" in args
    assert "--node-rank=1" in args and any("is_host=0" in a for a in args)
    assert any("is_host=1" in a for a in NodeSpec(2, 0, "node0:29400").torchrun_args())
    assert NodeSpec(2, 0, "h:1").local_ranks(8) == 4


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (dict(nnodes=2, node_rank=2, rdzv_endpoint="h:1"), "node_rank"),
        (dict(nnodes=2, node_rank=0), "rdzv_endpoint"),
        (dict(nnodes=0), "node_rank"),
    ],
)
def test_bad_node_flags_name_the_option(spec: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        NodeSpec(**spec)


def test_a_world_size_that_does_not_split_over_the_nodes_is_refused() -> None:
    with pytest.raises(ValueError, match="world_size=3"):
        NodeSpec(2, 0, "h:1").local_ranks(3)


def test_worker_node_flags_parse() -> None:
    args = build_parser().parse_args(
        ["worker", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "h:29400"]
    )
    assert (args.nnodes, args.node_rank, args.rdzv_endpoint) == (2, 1, "h:29400")
    assert args.nproc_per_node is None  # unset: the setting's default applies
