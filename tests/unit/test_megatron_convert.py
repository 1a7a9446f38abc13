"""Megatron-core <-> Hugging Face weight conversion and config mapping (CPU-only parts)."""

from __future__ import annotations

import json

import torch

from trainer.megatron_convert import hf_to_megatron, megatron_config, megatron_to_hf


def _tiny(tiny_model_dir):
    from safetensors.torch import load_file

    return load_file(tiny_model_dir / "model.safetensors"), json.loads(
        (tiny_model_dir / "config.json").read_text()
    )


def test_round_trip_is_exact(tiny_model_dir) -> None:
    state, hf = _tiny(tiny_model_dir)
    back = megatron_to_hf(hf_to_megatron(state, hf), hf)
    assert back.keys() == state.keys()
    for k in state:
        assert torch.equal(back[k], state[k]), k


def test_grouped_query_layout(tiny_model_dir) -> None:
    state, hf = _tiny(tiny_model_dir)
    mg = hf_to_megatron(state, hf)
    heads, groups, d = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    qkv = mg["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape == ((heads + 2 * groups) * d, hf["hidden_size"])
    # group 0: its query heads, then its key head, then its value head
    per = heads // groups
    q = state["model.layers.0.self_attn.q_proj.weight"]
    k = state["model.layers.0.self_attn.k_proj.weight"]
    assert torch.equal(qkv[: per * d], q[: per * d])
    assert torch.equal(qkv[per * d : (per + 1) * d], k[:d])
    fc1 = mg["decoder.layers.0.mlp.linear_fc1.weight"]
    assert fc1.shape == (2 * hf["intermediate_size"], hf["hidden_size"])


def test_config_mapping(tiny_model_dir) -> None:
    _, hf = _tiny(tiny_model_dir)
    cfg = megatron_config(hf)
    assert cfg["num_layers"] == hf["num_hidden_layers"]
    assert cfg["num_query_groups"] == hf["num_key_value_heads"]
    assert cfg["kv_channels"] == hf["head_dim"]
    assert cfg["gated_linear_unit"] and cfg["normalization"] == "RMSNorm"
    assert cfg["share_embeddings_and_output_weights"] is False
