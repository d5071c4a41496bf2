"""Llama (LlamaForCausalLM): Llama 2, 3, 3.1, 3.2, TinyLlama and SmolLM2. RoPE (scaling: linear, llama3, yarn),
RMSNorm, SwiGLU, grouped-query attention, any head_dim; biases through attention_bias (q, k, v and o) and mlp_bias."""

from __future__ import annotations

from nanogpt_cli.config import ANY, GPTConfig, only
from nanogpt_cli.interop.families.base import (
    LLAMA_BLOCK,
    LLAMA_HOLDS,
    LLAMA_TOP,
    NO_WINDOW,
    Biases,
    Family,
    holds,
    llama_config_in,
    llama_config_out,
    require,
    rope_extra,
)
from nanogpt_cli.interop.families.gguf_base import (
    LLAMA_GGUF_BLOCK,
    LLAMA_GGUF_TOP,
    GGUFLayout,
    llama_gguf_config_in,
    llama_gguf_keys_out,
    llama_to_ours,
    llama_to_theirs,
    on_llama_cpp,
)


def config_in(c, biases: Biases) -> GPTConfig:
    qkv = biases.qkv
    return GPTConfig(
        **llama_config_in(c, "Llama"),
        bias=biases.other,
        qkv_bias=qkv if qkv is not None and qkv != biases.other else None,
    )


def config_out(c: GPTConfig, special: dict):
    config = require("transformers").LlamaConfig(
        **llama_config_out(c, special),
        attention_bias=c.bias or c.attn_bias,  # q, k, v and o together: an o_proj bias we lack is zero
        mlp_bias=c.bias,
    )
    return config, rope_extra(c)


FEATURES = holds("LlamaForCausalLM", bias=ANY, qkv_bias=ANY, qk_norm=only(False), **LLAMA_HOLDS, **NO_WINDOW)


# llama.cpp's llama: the converter reorders q and k rows for its interleaved-pair RoPE. It has optional q, k and v
# biases (--qkv-bias), not the others
GGUF = GGUFLayout(
    top=LLAMA_GGUF_TOP,
    block=LLAMA_GGUF_BLOCK,
    config_in=llama_gguf_config_in,
    keys_out=llama_gguf_keys_out,
    features=on_llama_cpp("llama", FEATURES, bias=only(False)),
    to_ours=llama_to_ours,
    to_theirs=llama_to_theirs,
    optional=("attn.c_attn.bias",),
)

FAMILY = Family(
    model_type="llama",
    hf_class="LlamaForCausalLM",
    gguf_arch="llama",
    top=LLAMA_TOP,
    block=LLAMA_BLOCK,
    prefix="model.layers",
    config_in=config_in,
    config_out=config_out,
    features=FEATURES,
    names=("Llama 2", "Llama 3", "Llama 3.1", "Llama 3.2", "TinyLlama", "SmolLM2"),
    gguf=GGUF,
)
