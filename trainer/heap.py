"""Hand the C heap's free pages back to the system after a step (glibc's `malloc_trim`).

A train step allocates its activations between long-lived tensors (gradients,
AdamW's moments, a new engine's adapter); once freed, glibc keeps most of that
memory in its heap, where a later long-lived allocation pins it. A worker that
keeps several runs' engines warm then grows by more than what those engines hold:
on SmolLM2 with LoRA engines on one shared base, about 15 MB per engine instead
of its 7.4 MB of tensors, and 100 MB after the first step. `malloc_trim(0)`
returns the free pages (also those inside the heap, by `madvise`); it costs a
walk of the heap, milliseconds against a step's seconds. Elsewhere than glibc
it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

logger = logging.getLogger(__name__)


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc: no malloc_trim
        return None


def release_free_memory() -> bool:
    """Return the heap's free pages to the system; whether it could (glibc only)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
