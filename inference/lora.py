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
or between two decode steps (no module surgery while other adapters are
live), and adapters of different ranks and target modules mix freely.

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
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
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

    An adapter is hundreds of small tensors, which makes per-tensor overhead
    most of a LoRA hot swap: `safetensors.torch.load_file` spends about 20 us
    on each, and slicing a tensor from Python about 10. The format is an
    8-byte little-endian header length, a JSON header of `{name: {dtype,
    shape, data_offsets}}` and the data. The data is read once, into memory
    that is not zeroed first, and cut into every tensor by one `torch.split`.
    """
    with open(path, "rb", buffering=0) as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        data = torch.empty(os.fstat(f.fileno()).st_size - 8 - size, dtype=torch.uint8)
        if data.numel() and f.readinto(memoryview(data.numpy())) != data.numel():  # type: ignore[arg-type]
            raise AdapterError(f"{path}: the file is shorter than its header says")
    # one copy of every tensor's bytes, so the file may be pruned later
    header.pop("__metadata__", None)
    entries = sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])
    cuts, end = [], 0
    for name, meta in entries:
        if meta["dtype"] not in _SAFETENSORS_DTYPES:
            raise AdapterError(f"{path}: {name} is {meta['dtype']}, not a float tensor")
        start, stop = meta["data_offsets"]
        if start != end:
            raise AdapterError(f"{path}: {name} does not follow the tensor before it")
        cuts.append(stop - start)
        end = stop
    if end != data.numel():
        raise AdapterError(f"{path}: the tensors do not fill the data")
    dtypes = {meta["dtype"] for _, meta in entries}
    if len(dtypes) == 1:  # the usual case: one dtype, so one view of the data and one per tensor
        dtype = _SAFETENSORS_DTYPES[dtypes.pop()]
        size = torch.empty((), dtype=dtype).element_size()
        chunks = torch.split(data.view(dtype), [c // size for c in cuts])
        pairs = zip(entries, chunks, strict=True)
        return {name: chunk.view(meta["shape"]) for (name, meta), chunk in pairs}
    return {
        name: chunk.view(_SAFETENSORS_DTYPES[meta["dtype"]]).view(meta["shape"])
        for (name, meta), chunk in zip(entries, torch.split(data, cuts), strict=True)
    }


def linear_modules(model: nn.Module) -> dict[str, nn.Linear]:
    """The model's Linear modules by name: what an adapter may target."""
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def read_adapter(
    adapter_dir: Path,
    model: nn.Module | Mapping[str, nn.Linear],
    version: int,
    device: torch.device | str = "cpu",
) -> Adapter:
    """The adapter in `adapter_dir`, checked against `model`'s Linear modules.

    `model` may be those modules already listed (`linear_modules`), as the
    backend's `AdapterBank` keeps them: listing them costs a walk of the model.
    """
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
    tensors = read_safetensors(weights_path)
    modules = model if isinstance(model, Mapping) else linear_modules(model)
    device = torch.device(device)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        stem, _, kind = key.removesuffix(".weight").rpartition(".")
        if kind not in ("lora_A", "lora_B"):
            raise AdapterError(f"{adapter_dir}: unexpected tensor {key}")
        if value.dtype != torch.float32 or value.device != device:
            value = value.to(device, torch.float32)
        pairs.setdefault(stem.removeprefix(_PREFIX), {})[kind] = value
    layers = {}
    for name, ab in pairs.items():
        module = modules.get(name)
        if module is None or len(ab) != 2:
            raise AdapterError(f"{adapter_dir}: {name} is not a Linear layer of the base model")
        a, b = ab["lora_A"], ab["lora_B"]
        rank = a.shape[0]
        if a.shape[1] != module.in_features or b.shape != (module.out_features, rank):
            raise AdapterError(f"{adapter_dir}: {name} shapes {tuple(a.shape)}, {tuple(b.shape)}")
        layers[name] = LoraLayer(a, b, _scale(config, rank))  # split views: contiguous
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

    Threads: `add_hooks` changes the model's modules and must run while no
    forward does (the local backend's model thread, between batches or
    between two decode steps). `put`, `pop` and `snapshot` take one lock and
    may run on any thread. A batch routes the adapters it was given
    (`routing`, one list of per-row adapters per forward): the local backend
    takes them from one `snapshot` when the batch starts, so a `put` from
    another thread serves from the next batch on (a `drain` swap), while a
    `keep` swap is put by the model thread itself between two steps, which
    then hands the new adapter to that adapter's rows. A hook stays on its
    module once added (an unloaded adapter's modules cost one dict lookup per
    forward while other adapters are served, nothing when none are): taking
    it off would need the model thread again.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.linears = linear_modules(model)  # listed once: walking the model costs ~1 ms
        self.adapters: dict[str, Adapter] = {}
        self._lock = threading.Lock()
        self._hooks: dict[str, torch.utils.hooks.RemovableHandle] = {}
        # during a batch: per adapter in it, (adapter, the row indices that use it)
        self._rows: list[tuple[Adapter, torch.Tensor | None]] = []  # None: every row

    def version(self, name: str) -> int | None:
        adapter = self.adapters.get(name)
        return None if adapter is None else adapter.version

    def unhooked(self, adapter: Adapter) -> list[str]:
        """The modules `adapter` targets that have no hook yet (`add_hooks` them first)."""
        return [m for m in adapter.layers if m not in self._hooks]

    def add_hooks(self, module_names: Sequence[str]) -> None:
        """Hook these modules; only while no forward runs."""
        for name in module_names:
            if name not in self._hooks:
                self._hooks[name] = self.linears[name].register_forward_hook(self._hook(name))

    def put(self, name: str, adapter: Adapter) -> None:
        """Serve `adapter` as `name` to every later `snapshot` (replacing any before it).

        Hooks it still lacks are added here: where a forward may be running,
        `add_hooks` them on the model's thread first.
        """
        self.add_hooks(self.unhooked(adapter))
        with self._lock:
            self.adapters[name] = adapter

    def pop(self, name: str) -> Adapter | None:
        """Stop serving `name` from the next batch on."""
        with self._lock:
            return self.adapters.pop(name, None)

    def snapshot(self, names: Iterable[str]) -> dict[str, Adapter]:
        """The adapters of `names` that are loaded now (one consistent view for one batch)."""
        with self._lock:
            return {n: self.adapters[n] for n in names if n in self.adapters}

    @contextmanager
    def routing(self, rows: Sequence[Adapter | None]) -> Iterator[None]:
        """Apply adapter `rows[i]` to row i (None: the base model) inside the block."""
        by_adapter: dict[int, tuple[Adapter, list[int]]] = {}
        for i, adapter in enumerate(rows):
            if adapter is not None:
                by_adapter.setdefault(id(adapter), (adapter, []))[1].append(i)
        device = next(self.model.parameters()).device
        self._rows = [
            # every row on one adapter (one run's batch): no gather and scatter needed
            (
                adapter,
                None
                if len(idx) == len(rows)
                else torch.tensor(idx, dtype=torch.long, device=device),
            )
            for adapter, idx in by_adapter.values()
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
