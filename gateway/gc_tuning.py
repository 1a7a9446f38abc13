"""Garbage-collector settings for a long-running gateway process.

A gateway process imports transformers, torch and their dependencies: millions
of Python objects that live as long as the process. CPython's cyclic collector
walks every tracked object on each full collection, and its default
thresholds (700, 10, 10) run a young collection every 700 net allocations, a
handful of times per request. Under load that walking costs about a third of
the gateway's CPU; freezing the heap after start-up and raising the thresholds
gives it back (the gateway bench, docs/benchmarks/gateway.md). Reference counting still
frees everything without cycles at once; cycles are collected as before, less
often.

Only for server processes (`rlgate.serve`): frozen objects are never collected,
which suits a process that starts once, not a test process that builds many
apps.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)

# Young collections every 20,000 net allocations instead of 700; the older generations as
# CPython scales them (a full collection still waits for a quarter of new long-lived objects).
THRESHOLDS = (20_000, 20, 100)


def tune_for_serving() -> None:
    """Collect once, move every object alive now out of the collector's sight, raise the
    thresholds. Call after start-up and again after loading large things (a model)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
    logger.info("gc: %d start-up objects frozen, thresholds %s", gc.get_freeze_count(), THRESHOLDS)
