"""LoRA serving on the local backend: a batch that mixes adapters equals each row run alone
with peft, and one adapter's swap or unload leaves the others and the base untouched."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from inference.backend import AdapterBackend, BackendError
from inference.chat_template import ChatTemplate
from inference.local import LocalBackend
from inference.lora import AdapterBank, AdapterError, read_adapter
from inference.types import DRAIN, GenerateRequest, SamplingParams

TOL = 1e-5


def _base(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def make_adapter(model_dir: Path, out: Path, seed: int, rank: int, targets: list[str]) -> Path:
    """A peft adapter with random A and B (a fresh one has B = 0 and changes nothing)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
    model = get_peft_model(_base(model_dir), cfg)
    with torch.no_grad():  # large enough that every adapter moves the greedy answer
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return {
        "a": make_adapter(tiny_model_dir, root / "a", 1, 4, every),
        "b": make_adapter(tiny_model_dir, root / "b", 2, 8, ["q_proj", "v_proj", "down_proj"]),
        "a2": make_adapter(tiny_model_dir, root / "a2", 3, 4, every),
    }


@pytest.fixture(scope="module")
def prompts(tiny_model_dir: Path) -> list[list[int]]:
    t = ChatTemplate(tiny_model_dir)
    texts = ["what is one plus two?", "hello", "the quick brown fox", "yes no maybe"]
    return [t.render([{"role": "user", "content": x}]) for x in texts]


def _peft_logprobs(
    model_dir: Path, adapter: Path | None, ids: list[int], n_out: int, merged: bool
) -> torch.Tensor:
    """Logprobs of the last `n_out` tokens of `ids` under base + adapter, with peft alone."""
    from peft import PeftModel

    model = _base(model_dir)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
        if merged:
            model = model.merge_and_unload()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits[:-1], dim=-1)
    picked = logp.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
    return picked[-n_out:]


@pytest.mark.parametrize(
    "rows", [[None, "a", "b", "a"], ["b", "b", "b", "b"]], ids=["mixed", "one-adapter"]
)
def test_a_batch_forward_equals_each_row_alone_with_peft(
    tiny_model_dir: Path,
    adapters: dict[str, Path],
    prompts: list[list[int]],
    rows: list[str | None],
) -> None:
    """Right-padded rows in one forward (several adapters and the base, or one adapter for
    every row, which skips the gather); each row against peft."""
    from peft import PeftModel

    model = _base(tiny_model_dir)
    bank = AdapterBank(model)
    bank.put("a", read_adapter(adapters["a"], model, 1))
    bank.put("b", read_adapter(adapters["b"], model, 7))
    width = max(map(len, prompts))
    ids = torch.zeros((4, width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, : len(p)], mask[i, : len(p)] = torch.tensor(p), 1
    loaded = bank.snapshot(n for n in rows if n is not None)
    with torch.no_grad(), bank.routing([None if n is None else loaded[n] for n in rows]):
        mixed = model(input_ids=ids, attention_mask=mask).logits
    with torch.no_grad():  # outside `routing` the hooks add nothing: the base model
        plain = model(input_ids=ids, attention_mask=mask).logits
    for i, (name, p) in enumerate(zip(rows, prompts, strict=True)):
        ref_model = _base(tiny_model_dir)
        if name is not None:
            ref_model = PeftModel.from_pretrained(ref_model, adapters[name]).eval()
        with torch.no_grad():
            ref = ref_model(input_ids=torch.tensor([p])).logits[0]
        got = mixed[i, : len(p)]
        assert torch.allclose(got, ref, atol=TOL, rtol=0), (name, (got - ref).abs().max())
        if name is not None:
            assert (got - plain[i, : len(p)]).abs().max() > 1e-2  # the adapter did something


@pytest.fixture
async def backend(tiny_model_dir: Path) -> AsyncIterator[LocalBackend]:
    be = LocalBackend(tiny_model_dir, batch_wait_s=0.5)
    try:
        yield be
    finally:
        await be.close()


def _greedy(n: int = 12) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=1.0, seed=5, top_k=1)


async def test_backend_batches_adapters_and_reports_each_rows_version(
    backend: LocalBackend, tiny_model_dir: Path, adapters: dict[str, Path], prompts: list[list[int]]
) -> None:
    assert isinstance(backend, AdapterBackend)
    await backend.load_adapter("run_a", adapters["a"], 3)
    await backend.load_adapter("run_b", adapters["b"], 9)
    assert backend.adapter_version("run_a") == 3 and backend.adapter_version("run_x") is None
    names = [None, "run_a", "run_b", "run_a"]
    results = await asyncio.gather(
        *(
            backend.generate(GenerateRequest(p, _greedy(), adapter=n))
            for p, n in zip(prompts, names, strict=True)
        )
    )
    assert [r.policy_version for r in results] == [0, 3, 9, 3]
    files = {None: None, "run_a": adapters["a"], "run_b": adapters["b"]}
    for p, n, r in zip(prompts, names, results, strict=True):
        for merged in (False, True):  # peft unmerged and merged: the same logprobs
            ref = _peft_logprobs(
                tiny_model_dir, files[n], p + r.output_token_ids, len(r.output_token_ids), merged
            )
            got = torch.tensor(r.output_logprobs)
            assert torch.allclose(got, ref, atol=TOL, rtol=0), (n, merged, (got - ref).abs().max())


