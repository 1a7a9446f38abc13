"""Where a worker's ranks sit among the nodes of a resident group: torchrun's node flags."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NodeSpec:
    """Where this worker's ranks sit among the nodes of a group (one node unless told).

    Node 0's worker takes the Celery tasks and owns the group; a node with
    `node_rank > 0` only joins (`trainer.resident_join`). Every node sees the
    same checkpoint and optimizer directories (shared storage, same paths).
    """

    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = ""  # HOST:PORT of torch's c10d rendezvous; node 0 hosts its store
    join_timeout_s: float = 600.0  # how long a rendezvous waits for every node

    def __post_init__(self) -> None:
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes): {self.node_rank} of {self.nnodes}")
        if self.nnodes > 1 and ":" not in self.rdzv_endpoint:
            raise ValueError("nnodes > 1 needs rdzv_endpoint HOST:PORT (node 0's address)")

    def local_ranks(self, world_size: int) -> int:
        """Ranks on each node for a group of `world_size` in all."""
        if world_size % self.nnodes:
            raise ValueError(f"world_size={world_size} does not split over nnodes={self.nnodes}")
        return world_size // self.nnodes

    def torchrun_args(self) -> list[str]:
        """torchrun's node and rendezvous flags; `--standalone` on one node."""
        if self.nnodes == 1:
            return ["--standalone"]
        return [
            f"--nnodes={self.nnodes}",
            f"--node-rank={self.node_rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.rdzv_endpoint}",
            "--rdzv-id=rlgate-resident",
            # node 0 hosts the rendezvous store whatever the endpoint's name resolves to
            f"--rdzv-conf=is_host={int(self.node_rank == 0)},"
            f"join_timeout={self.join_timeout_s:.0f}",
            "--max-restarts=0",
        ]
