"""Mistral (MistralForCausalLM): Llama's block without biases, with a sliding window on every layer
(--sliding-window; none is the whole context)."""

from __future__ import annotations

import dataclasses

from nanogpt_cli.config import ANY, GPTConfig, Takes, only
from nanogpt_cli.interop.families.base import (
    LLAMA_BLOCK,
    LLAMA_HOLDS,
    LLAMA_TOP,
    Biases,
    Family,
    holds,
    llama_config_in,
    llama_config_out,
    require,
    rope_extra,
    unsupported,
)
from nanogpt_cli.interop.families.gguf_base import on_llama_cpp
from nanogpt_cli.interop.families.llama import GGUF as LLAMA_GGUF


def config_in(c, biases: Biases) -> GPTConfig:
    if biases.other or biases.qkv:
        raise unsupported("bias", "non-zero", "Mistral")
    return GPTConfig(**llama_config_in(c, "Mistral"), bias=False, sliding_window=c.sliding_window)


def config_out(c: GPTConfig, special: dict):
    config = require("transformers").MistralConfig(**llama_config_out(c, special), sliding_window=c.sliding_window)
    return config, rope_extra(c)


FEATURES = holds(
    "MistralForCausalLM",
    bias=only(False),
    qkv_bias=Takes(lambda v, c: not c.attn_bias, "none or false (no biases)", (False,)),
    qk_norm=only(False),
    sliding_window=ANY,
    window_pattern=Takes(lambda v, c: v is None or set(v) == {"L"}, "none (the window on every layer)", (None,)),
    rope_local_theta=only(None),
    **LLAMA_HOLDS,
)


# llama.cpp's converter writes Mistral as llama, which has no sliding window: one that holds the whole context is none
GGUF = dataclasses.replace(
    LLAMA_GGUF,
    features=on_llama_cpp(
        "llama",
        FEATURES,
        sliding_window=Takes(
            lambda v, c: v is None or v >= c.block_size,
            "a --sliding-window of at least --block-size, or none (llama.cpp's converter writes Mistral as llama, "
            "which has no sliding window)",
            shows=lambda c: f"--sliding-window {c.sliding_window} under --block-size {c.block_size}",
        ),
    ),
)

FAMILY = Family(
    model_type="mistral",
    hf_class="MistralForCausalLM",
    gguf_arch="llama",  # llama.cpp's converter writes Mistral as llama
    top=LLAMA_TOP,
    block=LLAMA_BLOCK,
    prefix="model.layers",
    config_in=config_in,
    config_out=config_out,
    features=FEATURES,
    names=("Mistral 7B v0.1-v0.3", "Ministral"),
    gguf=GGUF,
)
