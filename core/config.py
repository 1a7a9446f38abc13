"""The typed configs of the components that `Settings` builds, one per component.

They live in the core so that `core.settings` builds them without importing the
component (the gateway, a backend or the trainer); each component imports its own
config from here. Cross-field checks raise `ValueError` naming the option to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, Field


@dataclass(frozen=True)
class ServerCredentials:
    """What the gateway presents to an inference server and to the trainer's weight server.

    Both sit on the deployment's private network; these keep a stranger who reaches
    it anyway from sampling or taking weights (docs/security.md).
    """

    api_key: str = ""  # the servers' --api-key (RLGATE_INFERENCE_API_KEY); empty: none
    weight_sync_secret: str = ""  # the trainer's weight server's (RLGATE_WEIGHT_SYNC_SECRET)

    def __repr__(self) -> str:  # never the secrets themselves in a log line
        fields = (("api_key", self.api_key), ("weight_sync_secret", self.weight_sync_secret))
        return f"ServerCredentials(set={[name for name, value in fields if value]})"

    def headers(self) -> dict[str, str]:
        """What every request to the inference server carries."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class ReplicaConfig:
    """How an `inference.replicas.ReplicaSet` routes, checks and reloads its replicas."""

    health_interval_s: float = 2.0  # seconds between background health checks
    health_timeout_s: float = 5.0  # a health call slower than this counts as a failure
    max_attempts: int = 3  # replicas tried per request before its error reaches the caller
    sticky_slack: int = 4  # an episode stays on its replica while at most this much busier
    drain_timeout_s: float = 300.0  # rolling swap: wait this long for a replica to go idle
    max_affinities: int = 100_000  # episodes remembered for stickiness (least recent dropped)
    load_retry_s: float = 30.0  # a replica that failed to load a version retries it after this

    def __post_init__(self) -> None:
        if self.health_interval_s <= 0 or self.health_timeout_s <= 0:
            raise ValueError("health_interval_s and health_timeout_s must be > 0")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.sticky_slack < 0:
            raise ValueError("sticky_slack must be >= 0")


@dataclass(frozen=True)
class OverloadConfig:
    """Bounds of `gateway.middleware.overload`; a 0 limit or queue means unbounded."""

    max_inflight: int = 1024  # the process's adaptive limit, at most
    min_inflight: int = 64  # ... and at least (= max_inflight: a fixed limit)
    max_inflight_per_run: int = 0  # calls of one run at once
    max_inflight_per_backend: int = 0  # calls on one backend at once
    max_queue: int = 1024  # waiters per scope; beyond it a call is answered 429 at once
    queue_timeout_s: float = 30.0  # a waiter without a slot after this long gets 429
    lag_target_s: float = 0.010  # event-loop lag above which the adaptive limit shrinks
    tick_s: float = 0.05  # how often the adaptive limit is adjusted
    run_share: float = 0.5  # while other runs wait, one run's most of a shared scope's slots

    def __post_init__(self) -> None:
        if self.max_inflight and self.min_inflight > self.max_inflight:
            raise ValueError("overload_min_inflight exceeds overload_max_inflight: lower it")
        if not 0 < self.run_share <= 1:
            raise ValueError("overload_run_share must be in (0, 1]: 1 turns fair share off")


class QueueConfig(BaseModel):
    """Where train steps are queued. Empty broker URL: the embedded filesystem broker."""

    broker_url: str = Field("", description="empty: kombu's filesystem broker; or redis://")
    result_backend: str = Field("", description="empty: the Redis broker, or files in data_dir")
    data_dir: Path = Field(Path("rlgate-data"), description="the file broker's and results' root")
    queue_name: str = Field("train", description="the Celery queue train steps go to")
    # The gateway resends a step running longer than this (Settings.step_timeout_s); the
    # broker must not redeliver it sooner on its own (`visibility_timeout_s`).
    step_timeout_s: float = Field(1800.0, description="a step running longer is resent")

    def visibility_timeout_s(self) -> float:
        """How long Redis waits for an unacknowledged task before redelivering it: past the
        step timeout with a margin (twice it, at least 5 minutes more), so a step still
        running is resent only by the gateway's own timeout, never also by the broker
        (Celery's default is 1 h whatever the step timeout)."""
        return max(2 * self.step_timeout_s, self.step_timeout_s + 300.0)

    def resolved_broker(self) -> str:
        return self.broker_url or "filesystem://"

    def resolved_backend(self) -> str:
        if self.result_backend:
            return self.result_backend
        if self.broker_url.startswith("redis"):
            return self.broker_url
        return f"file://{(self.data_dir / 'celery-results').resolve()}"


class MetricsSinkConfig(BaseModel):
    """A worker's sinks; the W&B and MLflow ones are defaults that a run's config may override."""

    dir: Path | None = Field(None, description="root of the JSONL (and TensorBoard) logs")
    tensorboard: bool = Field(False, description="also write TensorBoard events under dir")
    wandb_project: str | None = Field(None, description="log every run to this W&B project")
    mlflow_experiment: str | None = Field(
        None, description="log every run to this MLflow experiment"
    )
    mlflow_tracking_uri: str = Field(
        "", description="MLflow store or server (sqlite:///..., http://...); empty: MLflow's own"
    )


@dataclass(frozen=True)
class NodeSpec:
    """Where this worker's ranks sit among the nodes of a group (one node unless told).

    Node 0's worker takes the Celery tasks and owns the group; a node with
    `node_rank > 0` only joins (`trainer.resident_join`). Every node sees the
    same checkpoint and optimizer directories (shared storage, same paths).
    """

    nnodes: int = 1  # worker nodes of the group
    node_rank: int = 0  # this worker's node; 0 takes the Celery tasks
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
