"""Megatron-core <-> Hugging Face weight conversion and config mapping (CPU-only parts)."""

from __future__ import annotations

import json

import pytest
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


def test_model_kwargs_split_and_resolve(tiny_model_dir) -> None:
    from trainer.megatron_convert import GPT_MODEL_KEYS, megatron_model_kwargs

    _, hf = _tiny(tiny_model_dir)
    config_kw, gpt_kw = megatron_model_kwargs(hf, torch.bfloat16)
    assert set(gpt_kw) == set(GPT_MODEL_KEYS) and not set(config_kw) & set(GPT_MODEL_KEYS)
    assert config_kw["activation_func"] is torch.nn.functional.silu
    assert config_kw["params_dtype"] is torch.bfloat16 and config_kw["bf16"] is True
    assert config_kw["hidden_dropout"] == 0.0 and config_kw["attention_dropout"] == 0.0
    assert gpt_kw["position_embedding_type"] == "rope" and isinstance(gpt_kw["rotary_base"], int)
    assert gpt_kw["vocab_size"] == hf["vocab_size"]
    with pytest.raises(ValueError, match="engine='fsdp'"):
        megatron_model_kwargs({**hf, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(ValueError, match="rope_scaling"):
        megatron_model_kwargs({**hf, "rope_parameters": {"rope_type": "llama3", "factor": 8.0}})


def test_local_layer_spec_names_round_trip(tiny_model_dir) -> None:
    from trainer.megatron_convert import from_local_spec, to_local_spec

    state, hf = _tiny(tiny_model_dir)
    te = hf_to_megatron(state, hf)
    local = to_local_spec(te)
    assert "decoder.layers.0.input_layernorm.weight" in local
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in local
    assert not any(k.endswith("layer_norm_weight") for k in local)
    assert local.keys() - te.keys() and from_local_spec(local).keys() == te.keys()


def test_a_tied_megatron_model_gets_an_explicit_head(tiny_model_dir) -> None:
    state, hf = _tiny(tiny_model_dir)
    mg = hf_to_megatron(state, hf)
    del mg["output_layer.weight"]  # share_embeddings_and_output_weights: no output layer
    back = megatron_to_hf(mg, hf)
    assert torch.equal(back["lm_head.weight"], state["model.embed_tokens.weight"])
