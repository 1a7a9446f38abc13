"""Request and response models of the admin API beyond run creation and keys."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from core.store.episodes import EpisodeFilter
from core.store.status import EpisodeStatus
from trainer.config import POLICY_NAME, PolicySpec

INT32_MAX = 2**31 - 1  # integer query values are stored or compared as 32-bit columns

# Config knobs the gateway and the scheduler read afresh on every pass, so a change takes
# effect at the next scheduling decision. Loss and optimizer knobs are not here: a worker
# keeps a warm engine built from the config it started with.
LIVE_CONFIG_KEYS = frozenset(
    {
        "groups_per_step",
        "max_staleness",
        "max_pending_episodes",
        "admission_wait_s",
        "zero_variance_groups",
        "episode_timeout_s",
        "group_timeout_s",
        "incomplete_groups",
        "reward_min",
        "reward_max",
        "keep_checkpoints",
        "prefix_match_window_s",
        "eval_keep_episodes",
        "eval_retention_s",
    }
)


class RunUpdate(BaseModel):
    """PATCH body: a new name and/or config knobs from `LIVE_CONFIG_KEYS`."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, min_length=1, max_length=200)
    config: dict[str, Any] = Field(
        default_factory=dict, description="knobs safe to change live; others get 400"
    )


class PolicyCreate(PolicySpec):
    """POST body of a policy added to a live run: its name and LoRA settings (each unset
    field takes the run's)."""

    name: str = Field(pattern=POLICY_NAME)


class RunDeleted(BaseModel):
    run_id: str
    deleted: bool = True


class PolicyVersionPublic(BaseModel):
    version: int
    created_at: str
    checkpoint_available: bool
    # The train step that produced it (None for version 0 and for rollbacks).
    step: int | None = None
    rolled_back_from: int | None = None
    served: bool = False
    reward_mean: float | None = None
    loss: float | None = None
    metrics: dict[str, Any] = {}


class RollbackResult(BaseModel):
    run_id: str
    version: int  # the new version N+1
    rolled_back_from: int


class EpisodeSummary(BaseModel):
    episode_id: str
    group_id: str
    status: str
    reward: float | None
    train_step: int | None
    turns: int
    versions: list[int]  # every version that sampled a token of it, ascending
    created_at: str
    sampled_tokens: int = 0  # over all turns
    drift: bool = False  # some turn's prompt drifted from the chat template's rendering


class EpisodeQuery(BaseModel):
    """`GET /admin/v1/runs/{run_id}/episodes`' query: one page, newest first, filtered.

    `after`: the previous page's last episode id. `version`: episodes with a turn sampled
    by that policy version; `length_*`: tokens sampled over all turns; `drift`: a turn had
    template drift (or none did).
    """

    status: EpisodeStatus | None = None
    reward_min: float | None = Field(None, allow_inf_nan=False)
    reward_max: float | None = Field(None, allow_inf_nan=False)
    version: int | None = Field(None, ge=0, le=INT32_MAX)
    limit: int = Field(50, ge=1, le=500)
    after: str | None = Field(None, max_length=100)
    group_id: str | None = Field(None, min_length=1, max_length=100)
    length_min: int | None = Field(None, ge=0, le=INT32_MAX)
    length_max: int | None = Field(None, ge=0, le=INT32_MAX)
    drift: bool | None = None

    def episodes(self) -> EpisodeFilter:
        """The store's filter of the episodes this query keeps."""
        return EpisodeFilter(**self.model_dump(exclude={"limit", "after"}))


class EpisodePage(BaseModel):
    object: Literal["list"] = "list"
    data: list[EpisodeSummary]
    has_more: bool


class TokenView(BaseModel):
    id: int
    text: str
    logprob: float | None = None  # None for prompt (context) tokens
    trained: bool  # whether the loss was taken on this token
    version: int | None = None  # the policy version that sampled it; None for prompt tokens