async def test_a_swap_replaces_one_adapter_and_unload_fails_only_its_requests(
    backend: LocalBackend, adapters: dict[str, Path], prompts: list[list[int]]
) -> None:
    async def answer(name: str | None) -> tuple[list[int], int]:
        r = await backend.generate(GenerateRequest(prompts[0], _greedy(), adapter=name))
        return r.output_token_ids, r.policy_version

    await backend.load_adapter("run_a", adapters["a"], 1)
    await backend.load_adapter("run_b", adapters["b"], 1)
    base, a1, b1 = await answer(None), await answer("run_a"), await answer("run_b")
    assert len({tuple(base[0]), tuple(a1[0]), tuple(b1[0])}) == 3

    await backend.load_adapter("run_a", adapters["a2"], 2)  # a hot swap of run_a only
    a2 = await answer("run_a")
    assert a2[1] == 2 and a2[0] != a1[0]
    assert await answer("run_b") == b1 and await answer(None) == base

    await backend.unload_adapter("run_a")
    assert backend.adapter_version("run_a") is None
    with pytest.raises(BackendError, match="not loaded"):
        await answer("run_a")
    assert await answer("run_b") == b1 and await answer(None) == base


async def test_a_drain_swap_during_a_batch_returns_at_once_and_serves_from_the_next_batch(
    backend: LocalBackend,
    adapters: dict[str, Path],
    prompts: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The row that is decoding is held at its second token; the drain-mode adapter swap
    must return while it is held, and the held row must still finish on the old adapter,
    every token of it (a row takes its adapter when it joins)."""
    await backend.load_adapter("run_a", adapters["a"], 1)
    request = GenerateRequest(prompts[0], _greedy(), adapter="run_a")
    alone = (await backend.generate(request)).output_token_ids
    held, release = threading.Event(), threading.Event()
    real_step = backend._decode_step

    def hold_decode(batch):  # the first decode step is held
        if not held.is_set():
            held.set()
            release.wait(60)
        return real_step(batch)

    monkeypatch.setattr(backend, "_decode_step", hold_decode)
    try:
        stream = backend.start_stream(request)
        assert await asyncio.to_thread(held.wait, 60), "the row never reached a decode step"
        await asyncio.wait_for(backend.load_adapter("run_a", adapters["a2"], 2, DRAIN), 60)
        assert backend.adapter_version("run_a") == 2
    finally:
        release.set()
    during = await stream.result()
    assert (during.policy_version, during.output_token_ids) == (1, alone)
    assert during.version_starts == ()
    after = await backend.generate(request)
    assert after.policy_version == 2 and after.output_token_ids != alone


async def test_an_adapter_the_base_cannot_serve_is_refused_and_changes_nothing(
    backend: LocalBackend, adapters: dict[str, Path], tiny_model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(BackendError, match="not a PEFT adapter"):
        await backend.load_adapter("run_a", tiny_model_dir, 1)  # a full model, not an adapter
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in adapters["a"].iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(BackendError, match="DoRA"):
        await backend.load_adapter("run_a", bad, 1)
    assert backend.adapter_version("run_a") is None


def test_read_adapter_checks_shapes_against_the_base(
    adapters: dict[str, Path], tiny_model_dir: Path
) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig.from_pretrained(tiny_model_dir)
    cfg.hidden_size, cfg.head_dim = 128, 64  # another base model of the same architecture
    with pytest.raises(AdapterError, match="shapes"):
        read_adapter(adapters["a"], LlamaForCausalLM(cfg), 1)


def test_read_safetensors_reads_what_safetensors_wrote(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from inference.lora import read_safetensors

    tensors = {
        "a.lora_A.weight": torch.randn(8, 64),
        "a.lora_B.weight": torch.randn(64, 8),
        "half": torch.randn(3, 5).to(torch.float16),
        "brain": torch.randn(7).to(torch.bfloat16),
        "empty": torch.empty(0, 4),
    }
    path = tmp_path / "t.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    ours, theirs = read_safetensors(path), load_file(path)
    assert ours.keys() == theirs.keys()
    for name, expected in theirs.items():
        assert ours[name].dtype == expected.dtype and torch.equal(ours[name], expected), name
    path.write_bytes(b"")  # ours are a copy: the file may go away (load_file's map may not)
    assert torch.equal(ours["a.lora_B.weight"], tensors["a.lora_B.weight"])
    save_file({"ints": torch.arange(4)}, path)
    with pytest.raises(AdapterError, match="not a float tensor"):
        read_safetensors(path)
