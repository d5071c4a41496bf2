"""The record every Hugging Face family fills in (`Family`), and the pieces several families share: RoPE
parameters in and out, the GELU names, and the bias and width bookkeeping of an imported config.

    family = FAMILIES["qwen2"]; config = family.config_in(hf_config, Biases(qkv=True)); hf_config, extra = ...
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from nanogpt_cli import errors
from nanogpt_cli.config import ANY, Features, GPTConfig, Takes, features, only
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.interop.families.gguf_base import GGUFLayout, Names, keep  # noqa: F401 (keep: re-exported)
from nanogpt_cli.model import yarn_attention_factor

GELUS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}  # theirs -> our --mlp


@dataclass(frozen=True)
class Biases:
    """Which of a checkpoint's bias tensors are non-zero (a zero bias is no bias)."""

    other: bool  # any bias besides q, k and v's
    qkv: bool | None = None  # q, k and v's (None: counted in `other`, for fused or Conv1D layouts)


@dataclass(frozen=True)
class Family:
    """One Hugging Face architecture: everything that converts between it and our GPT."""

    model_type: str  # config.json's model_type
    hf_class: str  # the transformers class export builds
    gguf_arch: str  # the architecture llama.cpp's converter writes for it
    top: Names  # tensors outside the blocks, ours <- theirs
    block: Names  # tensors of block {i}, ours <- theirs (without the prefix)
    prefix: str  # their blocks' prefix, e.g. model.layers
    config_in: Callable[[Any, Biases], GPTConfig]  # our config for theirs; unsupported values are one sentence
    config_out: Callable[[GPTConfig, dict], tuple[Any, dict]]  # theirs for ours (+ extra config.json keys)
    features: Features  # the config fields and values it holds (hf.hf_kind walks these)
    to_ours: Callable[[str, torch.Tensor, GPTConfig], torch.Tensor] = keep  # their tensor as ours
    to_theirs: Callable[[str, torch.Tensor, GPTConfig], torch.Tensor] = keep  # ours as theirs
    names: tuple[str, ...] = field(default=())  # the model names it covers, for docs and `info`
    gguf: GGUFLayout | None = None  # how it sits in a GGUF file of gguf_arch (gguf_base.py)
    conv1d: bool = False  # its linear layers store their weights (in, out): PEFT's fan_in_fan_out
    peft_rows: Callable[[str, torch.Tensor, GPTConfig], torch.Tensor] = keep  # a LoRA B's rows in their order
    # (whether a config of ours, not imported from this family, fits, the architecture, its layout): another llama.cpp
    # architecture that computes such a model where gguf_arch would not fit it as well
    gguf_plain: tuple[Callable[[GPTConfig], bool], str, GGUFLayout] | None = None

    def refuses(self, c: GPTConfig) -> str | None:
        """Why this family cannot hold our config exactly (one sentence naming the flags), or None."""
        return self.features.refusal(c)


def require(module: str):
    """Import an optional dependency of the hf extra, or say in one sentence how to install it."""
    return errors.require(module, "hf")


def unsupported(field_name: str, value: Any, family: str) -> NanoGPTError:
    """The one sentence for a config value we have no counterpart for."""
    return NanoGPTError(f"{family}'s {field_name} = {value!r} has no counterpart in nanogpt")


def rope_params(c) -> dict[str, Any]:
    """transformers' RoPE parameters (rope_parameters in 5.x, rope_scaling in 4.x), {} when it has none."""
    return getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}


def rope_theta(c, rope: dict[str, Any] | None = None) -> float:
    rope = rope_params(c) if rope is None else rope
    theta = rope.get("rope_theta", getattr(c, "rope_theta", None) or getattr(c, "rotary_emb_base", None) or 1e4)
    return float(theta)


