"""How a family's model sits in a GGUF file of the llama.cpp architecture its converter writes (`GGUFLayout`), and
the pieces several layouts share: the Llama-like tensor names, keys and row order, and GPT-2's LayerNorm block.

    layout = FAMILIES["qwen2"].gguf; fields = layout.config_in(Keys("qwen2", values), shapes)
    layout.features.refusal(config)  # why llama.cpp's architecture does not compute our config, or None

Tensor names: ours <- llama.cpp's (`blk.{i}.` before a block's), a tuple on the right concatenated along dim 0, as
families' Hugging Face names are. Transforms take llama.cpp's tensor name; on a matrix they move whole rows only,
so they apply to quantized rows as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nanogpt_cli.config import Features, GPTConfig, Takes
from nanogpt_cli.errors import NanoGPTError

Names = dict[str, "str | tuple[str, ...]"]  # ours <- theirs; a tuple on the right is concatenated along dim 0
Shapes = dict[str, tuple[int, ...]]  # llama.cpp's tensor name -> its shape in PyTorch's (out, in) order


@dataclass(frozen=True)
class Keys:
    """One file's `ARCH.*` metadata: keys("context_length") reads ARCH.context_length."""

    arch: str  # general.architecture
    values: dict[str, Any]  # every key of the file -> its value

    def __call__(self, name: str, default: Any = None) -> Any:
        return self.values.get(f"{self.arch}.{name}", default)

    def need(self, name: str) -> Any:
        value = self(name)
        if value is None:
            raise NanoGPTError(f"the file has no {self.arch}.{name}, which llama.cpp's {self.arch} needs")
        return value


def keep(name: str, tensor, config: GPTConfig):
    """The transform of a tensor stored the same way on both sides (numpy or torch)."""
    return tensor


@dataclass(frozen=True)
class GGUFLayout:
    """One llama.cpp architecture as our GPT: its tensors, its metadata keys, and what it computes."""

    top: Names  # tensors outside the blocks, ours <- llama.cpp's
    block: Names  # tensors of block {i}, ours <- llama.cpp's without the blk.{i}. prefix
    keys_out: Callable[[Any, GPTConfig], None]  # writes the ARCH.* keys llama.cpp's loader reads (a GGUFWriter)
    features: Features  # the config fields and values llama.cpp's architecture computes (on_llama_cpp)
    config_in: Callable[[Keys, Shapes], dict[str, Any]] | None = None  # our GPTConfig fields from the keys and the
    # tensors' shapes (None: nanogpt reads this architecture from its own files only)
    to_ours: Callable[[str, np.ndarray, GPTConfig], np.ndarray] = keep  # llama.cpp's tensor (by its name) as ours
    to_theirs: Callable[[str, np.ndarray, GPTConfig], np.ndarray] = keep  # ours as llama.cpp's
    optional: tuple[str, ...] = field(default=())  # our block tensors written only when the model has them; other
    # biases the model lacks are written as zeros, since llama.cpp's loader requires them


def on_llama_cpp(arch: str, holds: Features, **takes: Takes) -> Features:
    """What llama.cpp's `arch` computes: the family's declaration (what export's hf_kind already checked), with
    the fields whose values llama.cpp's architecture narrows, such as a GELU it computes only with tanh."""
    assert set(takes) <= set(holds.takes), f"{arch}: {set(takes) - set(holds.takes)} are not declared"
    return Features(f"llama.cpp's {arch}", {**holds.takes, **takes})


def common_keys_out(writer, c: GPTConfig) -> None:
    """The keys every architecture's loader reads."""
    writer.add_context_length(c.block_size)
    writer.add_embedding_length(c.n_embd)
    writer.add_block_count(c.n_layer)
    writer.add_feed_forward_length(c.hidden_size)
    writer.add_head_count(c.n_head)


# --- RoPE + RMSNorm + gated MLP: llama, qwen2, qwen3, gemma3 ----------------------------------------------------

