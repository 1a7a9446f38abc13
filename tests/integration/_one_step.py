"""One train step on a resident rank group that lives for that step only.

What the tests compare against the local engine: the group is started from
`checkpoint_dir` (version `version`), runs one `Step`, writes version + 1 to
`out_dir` (and AdamW's state to `optimizer_out`), and is released.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer.batch import Sample
from trainer.config import RunConfig
from trainer.resident import ResidentGroup
from trainer.resident_protocol import Init


def one_step(
    checkpoint_dir: Path,
    version: int,
    cfg: RunConfig | dict[str, Any],
    samples: list[Sample],
    out_dir: Path,
    tokenizer_dir: Path,
    world_size: int,
    *,
    parallel: dict[str, Any] | None = None,
    reference_dir: Path | None = None,
    optimizer_in: Path | None = None,
    optimizer_out: Path | None = None,
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    run = cfg.model_dump(mode="json") if isinstance(cfg, RunConfig) else cfg
    init = Init(
        config={"run": run, "parallel": parallel or {}},
        checkpoint_dir=str(Path(checkpoint_dir).resolve()),
        version=version,
        reference_dir=str(reference_dir) if reference_dir else None,
        optimizer_in=str(optimizer_in) if optimizer_in else None,
    )
    group = ResidentGroup(init, world_size, start_timeout_s=timeout_s)
    try:
        return group.step(samples, out_dir, tokenizer_dir, timeout_s, optimizer_out)
    finally:
        group.release()
