"""Qwen2 and Qwen2.5 (Qwen2ForCausalLM): Llama's block with biases on q, k and v only (--qkv-bias)."""

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
    no_sliding,
    require,
    rope_extra,
    unsupported,
)
from nanogpt_cli.interop.families.gguf_base import (
    LLAMA_GGUF_BLOCK,
    LLAMA_GGUF_TOP,
    GGUFLayout,
    llama_gguf_config_in,
    llama_gguf_keys_out,
    on_llama_cpp,
)


def config_in(c, biases: Biases) -> GPTConfig:
    no_sliding(c, "Qwen2")
    if biases.other:
        raise unsupported("o_proj or MLP bias", "non-zero", "Qwen2")
    return GPTConfig(**llama_config_in(c, "Qwen2"), bias=False, qkv_bias=True if biases.qkv else None)


def config_out(c: GPTConfig, special: dict):
    config = require("transformers").Qwen2Config(**llama_config_out(c, special), use_sliding_window=False)
    return config, rope_extra(c)


FEATURES = holds("Qwen2ForCausalLM", bias=only(False), qkv_bias=ANY, qk_norm=only(False), **LLAMA_HOLDS, **NO_WINDOW)


# llama.cpp's qwen2: Llama's tensors in transformers' row order (NeoX-style RoPE), q, k and v biases required
GGUF = GGUFLayout(
    top=LLAMA_GGUF_TOP,
    block=LLAMA_GGUF_BLOCK,
    config_in=llama_gguf_config_in,
    keys_out=llama_gguf_keys_out,
    features=on_llama_cpp("qwen2", FEATURES),
)

FAMILY = Family(
    model_type="qwen2",
    hf_class="Qwen2ForCausalLM",
    gguf_arch="qwen2",
    top=LLAMA_TOP,
    block=LLAMA_BLOCK,
    prefix="model.layers",
    config_in=config_in,
    config_out=config_out,
    features=FEATURES,
    names=("Qwen2", "Qwen2.5"),
    gguf=GGUF,
)
