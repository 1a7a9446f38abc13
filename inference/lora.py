"""Many LoRA adapters on one base model, chosen per batch row: the local backend's LoRA serving.

Every adapter is a PEFT adapter directory (`adapter_config.json` +
`adapter_model.safetensors`), read into plain tensors: for each target
Linear module, A [r, in], B [out, r] and the scale (alpha / r, or
alpha / sqrt(r) under rsLoRA). `AdapterBank` owns them and puts one forward
hook on each target Linear of the base model; while a batch runs
(`AdapterBank.routing`), the hook adds, for the rows of each adapter r,

    out[rows_r] += scale_r * (x[rows_r] @ A_r^T) @ B_r^T

and nothing for the rows of the base model. That is peft's own unmerged
LoRA forward (`base(x) + lora_B(lora_A(x)) * scaling`, dropout off), in the
same order, so a mixed batch's logprobs are those of each row run alone with
peft (tests/unit/test_lora_batch.py). Own hooks rather than peft's
mixed-adapter batches (`adapter_names=`): the base model stays a plain HF
module, swapping one adapter is replacing one dict entry between batches
(no module surgery while other adapters are live), and adapters of
different ranks and target modules mix freely.

Not supported (refused when the adapter is read): DoRA, trained biases,
per-module rank or alpha patterns, adapters on embeddings or non-Linear modules.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import struct
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."


class AdapterError(ValueError):
    """An adapter directory that this base model cannot serve."""


@dataclass(frozen=True)
class LoraLayer:
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float


@dataclass(frozen=True)
class Adapter:
    """One loaded adapter: its layers by module name, and the policy version it is."""

    layers: dict[str, LoraLayer]
    version: int

    @property
    def nbytes(self) -> int:
        return sum(t.a.nbytes + t.b.nbytes for t in self.layers.values())


_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, as views into one copy of its data.

    An adapter is hundreds of small tensors: `safetensors.torch.load_file`
    spends about 20 us on each, which made reading a 10 MB rank-8 adapter
    (10 ms) most of a LoRA hot swap. The format is an 8-byte little-endian
    header length, a JSON header of `{name: {dtype, shape, data_offsets}}`
    and the data: the data is read once into memory and each tensor is a view
    of it.
    """
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        raw = bytearray(os.fstat(f.fileno()).st_size - 8 - size)
        f.readinto(raw)  # one copy of every tensor's bytes: the file may be pruned later
    header.pop("__metadata__", None)
    data = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    out = {}
    for name, meta in header.items():
        dtype = _SAFETENSORS_DTYPES.get(meta["dtype"])
        if dtype is None:
            raise AdapterError(f"{path}: {name} is {meta['dtype']}, not a float tensor")
        start, end = meta["data_offsets"]
        out[name] = data[start:end].view(dtype).view(meta["shape"])
    return out


def read_adapter(
    adapter_dir: Path, model: nn.Module, version: int, device: torch.device | str = "cpu"
) -> Adapter:
    """The adapter in `adapter_dir`, checked against `model`'s Linear modules."""
    adapter_dir = Path(adapter_dir)
    config_path, weights_path = adapter_dir / ADAPTER_CONFIG, adapter_dir / ADAPTER_WEIGHTS
    if not config_path.is_file() or not weights_path.is_file():
        raise AdapterError(f"{adapter_dir} is not a PEFT adapter ({ADAPTER_CONFIG} missing)")
    config = json.loads(config_path.read_text())
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora"):
        raise AdapterError(f"{adapter_dir}: only plain LoRA adapters are served (no DoRA)")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{adapter_dir}: adapters that train biases are not served")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise AdapterError(f"{adapter_dir}: per-module ranks or alphas are not served")
    tensors = {k: v.to(device) for k, v in read_safetensors(weights_path).items()}
    modules = dict(model.named_modules())
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        stem, _, kind = key.removesuffix(".weight").rpartition(".")
        if kind not in ("lora_A", "lora_B"):
            raise AdapterError(f"{adapter_dir}: unexpected tensor {key}")
        pairs.setdefault(stem.removeprefix(_PREFIX), {})[kind] = value.to(torch.float32)
    layers = {}
    for name, ab in pairs.items():
        module = modules.get(name)
        if not isinstance(module, nn.Linear) or len(ab) != 2:
            raise AdapterError(f"{adapter_dir}: {name} is not a Linear layer of the base model")
        a, b = ab["lora_A"], ab["lora_B"]
        rank = a.shape[0]
        if a.shape[1] != module.in_features or b.shape != (module.out_features, rank):
            raise AdapterError(f"{adapter_dir}: {name} shapes {tuple(a.shape)}, {tuple(b.shape)}")
        layers[name] = LoraLayer(a.contiguous(), b.contiguous(), _scale(config, rank))
    if not layers:
        raise AdapterError(f"{adapter_dir}: the adapter has no LoRA layers")
    return Adapter(layers, version)


