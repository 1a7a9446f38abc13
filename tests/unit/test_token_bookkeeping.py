"""Token-exact bookkeeping: template, samples, collation, and the trainer's logprobs.

The key check is the last one: the logprobs the inference backend reports for
the tokens it sampled are the logprobs the trainer recomputes for the same
sequence, so the PPO ratio of a fresh sample starts at exactly 1.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from core.store.models import Completion
from inference.chat_template import ChatTemplate
from inference.local import LocalBackend
from inference.types import GenerateRequest, SamplingParams
from trainer.batch import collate, sample_from_completion
from trainer.config import RunConfig
from trainer.local_engine import LocalEngine
from trainer.losses.ppo import ppo_clip_loss

MESSAGES = [
    {"role": "system", "content": "reply with only the number."},
    {"role": "user", "content": "what is one plus two?"},
]


@pytest.fixture(scope="module")
def template(tiny_model_dir: Path) -> ChatTemplate:
    return ChatTemplate(tiny_model_dir)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LocalEngine:
    return LocalEngine(tiny_model_dir, 0, RunConfig())


def _completion(prompt, output, logprobs, temperature=1.0, version=0) -> Completion:
    return Completion(
        id="chatcmpl-x",
        run_id="run_x",
        episode_id="ep",
        messages=[],
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        output_logprobs=list(logprobs),
        content="",
        finish_reason="stop",
        temperature=temperature,
        policy_version=version,
    )


# --- chat template ----------------------------------------------------------------


def test_render_ends_with_the_assistant_generation_prompt(template: ChatTemplate) -> None:
    ids = template.render(MESSAGES)
    tok = template.tokenizer
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nreply with only the number.<|im_end|>\n")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    suffix = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert ids[-len(suffix) :] == suffix
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3


def test_render_of_a_longer_conversation_extends_the_shorter_one(template: ChatTemplate) -> None:
    # Without the generation prompt, turn k's rendering is a token prefix of turn k+1's.
    short = template.render(MESSAGES)
    gen = template.tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    longer = template.render(
        [*MESSAGES, {"role": "assistant", "content": "3"}, {"role": "user", "content": "yes"}]
    )
    assert longer[: len(short) - len(gen)] == short[: -len(gen)]
    assert len(longer) > len(short)


def test_decode_drops_special_tokens(template: ChatTemplate) -> None:
    tok = template.tokenizer
    body = tok.encode("the answer is three", add_special_tokens=False)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert template.decode([*body, im_end]) == "the answer is three"
    assert template.decode([im_start, *body]) == "the answer is three"
    assert tok.decode([*body, im_end], skip_special_tokens=False).endswith("<|im_end|>")


def test_stop_ids_include_im_end(template: ChatTemplate) -> None:
    tok = template.tokenizer
    assert tok.convert_tokens_to_ids("<|im_end|>") in template.stop_token_ids
    assert tok.eos_token_id in template.stop_token_ids
    assert tok.pad_token_id not in template.stop_token_ids


# --- samples and collation --------------------------------------------------------


def test_sample_from_completion_is_prompt_plus_output() -> None:
    c = _completion([5, 6, 7], [8, 9, 2], [-0.1, -0.2, -0.3], temperature=0.7, version=3)
    s = sample_from_completion(c, advantage=0.25)
    assert s.input_ids == [5, 6, 7, 8, 9, 2]
    assert s.loss_mask == [0, 0, 0, 1, 1, 1]
    assert s.old_logprobs == [0.0, 0.0, 0.0, -0.1, -0.2, -0.3]
    assert s.advantages == [0.0] * 3 + [0.25] * 3
    assert s.temperatures == [1.0] * 3 + [0.7] * 3
    assert s.min_version == 3


def test_greedy_completion_trains_at_temperature_one() -> None:
    # Greedy sampling reports logprobs at temperature 1 (inference.sampling), so must the trainer.
    s = sample_from_completion(_completion([1], [2], [-0.5], temperature=0.0), 1.0)
    assert s.temperatures == [1.0, 1.0]


def test_collate_pads_right_and_aligns_masks_and_logprobs() -> None:
    a = sample_from_completion(_completion([5, 6, 7], [8, 9], [-0.1, -0.2], 0.7), 1.5)
    b = sample_from_completion(_completion([5], [10, 11, 12, 2], [-1.0, -2.0, -3.0, -4.0]), -0.5)
    batch = collate([a, b], pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 10, 11, 12, 2]]
    c = sample_from_completion(_completion([3, 4], [7], [-0.7]), 2.0)
    batch = collate([a, c], pad_id=99)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [3, 4, 7, 99, 99]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 0, 0]]
    torch.testing.assert_close(
        batch.old_logprobs, torch.tensor([[0, 0, 0, -0.1, -0.2], [0, 0, -0.7, 0, 0]])
    )
    # advantages and temperatures are per position, on the sampled tokens only
    assert batch.advantages.tolist() == [[0, 0, 0, 1.5, 1.5], [0, 0, 2.0, 0, 0]]
    assert batch.temperatures.shape == (2, 5)
    assert batch.temperatures[:, 3].tolist() == pytest.approx([0.7, 1.0])
    assert batch.temperatures[0, :3].tolist() == [1.0, 1.0, 1.0]


# --- the trainer's logprobs ---------------------------------------------------------


def _reference_logprobs(model, batch) -> torch.Tensor:
    """Full-sequence logits, log-softmax at the sample's temperature, picked at each token."""
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = torch.log_softmax(logits[:, :-1].double() / batch.temperatures[:, 1:, None], dim=-1)
    picked = logp.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_token_logprobs_match_full_logits_reference(
    engine: LocalEngine, template: ChatTemplate, temperature: float
) -> None:
    prompt = template.render(MESSAGES)
    out_a = [200, 57, 300, 2]
    prompt_b = template.render([{"role": "user", "content": "hello"}])
    out_b = [11, 12, 13, 14, 15, 16]
    samples = [
        sample_from_completion(_completion(prompt, out_a, [0.0] * 4, temperature), 1.0),
        sample_from_completion(_completion(prompt_b, out_b, [0.0] * 6, temperature), 1.0),
    ]
    batch = collate(samples, engine.pad_id)
    with torch.no_grad():
        got = engine.token_logprobs(batch)
    ref = _reference_logprobs(engine.model, batch)
    mask = batch.loss_mask > 0
    assert got.shape == batch.input_ids.shape
    assert int(mask.sum()) == 10
    torch.testing.assert_close(got[mask].double(), ref[mask], atol=1e-5, rtol=0)
    assert (got[~mask] == 0).all()
    # at a different temperature the numbers must differ (the temperature is really applied)
    other = collate(
        [sample_from_completion(_completion(prompt, out_a, [0.0] * 4, 0.3), 1.0)], engine.pad_id
    )
    with torch.no_grad():
        cold = engine.token_logprobs(other)
    n = len(prompt) + len(out_a)
    assert not torch.allclose(cold[0, len(prompt) : n], got[0, len(prompt) : n], atol=1e-3)