class CompletionDetail(BaseModel):
    completion_id: str
    parent_id: str | None
    messages: list[Any]
    content: str
    tool_calls: list[Any] | None
    finish_reason: str
    policy_version: int  # the oldest version among its tokens (the first token's)
    # [[token index, version], ...] where each version began when a keep-mode swap happened
    # while it was sampled; null: every token by policy_version. `versions`: all of them.
    version_starts: list[list[int]] | None = None
    versions: list[int] = []
    reward: float | None
    drift: bool
    spliced: bool
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    output_logprobs: list[float]
    loss_mask: list[int]  # over prompt + output
    prompt_tokens: list[TokenView]
    output_tokens: list[TokenView]
    created_at: str
    policy: str | None = None  # the policy that sampled it (docs/policies.md)


class EpisodeDetail(EpisodeSummary):
    completions: list[CompletionDetail]


class TurnAdvantage(BaseModel):
    """One turn of a group member: what it sampled and the advantage its tokens get."""

    completion_id: str
    policy_version: int
    content: str
    output_tokens: int
    finish_reason: str
    reward: float | None  # a per-turn reward post, if any
    turn_return: float | None  # G_c under the run's reward_policy; None: not trained toward
    advantage: float | None  # None: no reward yet, or the turn is not trained toward anything


class GroupMember(EpisodeSummary):
    episode_return: float | None  # the number the group normalises; None without a reward
    advantage: float | None  # the episode's own return, normalised within its peers
    peers: int  # returns normalised together: members in the same train step (or all pending)
    turns_detail: list[TurnAdvantage]


class GroupDetail(BaseModel):
    """A group's episodes side by side with the advantages the trainer computes for them."""

    run_id: str
    group_id: str
    advantage_estimator: str
    reward_policy: str
    episodes: list[GroupMember]


class MetricPoint(BaseModel):
    step: int
    version: int
    time: str | None
    values: dict[str, float | None]


class MetricSeries(BaseModel):
    run_id: str
    names: list[str]
    points: list[MetricPoint]


class CountersPublic(BaseModel):
    run_id: str
    template_drift: int
    dropped: dict[str, int]
    episodes_by_status: dict[str, int]
    counters: dict[str, Any]


class ThreadsStatus(BaseModel):
    """The torch thread budget (`RLGATE_BACKEND_THREADS`, `RLGATE_TRAINER_THREADS`)."""

    cores: int  # cores this gateway may run on (its affinity mask)
    backend_threads: int  # budget of the local backend
    trainer_threads: int  # budget of the train worker (its own process reads the same settings)
    backends: dict[str, int]  # run id -> torch threads its loaded local backend samples on


class WorkersStatus(BaseModel):
    broker: str
    workers: dict[str, Any]  # worker name -> {active, reserved, ...}
    reachable: bool
    queue: str
    queue_depth: int | None  # messages waiting in the broker, when it can be asked
    pending_steps: int  # train steps queued or running in the store
    error: str | None = None
    threads: ThreadsStatus | None = None  # torch threads of sampling and training


class KeyLimits(BaseModel):
    """`null` means unlimited (a key with no limits of its own uses the server defaults)."""

    model_config = ConfigDict(extra="forbid")

    requests_per_min: int | None = Field(None, ge=1, le=10**9)
    tokens_per_day: int | None = Field(None, ge=1, le=10**15)


class KeyQuota(KeyLimits):
    key_id: int
    requests_this_min: int
    tokens_today: int


class EvalRow(BaseModel):
    """A version's held-out figures: its scored evaluation episodes and their mean reward."""

    version: int
    episodes: int
    mean_reward: float
    stderr: float | None  # sample std / sqrt(episodes); null under two episodes


class EvalSpanning(BaseModel):
    """Evaluation episodes whose tokens came from more than one version (a swap mid-episode)."""

    episodes: int
    mean_reward: float
    stderr: float | None


class EvalFiguresList(BaseModel):
    object: Literal["list"] = "list"
    run_id: str
    data: list[EvalRow]  # ascending version; versions with no scored episode are absent
    spanning: EvalSpanning | None  # null: no scored episode spans a swap