def rope_scaling_from_hf(c, rope: dict[str, Any] | None = None) -> dict[str, Any]:
    """Our rope_* fields for a transformers config's RoPE scaling (default, linear, llama3, yarn), or one sentence
    saying it has no counterpart."""
    rope = rope_params(c) if rope is None else rope
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return {}
    if kind not in ("linear", "llama3", "yarn"):
        raise NanoGPTError(f"RoPE scaling {kind!r} has no counterpart here (linear, llama3 and yarn do)")
    out: dict[str, Any] = {"rope_scaling": kind, "rope_factor": float(rope["factor"])}
    if kind == "linear":
        return out
    out["rope_original_context"] = int(rope.get("original_max_position_embeddings") or c.max_position_embeddings)
    if kind == "llama3":
        out["rope_low_freq_factor"] = float(rope["low_freq_factor"])
        out["rope_high_freq_factor"] = float(rope["high_freq_factor"])
        return out
    if not rope.get("truncate", True) or rope.get("mscale") or rope.get("mscale_all_dim"):
        raise NanoGPTError("YaRN with truncate false or mscale settings has no counterpart here")
    own = rope.get("attention_factor")
    if own is not None and not math.isclose(own, yarn_attention_factor(out["rope_factor"])):
        raise NanoGPTError("YaRN with an attention_factor of its own has no counterpart here")
    out["rope_beta_fast"] = float(rope.get("beta_fast") or 32.0)
    out["rope_beta_slow"] = float(rope.get("beta_slow") or 1.0)
    return out


def rope_scaling_to_hf(c: GPTConfig) -> dict[str, Any]:
    """transformers' RoPE parameters for our config, as its Llama names them."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling == "none":
        return rope
    rope.update(rope_type=str(c.rope_scaling), factor=c.rope_factor)
    if c.rope_scaling == "linear":
        return rope
    rope["original_max_position_embeddings"] = c.rope_context
    if c.rope_scaling == "llama3":
        rope.update(low_freq_factor=c.rope_low_freq_factor, high_freq_factor=c.rope_high_freq_factor)
    else:
        rope.update(beta_fast=c.rope_beta_fast, beta_slow=c.rope_beta_slow)
    return rope


def rope_extra(c: GPTConfig) -> dict[str, Any]:
    """config.json keys that transformers 4.x reads the RoPE from (the top-level theta and rope_scaling)."""
    extra: dict[str, Any] = {"rope_theta": c.rope_theta}
    if c.rope_scaling != "none":
        extra["rope_scaling"] = {k: v for k, v in rope_scaling_to_hf(c).items() if k != "rope_theta"}
    return extra


def default_width(config: GPTConfig) -> GPTConfig:
    """mlp_hidden None when it is the default width: the config as a user would have written it."""
    default = GPTConfig(**{**config.to_dict(), "mlp_hidden": None}).hidden_size
    if config.mlp_hidden is not None and config.mlp_hidden == default:
        config.mlp_hidden = None
    return config


def head_dim_of(c) -> int:
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


# --- what each family holds, declared (config.Features) ---------------------------------------------------------

# fields every family holds at any value: sizes, and what only training reads
ANY_SIZE = (
    "vocab_size", "block_size", "n_layer", "n_head", "n_embd", "dropout", "rope_theta", "norm_eps", "mlp_hidden",
    "tie_embeddings", "zero_init_proj", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
    "rope_original_context", "rope_beta_fast", "rope_beta_slow",
)  # fmt: skip
GELU = only("gelu", "gelu_tanh")
# GPT-2's and GPT-NeoX's attention: every head its own keys, heads that split n_embd, biases all on or all off
MHA = dict(
    n_kv_head=Takes(lambda v, c: c.kv_heads == c.n_head, "none (one key/value head per query head)", (None,)),
    head_dim=Takes(lambda v, c: c.head_size * c.n_head == c.n_embd, "none (--n-embd / --n-head)", (None,)),
    qkv_bias=Takes(lambda v, c: c.attn_bias == c.bias, "none (as --bias)", (None,)),
    rope_scaling=only("none"),
)
NO_GEMMA = dict(embed_scale=only(False), norm_offset=only(False), post_norms=only(False), logit_softcap=only(None))
NO_WINDOW = dict(sliding_window=only(None), window_pattern=ANY, rope_local_theta=only(None))
# a RoPE + RMSNorm + SwiGLU block, Llama's, which Qwen2, Qwen3 and Mistral share
LLAMA_HOLDS = dict(
    pos_encoding=only("rope"),
    norm=only("rmsnorm"),
    mlp=only("swiglu"),
    parallel_residual=only(False),
    rotary_dim=only(None),
    n_kv_head=ANY,
    head_dim=ANY,
    rope_scaling=ANY,
    **NO_GEMMA,
)


def holds(hf_class: str, **takes: Takes) -> Features:
    """A family's declaration: ANY_SIZE at any value, the rest as given."""
    return features(hf_class, ANY_SIZE, **takes)


