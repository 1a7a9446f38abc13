"""The `Engine` interface and the one PPO step every training engine runs.

An engine holds the policy of version N and its AdamW, takes one optimizer
step over a batch of samples (`step`), and writes version N+1 (`save`).
Three implementations, picked by `RunConfig.engine` through
`trainer.engines.ENGINES`:

- `local`, `trainer.local_engine.LocalEngine`: the plain HF model in
  `PolicyLogits`, one process, CPU float32; nothing to reduce.
- `fsdp`, `trainer.fsdp_engine.FsdpEngine`: the HF model in `PolicyLogits`,
  `fully_shard`ed per decoder layer and at the root, on every rank; FSDP's
  reduce-scatter SUMS the gradients, counts and metrics are all-reduced,
  the grad norm is taken over the DTensor shards.
- `megatron`, `trainer.megatron_engine.MegatronEngine`: a Megatron-core
  `GPTModel` (GPU only) replicated on every rank; gradients are all-reduced
  (SUM) by hand before clipping, counts and metrics as for FSDP.

`Engine.step`, read top to bottom:

1. Each rank takes its share of the samples (`shard_for_rank`; the whole
   batch on one rank) and cuts those with a gradient into micro-batches
   (`micro_batches`). A `gradient_free` sample (every trained token has
   advantage 0 and no KL or entropy term applies: a zero-variance group
   trained under `zero_variance_groups: train`) counts in the denominators
   but is not forwarded: the gradient is the same, the compute is not spent.
2. The trained-token count and the sample count are all-reduced FIRST, so
   every micro-batch on every rank divides by the same global denominator;
   the sum of the micro-batch losses over ranks is the single-process loss.
3. Ranks run the same number of micro-batches (FSDP's all-gathers are
   collectives): a rank that runs out does a zero-weight dummy pass.
4. Each micro-batch: `forward` (the engine's: logprobs, entropy, reference
   logprobs at the trained positions, `trainer.logprobs`), then
   `trainer.losses.policy.policy_loss` and backward. Its metrics are means
   over its tokens; they are weighted by its share of the global count.
5. `clip_gradients` (the global norm), then `optimizer_step` at the
   schedule's learning rate for this version.

Every engine reports the same metrics (`METRICS`, plus `kl_ref` when the
run has a KL penalty and `adv_*` when any token is trained).

A LoRA run (`RunConfig.lora_rank`, `trainer.lora`) goes through the same
step: the engine loads the base model, `with_adapter` injects version N's
adapter before the engine wraps or shards it, only the adapter's parameters
are trained (`trainable`), the KL reference is the policy with the adapter
switched off, and `save` writes the adapter alone (`save_adapter`).

Optimizer state is saved to, and loaded from, a DIRECTORY on every engine:
`optimizer.pt` inside it for the engines whose ranks hold the full state
(`save_optimizer_file`), `torch.distributed.checkpoint` shards for FSDP
(`trainer.fsdp_checkpoint`).
"""

from __future__ import annotations

import json
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ReduceOp
from torch.distributed.tensor import DTensor

from trainer.batch import Sample
from trainer.config import ParallelConfig, RunConfig
from trainer.logprobs import Forward
from trainer.lora import BaseModelView, attach_lora, is_adapter_dir, save_adapter
from trainer.losses.policy import policy_loss
from trainer.packing import padded_groups
from trainer.parallel import DTYPES, DistInfo, init_distributed
from trainer.shared_base import SharedBases

logger = logging.getLogger(__name__)

# per-micro-batch means of the loss's metrics, weighted back to a global mean
LOSS_METRICS = ("clip_frac", "approx_kl", "ratio_mean", "iw_mean", "entropy")
# what `Engine.step` returns on every engine (kl_ref and adv_* besides, see the docstring)
METRICS = (
    "loss",
    *LOSS_METRICS,
    "grad_norm",
    "tokens",
    "tokens_total",
    "samples_gradient_free",
    "train_seconds",
    "tokens_per_s",
    "ratio_max",
    "micro_batches",
    "world_size",
    "lr",
    "optimizer_resumed",
)
OPTIMIZER_FILE = "optimizer.pt"


def learning_rate(cfg: RunConfig, version: int) -> float:
    """Linear warm-up over the first `lr_warmup_steps` steps, then constant.

    A function of the version (= the step), so a restarted worker resumes the schedule.
    """
    if cfg.lr_warmup_steps <= 0:
        return cfg.learning_rate
    return cfg.learning_rate * min(1.0, (version + 1) / cfg.lr_warmup_steps)