LLAMA_GGUF_TOP: Names = {
    "transformer.wte.weight": "token_embd.weight",
    "transformer.ln_f.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",  # absent: tied to token_embd, as llama.cpp's loader does
}
LLAMA_GGUF_BLOCK: Names = {
    "ln_1.weight": "attn_norm.weight",
    "attn.c_attn.weight": ("attn_q.weight", "attn_k.weight", "attn_v.weight"),
    "attn.c_attn.bias": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    "attn.c_proj.weight": "attn_output.weight",
    "ln_2.weight": "ffn_norm.weight",
    "mlp.c_fc.weight": ("ffn_gate.weight", "ffn_up.weight"),
    "mlp.c_proj.weight": "ffn_down.weight",
}
QK_NORM: Names = {"attn.q_norm.weight": "attn_q_norm.weight", "attn.k_norm.weight": "attn_k_norm.weight"}


def rows(shapes: Shapes, name: str) -> int:
    """The first dimension of the tensor `name`, which the config is read from; an odd file without it is one
    sentence (the caller names the file)."""
    if name not in shapes:
        raise NanoGPTError(f"the file has no tensor {name}, which llama.cpp's converter writes")
    return shapes[name][0]


def llama_gguf_config_in(keys: Keys, shapes: Shapes) -> dict[str, Any]:
    """Our fields for a Llama-like file; RoPE scaling is read apart (gguf_in), since Llama 3's is a tensor."""
    n_embd, n_head = int(keys.need("embedding_length")), int(keys.need("attention.head_count"))
    kv = keys("attention.head_count_kv", n_head)
    if isinstance(kv, list):
        raise NanoGPTError(f"{keys.arch}.attention.head_count_kv varies by layer, which nanogpt has no counterpart for")
    head_dim = int(keys("attention.key_length", n_embd // n_head))
    rotary = keys("rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise NanoGPTError(f"{keys.arch}.rope.dimension_count = {rotary} (of {head_dim}) has no counterpart here")
    if "blk.0.attn_output.bias" in shapes or "blk.0.ffn_down.bias" in shapes:
        raise NanoGPTError(f"biases on attn_output or the MLP have no counterpart for {keys.arch} here")
    return dict(
        vocab_size=rows(shapes, "token_embd.weight"),
        block_size=int(keys.need("context_length")),
        n_layer=int(keys.need("block_count")),
        n_head=n_head,
        n_embd=n_embd,
        n_kv_head=int(kv) if kv != n_head else None,
        head_dim=head_dim if head_dim * n_head != n_embd else None,
        bias=False,
        qkv_bias=True if "blk.0.attn_q.bias" in shapes else None,
        pos_encoding="rope",
        rope_theta=float(keys("rope.freq_base", 10000.0)),
        norm="rmsnorm",
        norm_eps=float(keys("attention.layer_norm_rms_epsilon", 1e-5)),
        mlp="swiglu",
        mlp_hidden=int(keys.need("feed_forward_length")),
        tie_embeddings="output.weight" not in shapes,
        qk_norm="blk.0.attn_q_norm.weight" in shapes,
    )


def llama_gguf_keys_out(writer, c: GPTConfig) -> None:
    """The keys llama.cpp's Llama-like loaders read: heads, RoPE (its scaling: linear and YaRN as keys, Llama 3's
    as the rope_freqs tensor), the RMSNorm epsilon."""
    import gguf

    common_keys_out(writer, c)
    writer.add_head_count_kv(c.kv_heads)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_rope_dimension_count(c.head_size)
    writer.add_vocab_size(c.vocab_size)
    if c.head_size * c.n_head != c.n_embd:  # llama.cpp takes n_embd / n_head unless told
        writer.add_key_length(c.head_size)
        writer.add_value_length(c.head_size)
    if c.rope_scaling in ("linear", "yarn"):
        writer.add_rope_scaling_type(getattr(gguf.RopeScalingType, str(c.rope_scaling).upper()))
        writer.add_rope_scaling_factor(c.rope_factor)
    if c.rope_scaling == "yarn":  # llama.cpp applies YaRN's attention temperature itself
        writer.add_rope_scaling_orig_ctx_len(c.rope_context)
        writer.add_rope_scaling_yarn_beta_fast(c.rope_beta_fast)
        writer.add_rope_scaling_yarn_beta_slow(c.rope_beta_slow)
    writer.add_layer_norm_rms_eps(c.norm_eps)


def llama_rope_order(w, n_head: int, inverse: bool = False):
    """llama.cpp's llama rotates interleaved pairs (x[2i], x[2i+1]); we and transformers rotate (x[i], x[i+hs/2]).
    Reorder each head's rows of q and k so the two compute the same (the permutation llama.cpp's converter does);
    `inverse` undoes it. Works on float rows and on quantized rows alike."""
    rows = w.shape[0]
    split = (n_head, rows // n_head // 2, 2) if inverse else (n_head, 2, rows // n_head // 2)
    return w.reshape(*split, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama_heads(name: str, c: GPTConfig) -> int | None:
    stem = name.split(".")[-2] if name.startswith("blk.") else ""
    return {"attn_q": c.n_head, "attn_k": c.kv_heads}.get(stem)


def llama_to_ours(name: str, tensor, c: GPTConfig):
    heads = _llama_heads(name, c)
    return tensor if heads is None else llama_rope_order(tensor, heads, inverse=True)


def llama_to_theirs(name: str, tensor, c: GPTConfig):
    heads = _llama_heads(name, c)
    return tensor if heads is None else llama_rope_order(tensor, heads)


# --- learned or rotary positions, LayerNorm, GELU: gpt2, gptneox --------------------------------------------------

LAYERNORM_GGUF_TOP: Names = {
    "transformer.wte.weight": "token_embd.weight",
    "transformer.ln_f.weight": "output_norm.weight",
    "transformer.ln_f.bias": "output_norm.bias",
    "lm_head.weight": "output.weight",
}
LAYERNORM_GGUF_BLOCK: Names = {  # every linear and norm has a bias in llama.cpp's gpt2 and gptneox
    f"{ours}.{kind}": f"{theirs}.{kind}"
    for ours, theirs in (
        ("ln_1", "attn_norm"),
        ("attn.c_attn", "attn_qkv"),  # q of every head, then k, then v: our c_attn's rows
        ("attn.c_proj", "attn_output"),
        ("ln_2", "ffn_norm"),
        ("mlp.c_fc", "ffn_up"),
        ("mlp.c_proj", "ffn_down"),
    )
    for kind in ("weight", "bias")
}


def layernorm_gguf_config_in(keys: Keys, shapes: Shapes) -> dict[str, Any]:
    """Our fields for a gpt2 or gptneox file. Their MLP width is read from ffn_up (GPT-2's converter writes 4 *
    n_embd whatever n_inner is); the GELU is the tanh one, which is what llama.cpp computes."""
    return dict(
        vocab_size=rows(shapes, "token_embd.weight"),
        block_size=int(keys.need("context_length")),
        n_layer=int(keys.need("block_count")),
        n_head=int(keys.need("attention.head_count")),
        n_embd=int(keys.need("embedding_length")),
        bias=True,
        norm="layernorm",
        norm_eps=float(keys("attention.layer_norm_epsilon", 1e-5)),
        mlp="gelu_tanh",
        mlp_hidden=rows(shapes, "blk.0.ffn_up.weight"),
        tie_embeddings="output.weight" not in shapes,
    )


# llama.cpp computes GELU with the tanh approximation only: a model trained with the exact one is refused, not run
# slightly differently (values None, so the reason is part of what the refusal says it needs)
GELU_TANH = Takes(lambda v, c: v == "gelu_tanh", "gelu_tanh (llama.cpp computes GELU with the tanh approximation only)")
