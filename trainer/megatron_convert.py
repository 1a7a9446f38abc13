"""Hugging Face Llama <-> Megatron-core GPT: config mapping and weight names (CPU-only code).

Megatron-core's GPT model (Transformer Engine layer spec) fuses what HF keeps apart:

    HF (model.layers.i. ...)           Megatron-core (decoder.layers.i. ...)
    input_layernorm.weight             self_attention.linear_qkv.layer_norm_weight
    self_attn.{q,k,v}_proj.weight      self_attention.linear_qkv.weight  (*)
    self_attn.o_proj.weight            self_attention.linear_proj.weight
    post_attention_layernorm.weight    mlp.linear_fc1.layer_norm_weight
    mlp.{gate,up}_proj.weight          mlp.linear_fc1.weight  (gate, then up)
    mlp.down_proj.weight               mlp.linear_fc2.weight
    model.embed_tokens.weight          embedding.word_embeddings.weight   (top level)
    model.norm.weight                  decoder.final_layernorm.weight     (top level)
    lm_head.weight                     output_layer.weight  (untied)      (top level)

(*) per query group g: the group's query heads, then its key head, then its
value head, stacked along the output dimension (Megatron's grouped-query layout).

Megatron-core's local layer spec (no Transformer Engine) keeps the two
layer norms as modules of their own: `input_layernorm.weight` and
`pre_mlp_layernorm.weight` instead of the fused `*.layer_norm_weight` names
above (`to_local_spec` / `from_local_spec`).
"""

from __future__ import annotations

import re
from typing import Any

import torch

EMBEDDING = "embedding.word_embeddings.weight"
# keys of `megatron_config` that are GPTModel arguments; the rest are TransformerConfig fields
GPT_MODEL_KEYS = (
    "vocab_size",
    "max_sequence_length",
    "position_embedding_type",
    "rotary_base",
    "share_embeddings_and_output_weights",
)
_LOCAL_NORMS = (
    ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
)


def megatron_config(hf: dict[str, Any]) -> dict[str, Any]:
    """TransformerConfig / GPTModel keyword arguments for an HF Llama config dict."""
    heads = hf["num_attention_heads"]
    return {
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hf["hidden_size"],
        "ffn_hidden_size": hf["intermediate_size"],
        "num_attention_heads": heads,
        "num_query_groups": hf.get("num_key_value_heads", heads),
        "kv_channels": hf.get("head_dim") or hf["hidden_size"] // heads,
        "normalization": "RMSNorm",
        "layernorm_epsilon": hf.get("rms_norm_eps", 1e-6),
        "gated_linear_unit": True,
        "activation_func": "silu",
        "add_bias_linear": False,
        "position_embedding_type": "rope",
        "rotary_base": (hf.get("rope_parameters") or {}).get(
            "rope_theta", hf.get("rope_theta", 1e4)
        ),
        "vocab_size": hf["vocab_size"],
        "max_sequence_length": hf["max_position_embeddings"],
        "share_embeddings_and_output_weights": bool(hf.get("tie_word_embeddings", False)),
    }


def _layout(hf: dict[str, Any]) -> tuple[int, int, int]:
    heads = hf["num_attention_heads"]
    groups = hf.get("num_key_value_heads", heads)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    return heads // groups, groups, head_dim


def hf_to_megatron(state: dict[str, torch.Tensor], hf: dict[str, Any]) -> dict[str, torch.Tensor]:
    per_group, groups, d = _layout(hf)
    out = {
        "embedding.word_embeddings.weight": state["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": state["model.norm.weight"],
        "output_layer.weight": state.get("lm_head.weight", state["model.embed_tokens.weight"]),
    }
    for i in range(hf["num_hidden_layers"]):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = state[p + "self_attn.q_proj.weight"].view(groups, per_group * d, -1)
        k = state[p + "self_attn.k_proj.weight"].view(groups, d, -1)
        v = state[p + "self_attn.v_proj.weight"].view(groups, d, -1)
        out[m + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(
            groups * (per_group + 2) * d, -1
        )
        out[m + "self_attention.linear_qkv.layer_norm_weight"] = state[p + "input_layernorm.weight"]
        out[m + "self_attention.linear_proj.weight"] = state[p + "self_attn.o_proj.weight"]
        out[m + "mlp.linear_fc1.layer_norm_weight"] = state[p + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]], dim=0
        )
        out[m + "mlp.linear_fc2.weight"] = state[p + "mlp.down_proj.weight"]
    return out


