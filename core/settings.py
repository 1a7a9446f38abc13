"""The one settings object for a gateway or a worker, read from RLGATE_* variables once."""

from __future__ import annotations

import ipaddress
import logging
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from core.config import (
    MetricsSinkConfig,
    NodeSpec,
    OverloadConfig,
    QueueConfig,
    ReplicaConfig,
    ServerCredentials,
)

logger = logging.getLogger(__name__)

DEV_ADMIN_KEY = "rlgate-dev-admin-key"

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_Section = TypeVar("_Section", bound="DataclassInstance")


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity API (macOS): every core
        return os.cpu_count() or 1


def is_loopback(host: str) -> bool:
    """Whether a bind address only accepts connections from this machine.

    `localhost` and literal loopback addresses (127.0.0.0/8, ::1) are; wildcards
    (0.0.0.0, ::), any other address and any other host name are not.
    """
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ThreadBudget:
    """Torch intra-op threads for the gateway's local backend and for the train worker."""

    cores: int
    backend: int
    trainer: int


def thread_budget(cores: int, backend: int = 0, trainer: int = 0) -> ThreadBudget:
    """Split `cores` between sampling and training; a 0 is derived, a positive value is kept.

    Derived: the backend gets half the cores (rounded down, at least 1) and the
    trainer the rest, so the two together never exceed `cores` (one core: 1 + 1,
    the least either can run on). On 2 cores that is 1 + 1; the figures behind it
    (decoding on 2 threads is slower than on 1 even alone) are in
    docs/configuration.md.
    """
    cores = max(1, cores)
    if backend <= 0:
        backend = max(1, (cores - trainer) if trainer > 0 else cores // 2)
    if trainer <= 0:
        trainer = max(1, cores - backend)
    return ThreadBudget(cores, backend, trainer)


class Settings(BaseSettings):
    """Built by the CLI or a test and passed down; nothing deeper reads the environment."""

    model_config = SettingsConfigDict(env_prefix="RLGATE_", extra="ignore")

    data_dir: Path = Field(Path("rlgate-data"), description="SQLite file, broker, checkpoints")
    database_url: str = Field("", description="empty: SQLite file in data_dir")
    db_pool_size: int = Field(
        24,
        ge=1,
        le=1000,
        description="PostgreSQL connections each gateway process keeps open; a request past "
        "them waits for one (no connection is opened per request)",
    )
    db_call_pool_size: int = Field(
        8,
        ge=1,
        le=1000,
        description="PostgreSQL: more connections each gateway process keeps for what every "
        "agent call runs (its placement reads, the group commit), in autocommit",
    )
    broker_url: str = Field("", description="empty: embedded filesystem broker; or redis://")
    result_backend: str = Field("", description="empty: same Redis as the broker, or files")
    queue_name: str = "train"
    admin_key: str = Field("", description="admin credential; empty only in dev_mode")
    dev_mode: bool = Field(True, description="allow the development admin key")
    public_url: str = Field("", description="base URL handed to agents; empty: request's")
    metrics_public: bool = Field(
        False, description="serve /metrics without the admin key (then without run ids)"
    )
    inference_api_key: str = Field(
        "", description="sent as 'Authorization: Bearer' to vLLM/SGLang servers; empty: none"
    )
    weight_sync_secret: str = Field(
        "",
        description="shared by the trainer's weight server and its peers; required when "
        "weight_sync_host is not loopback (the embedded stack generates one)",
    )
    model_cache_dir: Path | None = Field(None, description="default: data_dir")
    max_body_bytes: int = Field(4 * 1024 * 1024, description="larger request bodies get 413")
    body_read_timeout_s: float = Field(
        30.0, gt=0, description="a request body must arrive within this; slower: 408, closed"
    )
    max_batch_size: int = Field(
        64, ge=1, description="rows the local backend decodes together at most"
    )
    kv_cache_mb: int = Field(
        4096,
        ge=1,
        description="KV cache of the rows the local backend decodes, at most (MiB); a call "
        "that would exceed it waits, one that alone exceeds it gets 429",
    )
    prefix_cache_mb: int = Field(
        512,
        ge=0,
        description="KV cache of stored prompt prefixes the local backend reuses, at most "
        "(MiB; least recently used out; 0: none)",
    )
    eval_pinned_copies: int = Field(
        1,
        ge=0,
        description="extra full model copies each gateway process may hold for evaluation "
        "calls that pin an older version of a local full-model run; 0: no such pins",
    )
    backend_threads: int = Field(
        0, ge=0, description="torch threads of the gateway's local backend; 0: derived from cores"
    )
    trainer_threads: int = Field(
        0,
        ge=0,
        description="torch threads of the train worker (split over torchrun ranks); 0: derived",
    )
    vllm_python: str = Field("", description="python of vLLM's own venv; empty: the cached one")
    sglang_python: str = Field("", description="python of SGLang's own environment")
    sync_interval_s: float = Field(0.5, gt=0, description="how often to look for new versions")
    gateway_workers: int = Field(
        1,
        ge=1,
        description="gateway processes sharing this store and port (rlgate up "
        "--workers); above 1, runs need a remote backend (vllm, sglang)",
    )
    leader_interval_s: float = Field(
        1.0,
        gt=0,
        description="gateway processes on PostgreSQL: how often each checks or "
        "tries the lock of the one that schedules training (failover within this)",
    )
    auth_cache_ttl_s: float = Field(
        1.0,
        ge=0,
        description="cache agent key -> run lookups this long; writes through this gateway "
        "invalidate at once, others are seen within it; 0: off",
    )
    auth_max_lookups: int = Field(
        4, ge=1, description="store look-ups of uncached agent keys at once, per process"
    )
    full_scan_s: float = Field(
        2.0,
        gt=0,
        description="while nothing changed, re-read a run's open episodes at most this often "
        "(and only once an episode may expire or a group time out, or 60 s passed)",
    )
    step_timeout_s: float = Field(
        1800.0, gt=0, description="resend a train step queued or running longer than this"
    )
    capture_max_batch: int = Field(
        128, ge=1, description="most completions committed in one transaction (group commit)"
    )
    capture_linger_s: float = Field(
        0.0, ge=0, description="wait this long for a batch to fill; 0: batch what arrived"
    )
    capture_synchronous_commit: bool = Field(
        False,
        description="PostgreSQL: an answer also waits for its capture's WAL flush to disk, so "
        "a crash of the database server (not only of the gateway) cannot lose it; off: "
        "the commit is visible at once and on disk within ~0.6 s (docs/deployment.md)",
    )
    replica_health_interval_s: float = Field(
        2.0, gt=0, description="vllm/sglang runs: seconds between replica health checks"
    )
    replica_max_attempts: int = Field(
        3, ge=1, description="replicas tried per request before its error reaches the client"
    )
    replica_sticky_slack: int = Field(
        4, ge=0, description="an episode stays on its replica while at most this much busier"
    )
    replica_drain_timeout_s: float = Field(
        300.0, gt=0, description="rolling swap: wait this long for a replica to go idle"
    )

    # Overload control of sampling calls (gateway/middleware/overload.py, docs/configuration.md).
    overload_max_inflight: int = Field(
        1024,
        ge=0,
        description="sampling calls one gateway process serves at once, at most "
        "(the limit adapts between min and max by event-loop lag); 0: unbounded",
    )
    overload_min_inflight: int = Field(
        64, ge=1, description="the adaptive limit's floor; equal to max_inflight: a fixed limit"
    )
    overload_max_inflight_per_run: int = Field(
        0, ge=0, description="sampling calls of one run at once, per process; 0: unbounded"
    )
    overload_max_inflight_per_backend: int = Field(
        0, ge=0, description="sampling calls on one backend at once, per process; 0: unbounded"
    )
    overload_max_queue: int = Field(
        1024, ge=0, description="calls waiting for a slot, per scope; beyond: 429 at once"
    )
    overload_queue_timeout_s: float = Field(
        30.0, gt=0, description="a waiting call gets 429 after this long without a slot"
    )
    overload_lag_target_ms: float = Field(
        10.0, gt=0, description="event-loop lag above which the adaptive limit shrinks"
    )
    overload_run_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="while other runs wait, the most of a process's slots one run holds "
        "(1: no fair share)",
    )

    # Per-key rate limits and token quotas (gateway/middleware/quotas.py); off without a Redis URL.
    quota_redis_url: str = Field("", description="Redis for per-key quotas; empty: quotas off")
    quota_prefix: str = Field("rlgate:quota:", description="namespace of the quota keys in Redis")
    quota_requests_per_min: int | None = Field(
        None, ge=1, description="default limit for keys without their own; None: unlimited"
    )
    quota_tokens_per_day: int | None = Field(
        None, ge=1, description="default prompt + output tokens per key per UTC day"
    )

    # Resident torchrun ranks for FSDP/Megatron runs (trainer/resident*.py, docs/trainer.md).
    resident_ranks: bool = Field(
        True, description="keep a run's torchrun ranks between steps; false: a group per step"
    )
    resident_idle_s: float = Field(
        600.0, gt=0, description="release a run's resident ranks after this long without a step"
    )
    nnodes: int = Field(1, ge=1, description="worker nodes of a resident group (docs/multinode.md)")
    node_rank: int = Field(0, ge=0, description="this worker's node; 0 takes the Celery tasks")
    rdzv_endpoint: str = Field("", description="HOST:PORT of node 0's c10d rendezvous")
    nproc_per_node: int = Field(
        1, ge=1, description="ranks on a joining node (node_rank > 0); node 0: world_size / nnodes"
    )
    weight_sync_host: str = Field(
        "127.0.0.1",
        description="weight_sync collective: the address of this worker that the gateway and "
        "the inference servers reach its weight server at (docs/weight-sync.md)",
    )

    metrics_dir: Path | None = Field(
        None, description="trainer: also write step metrics as JSON lines (and TensorBoard) here"
    )
    metrics_tensorboard: bool = Field(False, description="trainer: TensorBoard events too")
    metrics_wandb_project: str | None = Field(
        None, description="trainer: log every run to this W&B project (a run may opt out)"
    )
    metrics_mlflow_experiment: str | None = Field(
        None, description="trainer: log every run to this MLflow experiment (a run may opt out)"
    )
    metrics_mlflow_tracking_uri: str = Field(
        "", description="trainer: MLflow store or server; empty: sqlite file mlflow.db in data_dir"
    )

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'rlgate.db').resolve()}"

    @property
    def models_dir(self) -> Path:
        return self.model_cache_dir or self.data_dir

    @property
    def checkpoints_dir(self) -> Path:
        return self.data_dir.resolve() / "checkpoints"

    def threads(self) -> ThreadBudget:
        """`backend_threads` and `trainer_threads`, each 0 derived from this process's cores."""
        return thread_budget(available_cores(), self.backend_threads, self.trainer_threads)

    def resolved_admin_key(self, host: str = "127.0.0.1") -> str:
        """The admin credential for a gateway bound to `host`.

        The development key is published, so it is only ever used on a loopback bind:
        anywhere else an empty `RLGATE_ADMIN_KEY` is an error, dev mode or not.
        """
        if self.admin_key:
            return self.admin_key
        if not self.dev_mode:
            raise ValueError("RLGATE_ADMIN_KEY is empty: set it, or set RLGATE_DEV_MODE=1")
        if not is_loopback(host):
            raise ValueError(
                f"RLGATE_ADMIN_KEY is empty and the gateway would listen on {host!r}, which is "
                f"not a loopback address: the development key {DEV_ADMIN_KEY!r} is public, so "
                "it is refused off loopback. Set RLGATE_ADMIN_KEY, or bind to 127.0.0.1."
            )
        logger.warning("no RLGATE_ADMIN_KEY set: using the development key %r", DEV_ADMIN_KEY)
        return DEV_ADMIN_KEY

    def server_credentials(self) -> ServerCredentials:
        """What the gateway presents to inference servers and the trainer's weight server."""
        return ServerCredentials(self.inference_api_key, self.weight_sync_secret)

    def _section(self, cls: type[_Section], prefix: str, **values: Any) -> _Section:
        """The dataclass `cls` filled from the settings named `prefix` + its field names.

        A field without such a setting keeps the dataclass's default; `values` set the
        fields whose setting needs converting (another unit) or has another name.
        """
        names = {f.name for f in fields(cls)} - values.keys()
        found = {
            n: getattr(self, prefix + n) for n in names if prefix + n in type(self).model_fields
        }
        return cls(**found, **values)

    def replica_config(self) -> ReplicaConfig:
        return self._section(ReplicaConfig, "replica_")

    def check_workers(self) -> None:
        """Several gateway processes share one store: it must be a database server."""
        if self.gateway_workers > 1 and not self.resolved_database_url.startswith("postgresql"):
            raise ValueError(
                f"gateway_workers = {self.gateway_workers} needs RLGATE_DATABASE_URL on "
                "PostgreSQL: the processes share the store (and the embedded local backend "
                "would load one model copy per process); set it, or run one process "
                "(--workers 1)"
            )

    def overload(self) -> OverloadConfig:
        return self._section(
            OverloadConfig, "overload_", lag_target_s=self.overload_lag_target_ms / 1000
        )

    def metrics_sinks(self) -> MetricsSinkConfig:
        return MetricsSinkConfig(
            dir=self.metrics_dir,
            tensorboard=self.metrics_tensorboard,
            wandb_project=self.metrics_wandb_project,
            mlflow_experiment=self.metrics_mlflow_experiment,
            mlflow_tracking_uri=self.metrics_mlflow_tracking_uri
            or f"sqlite:///{self.data_dir.resolve() / 'mlflow.db'}",
        )

    def node(self) -> NodeSpec:
        """This worker's place in a (possibly multi-node) resident group."""
        return NodeSpec(self.nnodes, self.node_rank, self.rdzv_endpoint)

    def queue(self) -> QueueConfig:
        """The queue's fields are settings of the same names."""
        return QueueConfig.model_validate(self, from_attributes=True)
