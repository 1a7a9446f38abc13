"""Typed configuration of a run: its algorithm, parallelism, LoRA and trackers."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from inference.types import SwapPolicy


class ParallelConfig(BaseModel):
    """How the FSDP engine shards, casts and batches. Defaults suit CPU (gloo, float32)."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="auto: nccl when CUDA is available, else gloo"
    )
    param_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="compute dtype of the all-gathered params (master copy stays fp32)"
    )
    reduce_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="dtype of the gradient reduce-scatter"
    )
    reshard_after_forward: bool = Field(True, description="free gathered params after forward")
    activation_checkpointing: bool = Field(False, description="recompute each decoder layer")
    packing: bool = Field(True, description="pack samples into one row; False: padded collate")
    pack_tokens: int = Field(1024, ge=1, description="token budget of one packed micro-batch")
    attn_implementation: Literal["sdpa", "eager"] = Field(
        "sdpa", description="attention kernel; both accept the packed 4D mask"
    )


# Every linear layer of a Llama-like decoder block's attention and MLP.
LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class TrackingConfig(BaseModel):
    """Which experiment trackers a run's step metrics also go to (see docs/tracking.md).

    Each `None` defers to the worker's settings (`RLGATE_METRICS_WANDB_PROJECT`,
    `RLGATE_METRICS_MLFLOW_EXPERIMENT`); a project or experiment name alone turns
    its tracker on for this run.
    """

    model_config = ConfigDict(extra="forbid")

    wandb: bool | None = Field(None, description="log to W&B; None: as the worker is set")
    wandb_project: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        pattern=r"^[^/\\#?%:]+$",
        description="W&B project; None: the worker's, else 'rlgate'",
    )
    mlflow: bool | None = Field(None, description="log to MLflow; None: as the worker is set")
    mlflow_experiment: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="MLflow experiment name; None: the worker's, else 'rlgate'",
    )

    @model_validator(mode="after")
    def _check(self) -> TrackingConfig:
        if self.wandb is False and self.wandb_project is not None:
            raise ValueError("wandb_project is set but wandb is false: drop one of them")
        if self.mlflow is False and self.mlflow_experiment is not None:
            raise ValueError("mlflow_experiment is set but mlflow is false: drop one of them")
        return self


# A policy's name: the part after the last "/" of a call's `model` (`<run name>/<policy>`).
POLICY_NAME = r"^[a-z0-9_-]{1,64}$"
MAX_POLICIES = 64


class PolicySpec(BaseModel):
    """One trainable policy of a run: a LoRA adapter on the run's base with its own optimizer
    and versions (docs/policies.md). Each unset field takes the run's value."""

    model_config = ConfigDict(extra="forbid")

    lora_rank: int | None = Field(None, ge=1, le=256)
    lora_alpha: float | None = Field(None, gt=0)
    lora_target_modules: list[str] | None = Field(None, min_length=1)
    lora_dropout: float | None = Field(None, ge=0, lt=1)
    learning_rate: float | None = Field(None, gt=0)