def megatron_to_hf(state: dict[str, torch.Tensor], hf: dict[str, Any]) -> dict[str, torch.Tensor]:
    per_group, groups, d = _layout(hf)
    out = {
        "model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
        "model.norm.weight": state["decoder.final_layernorm.weight"],
        # always untied for inference reloads; a tied Megatron model has no output layer
        "lm_head.weight": state.get("output_layer.weight", state[EMBEDDING]),
    }
    for i in range(hf["num_hidden_layers"]):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        qkv = state[m + "self_attention.linear_qkv.weight"].view(groups, (per_group + 2) * d, -1)
        q, k, v = torch.split(qkv, [per_group * d, d, d], dim=1)
        out[p + "self_attn.q_proj.weight"] = q.reshape(groups * per_group * d, -1)
        out[p + "self_attn.k_proj.weight"] = k.reshape(groups * d, -1)
        out[p + "self_attn.v_proj.weight"] = v.reshape(groups * d, -1)
        out[p + "input_layernorm.weight"] = state[m + "self_attention.linear_qkv.layer_norm_weight"]
        out[p + "self_attn.o_proj.weight"] = state[m + "self_attention.linear_proj.weight"]
        out[p + "post_attention_layernorm.weight"] = state[m + "mlp.linear_fc1.layer_norm_weight"]
        gate, up = torch.chunk(state[m + "mlp.linear_fc1.weight"], 2, dim=0)
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
        out[p + "mlp.down_proj.weight"] = state[m + "mlp.linear_fc2.weight"]
    return out


def megatron_model_kwargs(
    hf: dict[str, Any], params_dtype: torch.dtype = torch.float32
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(TransformerConfig kwargs, GPTModel kwargs) for an HF Llama config, ready to pass.

    Resolves what `megatron_config` names as strings (the activation), turns
    dropout off (RL fine-tuning of a pretrained policy; HF Llama has none
    either) and sets the parameter dtype. Rejects what the conversion does
    not cover, naming the field.
    """
    rope_type = (hf.get("rope_parameters") or {}).get("rope_type", "default")
    scaled = hf.get("rope_scaling") not in (None, {}) or rope_type != "default"
    if scaled or hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError(
            "engine='megatron' converts plain Llama-family models only "
            "(no rope_scaling, attention_bias or mlp_bias): use engine='fsdp'"
        )
    mapped = megatron_config(hf)
    gpt = {k: mapped.pop(k) for k in GPT_MODEL_KEYS}
    gpt["rotary_base"] = int(gpt["rotary_base"])
    mapped["activation_func"] = getattr(torch.nn.functional, mapped["activation_func"])
    mapped |= {
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "params_dtype": params_dtype,
        "bf16": params_dtype == torch.bfloat16,
    }
    return mapped, gpt


def to_local_spec(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Transformer Engine spec names (what `hf_to_megatron` gives) -> local spec names."""
    return {_rename(k, _LOCAL_NORMS): v for k, v in state.items()}


def from_local_spec(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Local spec names -> Transformer Engine spec names (what `megatron_to_hf` reads)."""
    return {_rename(k, [(b, a) for a, b in _LOCAL_NORMS]): v for k, v in state.items()}


def _rename(key: str, pairs) -> str:
    m = re.match(r"(decoder\.layers\.\d+\.)(.*)", key)
    if m:
        for old, new in pairs:
            if m.group(2) == old:
                return m.group(1) + new
    return key
