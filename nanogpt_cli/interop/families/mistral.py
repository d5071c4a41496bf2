"""Mistral (MistralForCausalLM): Llama's block without biases, with a sliding window on every layer
(--sliding-window; none is the whole context)."""

from __future__ import annotations

import dataclasses

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
    unsupported,
)
from nanogpt_cli.interop.families.llama import GGUF as LLAMA_GGUF


def config_in(c, biases: Biases) -> GPTConfig:
    if biases.other or biases.qkv:
        raise unsupported("bias", "non-zero", "Mistral")
    return GPTConfig(**llama_config_in(c, "Mistral"), bias=False, sliding_window=c.sliding_window)


def config_out(c: GPTConfig, special: dict):
    config = require("transformers").MistralConfig(**llama_config_out(c, special), sliding_window=c.sliding_window)
    return config, rope_extra(c)


def refuses(c: GPTConfig) -> str | None:
    if why := llama_shaped(c, "MistralForCausalLM"):
        return why
    if c.bias or c.attn_bias or c.qk_norm:
        return "MistralForCausalLM has no biases and no QK-norm"
    if c.window_pattern is not None and set(c.window_pattern) != {"L"}:
        return "MistralForCausalLM's window is on every layer (no --window-pattern)"
    if c.rope_local_theta is not None:
        return "MistralForCausalLM has one RoPE base (no --rope-local-theta)"
    return None


def gguf_refuses(c: GPTConfig) -> str | None:
    if c.sliding_window is not None and c.sliding_window < c.block_size:
        return (
            "llama.cpp's converter writes Mistral as llama, which has no sliding window: GGUF export needs a "
            f"--sliding-window ({c.sliding_window}) of at least --block-size ({c.block_size})"
        )
    return None


GGUF = dataclasses.replace(LLAMA_GGUF, refuses=gguf_refuses)

FAMILY = Family(
    model_type="mistral",
    hf_class="MistralForCausalLM",
    gguf_arch="llama",  # llama.cpp's converter writes Mistral as llama
    top=LLAMA_TOP,
    block=LLAMA_BLOCK,
    prefix="model.layers",
    config_in=config_in,
    config_out=config_out,
    refuses=refuses,
    names=("Mistral 7B v0.1-v0.3", "Ministral"),
    gguf=GGUF,
)
