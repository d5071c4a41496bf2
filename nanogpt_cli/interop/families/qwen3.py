"""Qwen3 (Qwen3ForCausalLM): Llama's block with QK-norm (RMSNorm on each head's queries and keys, before RoPE)
and a head_dim of its own; biases through attention_bias (q, k, v and o)."""

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
    no_sliding,
    require,
    rope_extra,
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


def refuses(c: GPTConfig) -> str | None:
    if why := llama_shaped(c, "Qwen3ForCausalLM"):
        return why
    if not c.qk_norm:
        return "Qwen3ForCausalLM always has QK-norm (--qk-norm)"
    if c.bias or c.sliding_window is not None:
        return "Qwen3ForCausalLM has no MLP biases and no sliding window here"
    return None


FAMILY = Family(
    model_type="qwen3",
    hf_class="Qwen3ForCausalLM",
    gguf_arch="qwen3",
    top=LLAMA_TOP,
    block=BLOCK,
    prefix="model.layers",
    config_in=config_in,
    config_out=config_out,
    refuses=refuses,
    names=("Qwen3",),
)
