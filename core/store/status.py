"""The stored status values of episodes and train steps, and the pseudo-group of ungrouped episodes.

Both enums are `StrEnum`s: a member is the plain string stored in the
`status` column (`EpisodeStatus.OPEN == "open"`), so it binds in queries,
compares with what a row returns and serialises to JSON unchanged.
The migrations store these columns as `String(20)` without defaults, so
they need no edit when a value is added (tests/unit/test_status.py checks
that every value fits).
"""

from __future__ import annotations

from enum import StrEnum


class EpisodeStatus(StrEnum):
    """open -> rewarded -> queued -> trained, or expired / dropped on the way; eval for life.

    A failed or unsent step hands its queued episodes back as rewarded.
    """

    OPEN = "open"  # sampled; waiting for its reward (or more calls)
    REWARDED = "rewarded"  # has its reward; waiting for its group and a step
    QUEUED = "queued"  # assigned to a train step (`episodes.train_step`)
    TRAINED = "trained"  # its step committed a new version
    DROPPED = "dropped"  # never trains: stale, incomplete or zero-variance group
    EXPIRED = "expired"  # open for `episode_timeout_s` without a call or a reward
    # Held out: sampled under an `/eval` prefix, scored per version, never trained. An
    # evaluation episode keeps this status for life, so that no query of the training
    # path (scheduler, admission, expiry, the drop counters) ever selects it.
    EVAL = "eval"


class StepStatus(StrEnum):
    """queued -> running -> done | failed (a failed step is retried under the same number)."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


# Sampled but not yet queued for training: what the scheduler looks at.
PENDING_EPISODE = (EpisodeStatus.OPEN, EpisodeStatus.REWARDED)
# Not consumed yet: a step may still take them (admission counts these; see
# gateway.control.admission). Trained, dropped and expired episodes are consumed.
UNCONSUMED_EPISODE = (EpisodeStatus.OPEN, EpisodeStatus.REWARDED, EpisodeStatus.QUEUED)
# A step the trainer owns: no second one of the run may be enqueued meanwhile.
STEP_IN_FLIGHT = (StepStatus.QUEUED, StepStatus.RUNNING)

# Episodes sent without a group id share this pseudo-group (the batch policy pools them).
UNGROUPED = "~ungrouped"
