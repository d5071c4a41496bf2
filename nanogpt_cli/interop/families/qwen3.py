"""Qwen3 (Qwen3ForCausalLM): Llama's block with QK-norm (RMSNorm on each head's queries and keys, before RoPE)
and a head_dim of its own; biases through attention_bias (q, k, v and o)."""

from __future__ import annotations

from nanogpt_cli.config import ANY, GPTConfig, Takes, only
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
    no_sliding,
    require,
    rope_extra,
)
from nanogpt_cli.interop.families.gguf_base import (
    LLAMA_GGUF_BLOCK,
    LLAMA_GGUF_TOP,
    QK_NORM,
    GGUFLayout,
    llama_gguf_config_in,
    llama_gguf_keys_out,
    on_llama_cpp,
)

BLOCK = {
    **LLAMA_BLOCK,
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
}


def config_in(c, biases: Biases) -> GPTConfig:
    no_sliding(c, "Qwen3")
    qkv = biases.qkv
    return GPTConfig(
        **llama_config_in(c, "Qwen3"),
        bias=biases.other,
        qkv_bias=qkv if qkv is not None and qkv != biases.other else None,
        qk_norm=True,
    )


def config_out(c: GPTConfig, special: dict):
    config = require("transformers").Qwen3Config(
        **llama_config_out(c, special), attention_bias=c.bias or c.attn_bias, use_sliding_window=False
    )
    return config, rope_extra(c)


FEATURES = holds("Qwen3ForCausalLM", bias=only(False), qkv_bias=ANY, qk_norm=only(True), **LLAMA_HOLDS, **NO_WINDOW)


# llama.cpp's qwen3: Llama's tensors plus attn_q_norm / attn_k_norm, in transformers' row order, without biases
GGUF = GGUFLayout(
    top=LLAMA_GGUF_TOP,
    block={**{k: v for k, v in LLAMA_GGUF_BLOCK.items() if k != "attn.c_attn.bias"}, **QK_NORM},
    config_in=llama_gguf_config_in,
    keys_out=llama_gguf_keys_out,
    features=on_llama_cpp(
        "qwen3", FEATURES, qkv_bias=Takes(lambda v, c: not c.attn_bias, "none or false (no biases)", (False,))
    ),
)

FAMILY = Family(
    model_type="qwen3",
    hf_class="Qwen3ForCausalLM",
    gguf_arch="qwen3",
    top=LLAMA_TOP,
    block=BLOCK,
    prefix="model.layers",
    config_in=config_in,
    config_out=config_out,
    features=FEATURES,
    names=("Qwen3",),
    gguf=GGUF,
)
