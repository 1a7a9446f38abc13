"""`trainer.heap.release_free_memory` hands freed heap pages back to the system."""

from __future__ import annotations

import ctypes
import os

from trainer.heap import release_free_memory


def _rss_kb() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


def test_freed_small_blocks_under_a_live_one_go_back_to_the_system() -> None:
    # 64 MB in 64 KB blocks (below glibc's mmap threshold: they live in the heap), then one
    # block allocated after them stays live, so the heap cannot shrink from its top alone
    blocks = [ctypes.create_string_buffer(64 * 1024) for _ in range(1024)]
    pin = ctypes.create_string_buffer(64 * 1024)
    del blocks
    before = _rss_kb()
    assert release_free_memory()  # glibc on this machine and in CI
    after = _rss_kb()
    assert before - after > 32 * 1024, (before, after)  # most of the 64 MB came back
    del pin
