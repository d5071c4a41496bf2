"""Llama (LlamaForCausalLM): Llama 2, 3, 3.1, 3.2, TinyLlama and SmolLM2. RoPE (scaling: linear, llama3, yarn),
RMSNorm, SwiGLU, grouped-query attention, any head_dim; biases through attention_bias (q, k, v and o) and mlp_bias."""

from __future__ import annotations

from nanogpt_cli.config import GPTConfig
from nanogpt_cli.interop.families.base import (
    LLAMA_BLOCK,
    LLAMA_TOP,
    Biases,
    Family,
    llama_config_in,
    llama_config_out,
    llama_shaped,
    require,
    rope_extra,
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


def refuses(c: GPTConfig) -> str | None:
    if why := llama_shaped(c, "LlamaForCausalLM"):
        return why
    if c.qk_norm:
        return "LlamaForCausalLM has no QK-norm (Qwen3 has)"
    if c.sliding_window is not None:
        return "LlamaForCausalLM has no sliding window (Mistral and Gemma 3 have)"
    return None


FAMILY = Family(
    model_type="llama",
    hf_class="LlamaForCausalLM",
    gguf_arch="llama",
    top=LLAMA_TOP,
    block=LLAMA_BLOCK,
    prefix="model.layers",
    config_in=config_in,
    config_out=config_out,
    refuses=refuses,
    names=("Llama 2", "Llama 3", "Llama 3.1", "Llama 3.2", "TinyLlama", "SmolLM2"),
)
