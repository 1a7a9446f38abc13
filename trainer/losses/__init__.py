"""Policy losses; each returns (loss, metrics)."""

from trainer.losses.ppo import ppo_clip_loss

__all__ = ["ppo_clip_loss"]