def new_adamw(params: Iterable[nn.Parameter], lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW, with its fused kernel wherever every parameter is a plain tensor.

    The fused kernel (CPU and CUDA) updates a parameter and its two moments in
    one pass. The per-tensor loop that is torch's default on CPU allocates and
    frees a parameter-sized temporary for each of its operations: on a 2-core
    machine that loop was about half of a SmolLM2 train step, the fused one a
    tenth of a second. Both give the same values. FSDP2's DTensor shards keep
    the default loop.
    """
    from torch.distributed.tensor import DTensor

    params = list(params)
    fused = bool(params) and not any(isinstance(p, DTensor) for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused)


def optimizer_step(optimizer: torch.optim.Optimizer, cfg: RunConfig, version: int) -> float:
    """Step at the schedule's learning rate for `version`; returns that rate.

    The rate is set on every param group first: a resumed optimizer state carries the
    rate of the step it was saved at.
    """
    lr = learning_rate(cfg, version)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    return lr


def advantage_stats(samples: list[Sample]) -> dict[str, float]:
    """Mean, std, min and max of the advantages of the trained tokens (empty if none)."""
    values = [a for s in samples for a, m in zip(s.advantages, s.loss_mask, strict=True) if m]
    if not values:
        return {}
    t = torch.tensor(values)
    return {
        "adv_mean": float(t.mean()),
        "adv_std": float(t.std(unbiased=False)),
        "adv_min": float(t.min()),
        "adv_max": float(t.max()),
    }


def shard_for_rank(samples: list[Sample], rank: int, world_size: int) -> list[Sample]:
    """This rank's samples: longest first to the least-loaded rank, then back in input order."""
    load = [0] * world_size
    owner = [0] * len(samples)
    for i in sorted(range(len(samples)), key=lambda i: (-len(samples[i].input_ids), i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += len(samples[i].input_ids)
    return [s for s, r in zip(samples, owner, strict=True) if r == rank]


def trained_tokens(s: Sample) -> int:
    return sum(s.loss_mask[1:])  # position 0 has no predecessor, see trainer.packing


def gradient_free(s: Sample, cfg: RunConfig) -> bool:
    """Whether `s` adds exactly nothing to the gradient: every trained token has advantage
    0 (a zero-variance group, `zero_variance_groups: train`) and no KL or entropy term
    touches it. Such a sample still counts in the step's token denominator, as it does
    in TRL's GRPOTrainer, but is not forwarded."""
    if cfg.kl_coef or cfg.entropy_coef:
        return False
    return not any(a for a, m in zip(s.advantages, s.loss_mask, strict=True) if m)


class Engine(ABC):
    """One PPO step per batch on the policy of `version`; see the module docstring.

    Subclasses supply how a model is loaded and wrapped (`load_model`), the
    micro-batch `forward`, `trained_parameters`, `save` and the optimizer
    state's `save_optimizer` / `load_optimizer`. The single-process defaults
    of `join_group`, `all_reduce`, `clip_gradients` and `close` are what the
    distributed engines override (`DistributedEngine`).
    """

    rank: int = 0
    world_size: int = 1
    optimizer_resumed: bool = False

    def __init__(
        self,
        checkpoint_dir: Path,
        version: int,
        cfg: RunConfig,
        parallel: ParallelConfig | None = None,
        reference_dir: Path | None = None,
        bases: SharedBases | None = None,
    ) -> None:
        """The policy of `version` from the HF directory `checkpoint_dir`, and a fresh AdamW.

        `parallel`: how a distributed engine shards and casts (the local engine
        has nothing to shard). `reference_dir`: the frozen base model, needed
        for the KL penalty (`kl_coef > 0`) and by a LoRA run, whose `checkpoint_dir`
        is an adapter (or, at version 0, the base itself). `bases`: where a LoRA
        run's in-process engine takes its base from, shared with the worker's
        other LoRA engines (`trainer.shared_base`); None: its own copy.
        """
        self.cfg, self.version = cfg, version
        self.bases = bases
        self.parallel = parallel or ParallelConfig()
        self.checkpoint_dir = Path(checkpoint_dir)
        self.join_group()
        if (cfg.kl_coef > 0 or cfg.lora) and reference_dir is None:
            raise ValueError("kl_coef > 0 and LoRA runs need the base model's directory")
        base_dir = Path(reference_dir) if reference_dir is not None else self.checkpoint_dir
        self.seed()
        # A LoRA run loads the base model and puts version N's adapter on it (trainer.lora).
        self.adapter_dir: Path | None = None
        self.peft_model = None  # the PeftModel around the policy's HF model (LoRA runs)
        model_dir = self.checkpoint_dir
        if cfg.lora:
            model_dir = base_dir
            self.adapter_dir = self.checkpoint_dir if is_adapter_dir(self.checkpoint_dir) else None
        self.hf_config = json.loads((model_dir / "config.json").read_text())
        self.pad_id: int = self.hf_config.get("pad_token_id") or 0
        self.policy = self.load_model(model_dir, train=True)
        self.reference: nn.Module | BaseModelView | None = None
        if cfg.kl_coef > 0 and cfg.lora:  # the same weights with the adapter off: no copy
            self.reference = BaseModelView(self.policy, self.peft_model)
        elif cfg.kl_coef > 0:
            self.reference = self.load_model(base_dir, train=False)
        # the rate is a function of the version: optimizer_step sets it on every step
        self.optimizer = new_adamw(
            self.trained_parameters(), lr=learning_rate(cfg, version), weight_decay=cfg.weight_decay
        )

    @abstractmethod
    def load_model(self, model_dir: Path, *, train: bool) -> nn.Module:
        """`model_dir` loaded and wrapped for this engine: the policy, or the frozen reference.

        The policy of a LoRA run gets its adapter (`with_adapter`) before any wrapping.
        """

    def with_adapter(self, lm: nn.Module, *, train: bool) -> nn.Module:
        """`lm` with version N's LoRA adapter injected in place when the run trains one.

        Called by every engine's `load_model` on the bare HF model, before it is
        wrapped or sharded; the base weights are frozen, the adapter's are trained.
        """
        if train and self.cfg.lora:
            self.peft_model = attach_lora(lm, self.cfg, self.adapter_dir)
        return lm

    def save_adapter(
        self, out_dir: Path, tokenizer_dir: Path, state: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Write version N+1 of a LoRA run: the adapter only (`trainer.lora.save_adapter`)."""
        save_adapter(self.peft_model, out_dir, tokenizer_dir, state)

    def trainable(self, params: Iterable[nn.Parameter]) -> Iterable[nn.Parameter]:
        """The parameters of `params` that are trained (a LoRA run: the adapter's only)."""
        return (p for p in params if p.requires_grad)

    @abstractmethod
    def forward(self, chunk: list[Sample]) -> Forward:
        """Logprobs, entropy and reference logprobs of one micro-batch (with grad)."""

    @abstractmethod
    def trained_parameters(self) -> Iterable[nn.Parameter]:
        """The parameters AdamW updates (this rank's shards under FSDP)."""

    @abstractmethod
    def save(self, out_dir: Path, tokenizer_dir: Path) -> None:
        """Write version N+1 as an untied HF directory, atomically. Collective."""

    @abstractmethod
    def save_optimizer(self, state_dir: Path) -> None:
        """Save AdamW's state for the version just trained under `state_dir`. Collective."""

    @abstractmethod
    def load_optimizer(self, state_dir: Path | None) -> bool:
        """Resume AdamW from `state_dir` if it holds the state for this version. Collective."""

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """The whole model's Hugging Face weights in this process, to offer them
        (`weight_sync: collective`). Only an engine that runs inside the worker holds
        them; ranks gather theirs collectively (`trainer.weight_server`)."""
        raise NotImplementedError(f"{type(self).__name__} holds no whole model in one process")

    def join_group(self) -> None:  # noqa: B027 (a hook: one process has no group to join)
        """Join the ranks' process group, before any model is loaded."""

    def seed(self) -> None:
        """Seed every RNG the model uses, from the run's seed and the version."""
        torch.manual_seed(self.cfg.seed + self.version)

    def micro_batches(self, mine: list[Sample]) -> list[list[Sample]]:
        """This rank's samples cut into micro-batches: padded groups of `micro_batch_size`."""
        return padded_groups(mine, self.cfg.micro_batch)

    def all_reduce(self, values: list[float], op: ReduceOp.RedOpType = ReduceOp.SUM) -> list[float]:
        """`values` combined over every rank (one rank: as they are)."""
        return [float(v) for v in values]

    def clip_gradients(self) -> float:
        """Clip to `max_grad_norm`; returns the global norm before clipping."""
        norm = torch.nn.utils.clip_grad_norm_(self.trained_parameters(), self.cfg.max_grad_norm)
        if isinstance(norm, DTensor):  # FSDP: the norm over every rank's shards
            norm = norm.full_tensor()
        return float(norm)

    def close(self) -> None:  # noqa: B027 (a hook: nothing to release on one process)
        """Release what the engine holds beyond memory (a process group)."""

    def dummy_sample(self) -> Sample:
        """A zero-weight sample, for a rank that has run out of micro-batches."""
        return Sample([self.pad_id] * 2, [0, 0], [0.0, 0.0], [0.0, 0.0], [1.0, 1.0], 0)

    def step(self, samples: list[Sample]) -> dict[str, float]:
        """One optimizer step over all ranks' samples, one global denominator."""
        t0 = time.perf_counter()
        cfg = self.cfg
        mine = shard_for_rank(samples, self.rank, self.world_size)
        # Every sample counts in the denominators; only those with a gradient are forwarded.
        computed = [s for s in mine if not gradient_free(s, cfg)]
        groups = self.micro_batches(computed)
        n_tokens, n_seqs, n_total, n_computed, n_free = self.all_reduce(
            [
                sum(map(trained_tokens, mine)),
                len(mine),
                sum(len(s.input_ids) for s in computed),
                sum(map(trained_tokens, computed)),
                len(mine) - len(computed),
            ]
        )
        # At least one pass, a zero-weight one if nothing has a gradient: every parameter
        # then holds a zero gradient and AdamW steps on its moments, as after a full pass.
        (n_micro,) = self.all_reduce([max(len(groups), 1)], op=dist.ReduceOp.MAX)
        denom = max(n_tokens, 1.0)
        metric_denom = max(n_computed, 1.0)  # the loss metrics are means over computed tokens

        self.optimizer.zero_grad(set_to_none=True)
        keys = (*LOSS_METRICS, "kl_ref") if self.reference is not None else LOSS_METRICS
        local = dict.fromkeys(("loss", *keys), 0.0)
        ratio_max = 0.0
        for i in range(int(n_micro)):
            real = i < len(groups)
            fwd = self.forward(groups[i] if real else [self.dummy_sample()])
            # n_tokens / n_sequences are the global counts: one denominator for every rank
            loss, m = policy_loss(
                fwd.logp,
                fwd.batch.old_logprobs,
                fwd.batch.advantages,
                fwd.batch.loss_mask,
                cfg,
                n_tokens=denom,
                n_sequences=max(n_seqs, 1.0),
                ref_logp=fwd.ref_logp,
                entropy=fwd.entropy,
            )
            loss.backward()
            here = float(fwd.batch.loss_mask.sum())
            if real and here > 0:
                local["loss"] += float(loss.detach())
                for k in keys:
                    local[k] += m[k] * here / metric_denom
                ratio_max = max(ratio_max, m["ratio_max"])

        grad_norm = self.clip_gradients()
        lr = optimizer_step(self.optimizer, cfg, self.version)
        self.version += 1
        summed = dict(zip(local, self.all_reduce(list(local.values())), strict=True))
        (ratio_max,) = self.all_reduce([ratio_max], op=dist.ReduceOp.MAX)
        seconds = time.perf_counter() - t0
        return {
            **summed,
            "grad_norm": grad_norm,
            "tokens": n_tokens,
            "tokens_total": n_total,
            "samples_gradient_free": n_free,
            "train_seconds": seconds,
            # every real position is forwarded and back-propagated, prompt included
            "tokens_per_s": n_total / seconds if seconds else 0.0,
            "ratio_max": ratio_max,
            "micro_batches": n_micro,
            "world_size": float(self.world_size),
            "lr": lr,
            "optimizer_resumed": float(self.optimizer_resumed),
            **advantage_stats(samples),  # every rank holds every sample: nothing to reduce
        }


class DistributedEngine(Engine):
    """An engine on every rank of a process group: the reductions and the teardown."""

    dist: DistInfo

    def join_group(self) -> None:
        self.joined(init_distributed(self.parallel.backend))

    def joined(self, info: DistInfo) -> None:
        self.dist = info
        self.rank, self.world_size = info.rank, info.world_size

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the forward runs in (the master weights stay float32)."""
        return DTYPES[self.parallel.param_dtype]

    def all_reduce(self, values: list[float], op: ReduceOp.RedOpType = ReduceOp.SUM) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.dist.device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def close(self) -> None:
        """Leave the process group together (the engine is unusable afterwards).

        The barrier first: gloo can abort a rank whose peers have already torn
        their connections down.
        """
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def save_optimizer_file(optimizer: torch.optim.Optimizer, state_dir: Path, version: int) -> None:
    """Write the full AdamW state for `version` to `state_dir/optimizer.pt`, atomically."""
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = state_dir / (OPTIMIZER_FILE + ".tmp")
    torch.save({"version": version, "state": optimizer.state_dict()}, tmp)
    tmp.replace(state_dir / OPTIMIZER_FILE)


def read_optimizer_file(
    state_dir: Path | None, version: int, map_location: torch.device | str = "cpu"
) -> tuple[dict | None, str]:
    """(AdamW state saved for `version` under `state_dir`, or None; why not, if None)."""
    if state_dir is None:
        return None, "no saved state given"
    path = Path(state_dir) / OPTIMIZER_FILE
    if not path.is_file():
        return None, f"no optimizer state at {path}"
    saved = torch.load(path, map_location=map_location, weights_only=True)
    if saved.get("version") != version:
        return None, f"the state in {path} is for v{saved.get('version')}, not v{version}"
    return saved["state"], ""