class RunConfig(BaseModel):
    """Per-run knobs, stored with the run and read by the scheduler and the trainer."""

    model_config = ConfigDict(extra="forbid")  # a typo in a knob is an error, not a default

    group_size: int = Field(4, ge=2, description="episodes per GRPO group (>= 2 to normalise)")
    groups_per_step: int = Field(8, ge=1, description="groups in one optimizer step")
    max_staleness: int = Field(
        1, ge=0, description="drop samples more than this many versions older than current"
    )
    learning_rate: float = Field(1e-5, gt=0)
    lr_warmup_steps: int = Field(0, ge=0, description="linear warm-up steps, then constant")
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    clip_eps_low: float = Field(0.2, gt=0, lt=1, description="PPO clip below 1")
    clip_eps_high: float = Field(0.2, gt=0, description="PPO clip above 1 (DAPO raises it)")
    adv_eps: float = Field(1e-6, gt=0, description="added to the group std")
    micro_batch_size: int | None = Field(
        None,
        ge=1,
        description="samples per padded micro-batch; None: min(8, group_size x groups_per_step)",
    )
    loss_agg: Literal["token_mean", "seq_mean", "constant"] = "token_mean"
    constant_normaliser: int | None = Field(
        None, ge=1, description="tokens per sequence for loss_agg='constant' (Dr.GRPO)"
    )
    advantage_estimator: Literal["grpo", "drgrpo", "rloo"] = "grpo"
    behaviour_weight_cap: float | None = Field(
        None, gt=1, description="decoupled PPO: cap on pi_prox / pi_behaviour; None: plain PPO"
    )
    kl_coef: float = Field(0.0, ge=0, description="KL penalty to the frozen base model")
    kl_estimator: Literal["k1", "k3"] = "k3"
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus")
    keep_checkpoints: int = Field(2, ge=1, description="newest versions kept on disk (v0 kept)")
    save_optimizer_state: bool = Field(
        False, description="keep AdamW's moments on disk so a restarted worker resumes them"
    )
    max_pending_episodes: int | None = Field(
        None,
        ge=1,
        description="admission capacity override: at most this many unconsumed episodes "
        "(None: (max_staleness + 1) x group_size x groups_per_step; see docs/rewards.md)",
    )
    admission_wait_s: float = Field(
        120.0,
        ge=0,
        le=500,
        description="how long a new conversation over capacity is held before a 429 "
        "(Retry-After 60); under the openai SDK's 600 s timeout",
    )
    # --- how rewards reach tokens (see trainer.returns)
    reward_policy: Literal["broadcast", "terminal", "discounted"] = "broadcast"
    gamma: float = Field(1.0, gt=0, le=1, description="discount per turn (discounted policy)")
    reward_min: float | None = Field(None, description="rewards below this get 422")
    reward_max: float | None = Field(None, description="rewards above this get 422")
    train_orphans: bool = Field(False, description="also train retried turns nobody continued")
    # --- episodes and groups
    prefix_match_window_s: float = Field(
        3600.0, gt=0, description="how far back a call without ids may link to a completion"
    )
    episode_timeout_s: float = Field(
        3600.0,
        gt=0,
        description="an episode without a reward this long after its last call expires",
    )
    group_timeout_s: float = Field(
        600.0, gt=0, description="a group still short of group_size after this is incomplete"
    )
    incomplete_groups: Literal["train", "drop"] = Field(
        "train", description="train an incomplete group's rewarded episodes (>= 2) or drop them"
    )
    zero_variance_groups: Literal["skip", "train"] = Field(
        "train",
        description="train: a group whose rewards are all equal takes its place in the step "
        "with zero advantage (as in TRL's GRPOTrainer: one optimizer step per groups_per_step "
        "groups sampled; the engine does not forward it); skip: drop it, and wait for "
        "groups_per_step groups whose rewards differ",
    )
    # --- evaluation episodes (under /eval): how many are kept (gateway.control.eval_retention)
    eval_keep_episodes: int = Field(
        10000,
        ge=1,
        description="the newest evaluation episodes kept (by first call); older ones are deleted "
        "with their completions and rewards once quiet for 5 minutes",
    )
    eval_retention_s: float | None = Field(
        None,
        gt=0,
        description="also delete evaluation episodes quiet (no call, no reward) for this long; "
        "None: no age limit",
    )
    tool_parser: str = Field("hermes", description="how tool calls are read from sampled text")
    reasoning_parser: Literal["none", "think"] = Field(
        "none", description="think: return <think>...</think> as reasoning_content"
    )
    # --- the training engine (see docs/trainer.md)
    engine: Literal["local", "fsdp", "megatron"] = Field(
        "local",
        description="local: one process; fsdp: FSDP2 over torchrun ranks; "
        "megatron: Megatron-core over torchrun ranks (GPU only, extra [megatron])",
    )
    world_size: int = Field(
        1, ge=1, description="torchrun ranks per step (engine='fsdp' or 'megatron')"
    )
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    # --- how new weights reach the inference servers (see docs/weight-sync.md)
    weight_sync: Literal["disk", "collective"] = Field(
        "disk",
        description="disk: every version is written and the servers reload it; collective: "
        "the trainer sends it over a process group the servers join (vllm/sglang backends)",
    )
    swap_mode: Literal["keep", "drain"] = Field(
        "keep",
        description="keep: a swap pauses generations between two tokens and they go on with "
        "the new version (each token records its own); drain: new calls wait while those "
        "in flight finish on the old version (docs/backends.md)",
    )
    swap_clear_kv: bool = Field(
        True,
        description="keep: recompute a paused generation's KV cache with the new weights "
        "(true, as AReaL does), or keep the old weights' KV (false: faster, PipelineRL-style)",
    )
    save_every_steps: int = Field(
        10,
        ge=1,
        description="collective: write the checkpoint every this many versions (and always on "
        "pause, stop and worker shutdown); disk writes every version",
    )
    # --- where step metrics also go (trainer.metrics_sinks); None fields defer to the worker
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    seed: int = 0
    # --- LoRA: train an adapter on the frozen, shared base model (see docs/lora.md)
    lora_rank: int | None = Field(
        None, ge=1, le=256, description="LoRA rank; None: full fine-tuning of every weight"
    )
    lora_alpha: float | None = Field(
        None, gt=0, description="LoRA scale numerator (scale = alpha / rank); None: 2 x rank"
    )
    lora_target_modules: list[str] | None = Field(
        None,
        min_length=1,
        description="names of the Linear layers that get an adapter; None: every linear "
        f"layer of the attention and MLP blocks ({', '.join(LORA_DEFAULT_TARGETS)})",
    )
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input")
    # --- several trainable policies in one agent (see docs/policies.md)
    policies: dict[str, PolicySpec] | None = Field(
        None,
        description="named policies, each a LoRA adapter with its own versions; an agent picks "
        "one per call with model '<run name>/<policy>'; None: the run is one policy",
    )

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        if self.micro_batch_size is not None and self.micro_batch_size > self.batch_size:
            raise ValueError("micro_batch_size exceeds the batch: lower micro_batch_size")
        if (
            self.reward_min is not None
            and self.reward_max is not None
            and self.reward_min > self.reward_max
        ):
            raise ValueError("reward_min is above reward_max: swap or widen them")
        from inference.tool_parsers import parser_names

        if self.tool_parser not in parser_names():
            raise ValueError(f"tool_parser must be one of {parser_names()}")
        if self.loss_agg == "constant" and self.constant_normaliser is None:
            raise ValueError("loss_agg='constant' needs constant_normaliser (a token budget)")
        if self.advantage_estimator == "drgrpo" and self.loss_agg != "constant":
            raise ValueError(
                "Dr.GRPO removes length normalisation: set loss_agg='constant' "
                "and constant_normaliser"
            )
        if self.world_size > 1 and self.engine == "local":
            raise ValueError("world_size > 1 needs engine='fsdp' or engine='megatron'")
        if self.engine == "megatron" and self.parallel.backend == "gloo":
            raise ValueError("engine='megatron' runs on NCCL only: set parallel.backend to 'auto'")
        if self.gamma != 1.0 and self.reward_policy != "discounted":
            raise ValueError("gamma only applies to reward_policy='discounted': set both")
        if self.weight_sync == "collective" and (self.lora or self.engine == "megatron"):
            raise ValueError(
                "weight_sync 'collective' sends full weights from engine 'local' or 'fsdp': "
                "use 'disk' for LoRA adapters and megatron"
            )
        self._check_lora()
        self._check_policies()
        return self

    def _check_policies(self) -> None:
        if self.policies is None:
            return
        if not 1 <= len(self.policies) <= MAX_POLICIES:
            raise ValueError(f"policies takes 1 to {MAX_POLICIES} named policies")
        for name in self.policies:
            if not re.fullmatch(POLICY_NAME, name):
                raise ValueError(f"policies: {name[:80]!r} is not a policy name ([a-z0-9_-]+)")
        for name in self.policies:
            self.policy_config(name)  # each policy's own settings must hold too

    def policy_config(self, name: str) -> RunConfig:
        """The configuration policy `name` trains under: the run's, with the policy's own
        LoRA settings and learning rate; a policy is always a LoRA adapter."""
        assert self.policies is not None and name in self.policies
        own = self.policies[name].model_dump(exclude_none=True)
        merged = self.model_dump() | own | {"policies": None}
        if merged["lora_rank"] is None:
            raise ValueError(
                f"policies: {name!r} has no lora_rank: each policy is a LoRA adapter, "
                "set lora_rank on the run or on the policy"
            )
        return RunConfig.model_validate(merged)

    def _check_lora(self) -> None:
        if self.lora_rank is None:
            for name in ("lora_alpha", "lora_target_modules"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} needs lora_rank: set lora_rank to train an adapter")
            if self.lora_dropout:
                raise ValueError("lora_dropout needs lora_rank: set lora_rank to train an adapter")
            return
        if self.engine == "megatron":
            raise ValueError("lora_rank needs engine='local' or 'fsdp' (megatron: full weights)")
        if self.lora_target_modules is not None and any(
            not m or not m.replace("_", "").replace(".", "").isalnum()
            for m in self.lora_target_modules
        ):
            raise ValueError("lora_target_modules takes module names such as 'q_proj'")

    @property
    def swap_policy(self) -> SwapPolicy:
        """How the run's hot swaps treat generations in flight (`swap_mode`, `swap_clear_kv`)."""
        return SwapPolicy(mode=self.swap_mode, clear_kv=self.swap_clear_kv)

    @property
    def batch_size(self) -> int:
        """Samples in one step: `group_size` x `groups_per_step`."""
        return self.group_size * self.groups_per_step

    @property
    def micro_batch(self) -> int:
        """`micro_batch_size`, or when left unset the batch itself capped at 8, so that the
        default never exceeds the batch of a small run."""
        if self.micro_batch_size is not None:
            return self.micro_batch_size
        return min(8, self.batch_size)

    @property
    def lora(self) -> bool:
        """Whether the run trains a LoRA adapter instead of every weight."""
        return self.lora_rank is not None

    def resolved_lora_alpha(self) -> float:
        """lora_alpha, or its default 2 x lora_rank."""
        return self.lora_alpha if self.lora_alpha is not None else 2.0 * (self.lora_rank or 0)

    def resolved_lora_targets(self) -> list[str]:
        return list(self.lora_target_modules or LORA_DEFAULT_TARGETS)