def missing_lora_targets(model_dir: Path, targets: Sequence[str]) -> list[str]:
    """The names in `targets` that match no Linear layer of the model in `model_dir`.

    The model is built on the meta device: no weights are read.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    linear = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    linear |= {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    return [t for t in targets if t not in linear]


def merge_adapter(base_dir: Path, adapter_dir: Path, out_dir: Path) -> None:
    """Base + adapter merged into a plain HF directory that `from_pretrained` loads.

    Written to `out_dir.tmp` and renamed; the base's tokenizer files come along.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_dir, out_dir = Path(base_dir), Path(out_dir)
    lm = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(lm, adapter_dir).merge_and_unload()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    merged.save_pretrained(tmp)
    for src in base_dir.iterdir():  # tokenizer, chat template: what is not weights or config
        weights = src.suffix in (".safetensors", ".bin", ".pt", ".gguf") or "index" in src.name
        if src.is_file() and not weights and not (tmp / src.name).exists():
            shutil.copy2(src, tmp / src.name)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)


def _scale(config: dict, rank: int) -> float:
    """alpha / r, or alpha / sqrt(r) under rsLoRA."""
    alpha = float(config.get("lora_alpha", rank))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


class AdapterBank:
    """The adapters served on one base model, and the hooks that apply them per row.

    Not thread-safe by itself: the local backend's one model thread calls
    `routing` and `put`/`pop` between batches (its ordering contract).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.adapters: dict[str, Adapter] = {}
        self._hooks: dict[str, torch.utils.hooks.RemovableHandle] = {}
        # during a batch: per adapter in it, (adapter, the row indices that use it)
        self._rows: list[tuple[Adapter, torch.Tensor | None]] = []  # None: every row

    def version(self, name: str) -> int | None:
        adapter = self.adapters.get(name)
        return None if adapter is None else adapter.version

    def put(self, name: str, adapter: Adapter) -> None:
        """Serve `adapter` as `name` from the next batch on (replacing any before it)."""
        modules = dict(self.model.named_modules())
        for module_name in adapter.layers:
            if module_name not in self._hooks:
                self._hooks[module_name] = modules[module_name].register_forward_hook(
                    self._hook(module_name)
                )
        self.adapters[name] = adapter

    def pop(self, name: str) -> Adapter | None:
        """Stop serving `name`; the hooks of modules no adapter targets any more go too."""
        adapter = self.adapters.pop(name, None)
        live = {m for a in self.adapters.values() for m in a.layers}
        for module_name in list(self._hooks):
            if module_name not in live:
                self._hooks.pop(module_name).remove()
        return adapter

    @contextmanager
    def routing(self, row_adapters: Sequence[str | None]) -> Iterator[None]:
        """Apply adapter `row_adapters[i]` to row i (None: the base model) inside the block."""
        rows: dict[str, list[int]] = {}
        for i, name in enumerate(row_adapters):
            if name is not None:
                rows.setdefault(name, []).append(i)
        device = next(self.model.parameters()).device
        self._rows = [
            # every row on one adapter (one run's batch): no gather and scatter needed
            (
                self.adapters[name],
                None
                if len(idx) == len(row_adapters)
                else torch.tensor(idx, dtype=torch.long, device=device),
            )
            for name, idx in rows.items()
        ]
        try:
            yield
        finally:
            self._rows = []

    def _hook(self, module_name: str):
        def add_lora(_module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            if not self._rows:
                return out
            x = args[0]
            for adapter, idx in self._rows:
                layer = adapter.layers.get(module_name)
                if layer is None:
                    continue
                xs = x if idx is None else x.index_select(0, idx)
                delta = (xs.to(layer.a.dtype) @ layer.a.T) @ layer.b.T * layer.scale
                if idx is None:
                    out = out + delta.to(out.dtype)
                else:
                    out = out.index_add(0, idx, delta.to(out.dtype))
            return out

        return add_lora
