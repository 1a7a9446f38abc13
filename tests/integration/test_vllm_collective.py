"""`weight_sync: collective` on a real vLLM (CPU build): the trainer sends each version over gloo.

Nothing is mocked: the module reuses `test_vllm`'s server (started with
rlgate's worker extension), gateway, worker and float32 transformers
reference. A run with `save_every_steps: 2` trains twice:

- version 1 is only offered (no checkpoint directory when vLLM loads it), so
  it can only have arrived over the collective; greedy output after the
  swap is the greedy output of version 1's weights once they are saved
  (pausing the run writes them), and stored logprobs match a float32
  recomputation of those weights, not of version 0's;
- version 2 is due for a save: its directory exists when it is committed,
  and the served weights again equal it.
"""

from __future__ import annotations

import time
from pathlib import Path

import openai
import pytest

from inference.weight_source import offer_path, saved
from tests.integration.conftest import Stack
from tests.integration.test_vllm import (  # noqa: F401 (fixtures)
    TOL,
    Reference,
    _check_against,
    _checkpoint,
    _stored,
    _wait_served,
    reference,
    stack,
    vllm_url,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800)]


def _train_once(run: dict, step: int) -> None:
    """Two groups of two sampled completions, rewarded: enough for one step."""
    root = run["base_url"].removesuffix("/v1")
    plain = openai.OpenAI(base_url=run["base_url"], api_key=run["api_key"])
    for g in range(2):
        for e in range(2):
            client = openai.OpenAI(
                base_url=f"{root}/groups/s{step}g{g}/episodes/s{step}e{g}-{e}/v1",
                api_key=run["api_key"],
            )
            resp = client.chat.completions.create(
                model="coll",
                messages=[{"role": "user", "content": f"step {step}: count to {g + e}"}],
                max_tokens=12,
                temperature=0.7,
            )
            assert resp.model_extra["policy_version"] == step
            plain.post(
                "/rewards",
                body={"completion_id": resp.id, "reward": float(e)},
                cast_to=object,
            )


def _greedy(st: Stack, run: dict, version: int) -> dict:
    client = openai.OpenAI(base_url=run["base_url"], api_key=run["api_key"])
    resp = client.chat.completions.create(
        model="coll",
        messages=[{"role": "user", "content": "greedy?"}],
        max_tokens=10,
        temperature=0,
    )
    assert resp.model_extra["policy_version"] == version
    (row,) = _stored(st, "id = ?", (resp.id,))
    return row


def _wait_saved(ckpt: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not saved(ckpt):
        assert time.monotonic() < deadline, f"{ckpt} never saved"
        time.sleep(0.3)


def test_collective_weight_sync_on_vllm_cpu(
    stack: Stack,  # noqa: F811
    vllm_url: str,  # noqa: F811
    reference: Reference,  # noqa: F811
) -> None:
    with stack.admin() as admin:
        r = admin.post(
            "/admin/v1/runs",
            json={
                "name": "coll",
                "model": "tiny",
                "backend": "vllm",
                "replicas": [vllm_url],
                "config": {
                    "group_size": 2,
                    "groups_per_step": 2,
                    "micro_batch_size": 2,
                    "learning_rate": 1e-2,  # one step must visibly move the tiny model
                    "weight_sync": "collective",
                    "save_every_steps": 2,
                    "max_pending_episodes": 10**6,
                },
            },
        )
        assert r.status_code == 201, r.text
        run = r.json()
    run_id = run["run_id"]
    base = _checkpoint(stack, run_id, 0)
    g0 = _greedy(stack, run, 0)

    # Version 1: trained, offered, not saved (1 is not a multiple of save_every_steps).
    _train_once(run, 0)
    _wait_served(stack, run_id, 1)
    v1 = _checkpoint(stack, run_id, 1)
    assert not saved(v1), "v1 was written: the swap may have come from disk"
    assert offer_path(v1).is_file()
    with stack.admin() as admin:
        (step0,) = admin.get(f"/admin/v1/runs/{run_id}/steps").json()
        versions = {v["version"]: v for v in admin.get(f"/admin/v1/runs/{run_id}/versions").json()}
    assert step0["status"] == "done" and step0["metrics"]["saved"] == 0.0
    assert versions[1]["checkpoint_available"] is False  # recorded, not yet exportable
    with stack.admin() as admin:
        r = admin.get(f"/admin/v1/runs/{run_id}/versions/1/checkpoint")
    assert r.status_code == 409 and r.json()["error"]["code"] == "checkpoint_not_saved"
    g1 = _greedy(stack, run, 1)

    # Pausing the run writes the version that was only offered.
    with stack.admin() as admin:
        assert admin.post(f"/admin/v1/runs/{run_id}/pause").status_code == 200
    _wait_saved(v1)
    with (
        stack.admin() as admin,
        admin.stream("GET", f"/admin/v1/runs/{run_id}/versions/1/checkpoint") as r,
    ):
        assert r.status_code == 200  # exportable once saved
    assert g1["prompt_token_ids"] == g0["prompt_token_ids"]
    expected = reference.greedy(v1, g1["prompt_token_ids"], 10)
    assert g1["output_token_ids"] == expected[: len(g1["output_token_ids"])]
    assert _check_against(reference, v1, g1) < TOL
    assert _check_against(reference, base, g1) > 10 * TOL  # the weights did change
    for row in _stored(stack, "run_id = ? AND policy_version = 1", (run_id,)):
        assert _check_against(reference, v1, row) < TOL

    # Version 2: due for a save, and offered too.
    with stack.admin() as admin:
        assert admin.post(f"/admin/v1/runs/{run_id}/resume").status_code == 200
    _train_once(run, 1)
    _wait_served(stack, run_id, 2)
    v2 = _checkpoint(stack, run_id, 2)
    assert saved(v2)
    with stack.admin() as admin:
        steps = admin.get(f"/admin/v1/runs/{run_id}/steps").json()
    assert [s["metrics"]["saved"] for s in sorted(steps, key=lambda s: s["step"])] == [0.0, 1.0]
    g2 = _greedy(stack, run, 2)
    assert (
        g2["output_token_ids"]
        == reference.greedy(v2, g2["prompt_token_ids"], 10)[: len(g2["output_token_ids"])]
    )
    assert _check_against(reference, v2, g2) < TOL
    assert _check_against(reference, v1, g2) > 10 * TOL
