"""Test helpers for forced tokens: raw-byte ids, a `tiny` copy that answers a script, and
multi-turn play that echoes every answer exactly as the agent received it.

A backend samples what its model says, so a test that needs chosen ids (byte
tokens that do not survive a trip through text, a special token mid-answer)
serves a model whose weights say exactly that. It is a real Hugging Face
directory: the local backend and vLLM load it like any other.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import openai

from inference.chat_template import ChatTemplate

if TYPE_CHECKING:
    from tests.conftest import GatewayServer

FIRST = [{"role": "user", "content": "what is one plus two?"}]

# GPT-2's byte-level alphabet: these bytes stand for themselves, the others for chr(256 + k).
PRINTABLE = [*range(33, 127), *range(161, 173), *range(174, 256)]
UNPRINTABLE = [b for b in range(256) if b not in PRINTABLE]


def byte_id(template: ChatTemplate, byte: int) -> int:
    """The id of the token that is exactly one raw byte (a byte-level BPE has one per byte)."""
    char = chr(byte) if byte in PRINTABLE else chr(256 + UNPRINTABLE.index(byte))
    return template.tokenizer.convert_tokens_to_ids(char)


def scripted_model(tiny_dir: Path, out: Path, after: int, script: list[int]) -> Path:
    """A copy of `tiny` that answers `script` after the token `after`, then its stop token.

    The layers add nothing (o_proj and down_proj are zero), so the next token
    depends on the current one only: the k-th token of `after, *script` is
    embedded as the unit vector e_k (k >= 1) and the head maps e_k to the next
    token of the script; every other token is e_0, which maps to the stop
    token. After the final RMSNorm that is a logit of 32 against 0, so the
    script is sampled at any temperature, with logprobs of about 0. `script`
    may hold each id once, and none of them may be `after`.
    """
    import torch
    from transformers import AutoModelForCausalLM

    chain = [after, *script]
    if len(set(chain)) != len(chain):
        raise ValueError("a scripted model's tokens must be distinct (the next depends on it)")
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    if len(chain) > model.config.hidden_size:
        raise ValueError(f"a script of at most {model.config.hidden_size - 1} tokens")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb.zero_()
        head.zero_()
        emb[:, 0] = 1.0
        head[model.config.eos_token_id, 0] = 4.0
        for k, (cur, nxt) in enumerate(itertools.pairwise(chain), start=1):
            emb[cur, 0] = 0.0
            emb[cur, k] = 1.0
            head[nxt, k] = 4.0
    out.mkdir(parents=True)
    for f in tiny_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy2(f, out / f.name)
    model.save_pretrained(out)
    return out


def byte_script(template: ChatTemplate) -> list[int]:
    """`the`, a CJK character cut after two bytes, NUL, <|im_start|>, 0xFF, then an emoji's
    first three bytes: no byte of it forms a character. With max_tokens=8 the emoji is cut
    after two bytes (finish "length"); with more the answer stops after the third."""
    im_start, the = template.tokenizer.convert_tokens_to_ids(["<|im_start|>", "the"])
    cut = [byte_id(template, b) for b in (0xE4, 0xB8, 0x00)]
    tail = [byte_id(template, b) for b in (0xFF, 0xF0, 0x9F, 0x98)]
    return [the, *cut, im_start, *tail]


def byte_model(tiny_dir: Path, out: Path) -> Path:
    """`tiny` scripted to answer `byte_script` to every chat turn (after the generation prompt)."""
    template = ChatTemplate(tiny_dir)
    return scripted_model(tiny_dir, out, template.render(FIRST)[-1], byte_script(template))


def play(
    gateway: GatewayServer, run: dict, turns: int, stream: bool = False, **fields
) -> list[dict]:
    """`turns` chat turns that echo every answer exactly as received; the stored rows."""
    headers = {"Authorization": f"Bearer {run['api_key']}"}
    messages = list(FIRST)
    rows = []
    with httpx.Client(base_url=gateway.url, headers=headers, timeout=60) as http:
        for k in range(turns):
            body = {"model": run["name"], "messages": messages, "temperature": 0, **fields}
            content, cid = (stream_answer if stream else answer)(http, body)
            rows.append(gateway.completion(cid))
            messages = [
                *messages,
                {"role": "assistant", "content": content},
                {"role": "user", "content": f"and then {k}?"},
            ]
    return rows


def play_responses(gateway: GatewayServer, run: dict, turns: int) -> tuple[list[dict], list[str]]:
    """`turns` Responses API turns chained by `previous_response_id`; stored rows, texts."""
    client = openai.OpenAI(base_url=run["base_url"], api_key=run["api_key"])
    rows, texts, previous = [], [], None
    for k in range(turns):
        resp = client.responses.create(
            model=run["name"],
            input=FIRST[0]["content"] if k == 0 else f"and then {k}?",
            previous_response_id=previous,
            max_output_tokens=8,
            temperature=0,
        )
        texts.append(resp.output_text)
        rows.append(gateway.completion((resp.model_extra or {})["completion_id"]))
        previous = resp.id
    return rows, texts


def answer(http: httpx.Client, body: dict) -> tuple[str, str]:
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]["content"], resp.json()["id"]


def stream_answer(http: httpx.Client, body: dict) -> tuple[str, str]:
    """The streamed text, as a client joins its deltas, and the completion id."""
    text, cid = "", ""
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            cid = cid or chunk["id"]
            for choice in chunk.get("choices", []):
                text += (choice.get("delta") or {}).get("content") or ""
    return text, cid


def assert_spliced(rows: list[dict]) -> None:
    """Each turn continues its parent's exact prompt + sampled ids: spliced, no drift."""
    for parent, child in itertools.pairwise(rows):
        seen = parent["prompt_token_ids"] + parent["output_token_ids"]
        assert child["parent_id"] == parent["id"]
        assert (child["spliced"], child["drift"]) == (1, 0), "the echoed answer was re-tokenized"
        assert child["prompt_token_ids"][: len(seen)] == seen


# --- thinking models (reasoning_parser: think) ---------------------------------------------

REASONING, ANSWER = "one plus two", "It is 3"
# Qwen3's generation prompt; unlike Qwen3, earlier thinking stays in the history, so the
# next turn can continue the sampled ids (a template that strips it drifts by design).
OPENED_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and '</think>' in message['content'] %}"
    "{{ '<|im_start|>assistant\\n<think>\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}"
)
# What each model samples (its stop token follows), and how many of those ids think.
SCRIPTS = {
    "tagged": (f"<think>{REASONING}</think> {ANSWER}", 7),
    "opened": (f"{REASONING}</think> {ANSWER}", 6),
}


def thinking_model(tiny_dir: Path, out: Path, kind: str) -> tuple[Path, list[int]]:
    """A copy of `tiny` with think tokens that answers `SCRIPTS[kind]`; its dir and script."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = out.with_name(out.name + "-base")
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    tokenizer.add_tokens(["<think>", "</think>"])
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    template_text = (tiny_dir / "chat_template.jinja").read_text()
    (base / "chat_template.jinja").write_text(
        OPENED_TEMPLATE if kind == "opened" else template_text
    )
    template = ChatTemplate(base)
    script = template.encode(SCRIPTS[kind][0])
    return scripted_model(base, out, template.render(FIRST)[-1], script), script