def shape_in(c) -> dict[str, Any]:
    """Our size fields of a Llama-like transformers config (vocabulary, context, layers, heads, widths), with
    n_kv_head and head_dim left at their defaults where the config's equal them."""
    head_dim = head_dim_of(c)
    return dict(
        vocab_size=c.vocab_size,
        block_size=c.max_position_embeddings,
        n_layer=c.num_hidden_layers,
        n_head=c.num_attention_heads,
        n_embd=c.hidden_size,
        n_kv_head=c.num_key_value_heads if c.num_key_value_heads != c.num_attention_heads else None,
        head_dim=head_dim if head_dim * c.num_attention_heads != c.hidden_size else None,
    )


def llama_config_in(c, family: str) -> dict[str, Any]:
    """Our fields for the parts every Llama-like transformers config shares (Llama, Mistral, Qwen2, Qwen3)."""
    if c.hidden_act != "silu":
        raise unsupported("hidden_act", c.hidden_act, family)
    return dict(
        **shape_in(c),
        pos_encoding="rope",
        rope_theta=rope_theta(c),
        **rope_scaling_from_hf(c),
        norm="rmsnorm",
        norm_eps=c.rms_norm_eps,
        mlp="swiglu",
        mlp_hidden=c.intermediate_size,
        tie_embeddings=c.tie_word_embeddings,
    )


def llama_config_out(c: GPTConfig, special: dict) -> dict[str, Any]:
    """transformers keyword arguments every Llama-like config shares."""
    return dict(
        vocab_size=c.vocab_size,
        hidden_size=c.n_embd,
        intermediate_size=c.hidden_size,
        num_hidden_layers=c.n_layer,
        num_attention_heads=c.n_head,
        num_key_value_heads=c.kv_heads,
        head_dim=c.head_size,
        max_position_embeddings=c.block_size,
        rms_norm_eps=c.norm_eps,
        rope_theta=c.rope_theta,
        rope_parameters=rope_scaling_to_hf(c),
        tie_word_embeddings=c.tie_embeddings,
        **special,
    )


def no_sliding(c, family: str) -> None:
    """Qwen2/Qwen3's optional sliding window (use_sliding_window) is refused: one sentence."""
    if getattr(c, "use_sliding_window", False):
        raise unsupported("use_sliding_window", True, family)


LLAMA_ATTN: Names = {
    "attn.c_attn.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "attn.c_attn.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "attn.c_proj.weight": "self_attn.o_proj.weight",
    "attn.c_proj.bias": "self_attn.o_proj.bias",
}
LLAMA_MLP: Names = {
    "mlp.c_fc.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.c_fc.bias": ("mlp.gate_proj.bias", "mlp.up_proj.bias"),
    "mlp.c_proj.weight": "mlp.down_proj.weight",
    "mlp.c_proj.bias": "mlp.down_proj.bias",
}
LLAMA_BLOCK: Names = {
    "ln_1.weight": "input_layernorm.weight",
    **LLAMA_ATTN,
    "ln_2.weight": "post_attention_layernorm.weight",
    **LLAMA_MLP,
}
LLAMA_TOP: Names = {
    "transformer.wte.weight": "model.embed_tokens.weight",
    "transformer.ln_f.weight": "model.norm.weight",
}