def test_engine_token_logprobs_carry_gradients(engine: LocalEngine, template: ChatTemplate) -> None:
    prompt = template.render(MESSAGES)
    batch = collate([sample_from_completion(_completion(prompt, [7, 8], [0.0, 0.0]), 1.0)], 0)
    engine.model.zero_grad(set_to_none=True)
    engine.token_logprobs(batch).sum().backward()
    grads = [p.grad for p in engine.model.parameters() if p.grad is not None]
    assert grads and any(float(g.abs().sum()) > 0 for g in grads)
    engine.model.zero_grad(set_to_none=True)


async def _generate(model_dir: Path, requests: list[GenerateRequest]):
    backend = LocalBackend(model_dir, batch_wait_s=0.05)
    try:
        return await asyncio.gather(*(backend.generate(r) for r in requests))
    finally:
        await backend.close()


def test_backend_logprobs_equal_trainer_logprobs(
    tiny_model_dir: Path, engine: LocalEngine, template: ChatTemplate
) -> None:
    """Behaviour logprobs == trainer logprobs on the same ids: the PPO ratio starts at 1."""
    stop = template.stop_token_ids
    prompts = [
        template.render(MESSAGES),
        template.render([{"role": "user", "content": "hello, how can i help you today?"}]),
        template.render([{"role": "user", "content": "yes"}]),
        template.render(MESSAGES[1:]),
    ]
    params = [
        SamplingParams(max_tokens=24, temperature=1.0, seed=1, stop_token_ids=stop),
        SamplingParams(max_tokens=16, temperature=0.7, seed=2, stop_token_ids=stop),
        SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=stop),
        SamplingParams(max_tokens=12, temperature=1.3, top_p=0.8, seed=3, stop_token_ids=stop),
    ]
    reqs = [GenerateRequest(p, sp) for p, sp in zip(prompts, params, strict=True)]
    results = asyncio.run(_generate(tiny_model_dir, reqs))
    samples = []
    for p, sp, r in zip(prompts, params, results, strict=True):
        assert len(r.output_token_ids) == len(r.output_logprobs) > 0
        c = _completion(p, r.output_token_ids, r.output_logprobs, sp.temperature)
        samples.append(sample_from_completion(c, advantage=1.0))
    batch = collate(samples, engine.pad_id)
    with torch.no_grad():
        logp = engine.token_logprobs(batch)
    mask = batch.loss_mask > 0
    assert int(mask.sum()) == sum(len(r.output_token_ids) for r in results)
    torch.testing.assert_close(logp[mask], batch.old_logprobs[mask], atol=1e-4, rtol=0)
    _, metrics = ppo_clip_loss(logp, batch.old_logprobs, batch.advantages, batch.loss_mask)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["ratio_max"] == pytest.approx(1.0, abs=2e-4)
    assert metrics["clip_frac"] == 0.0
    assert abs(metrics["approx_kl"]) < 1e-6
