"""GPT-NeoX (GPTNeoXForCausalLM): Pythia and GPT-NeoX. RoPE on the whole head or its first --rotary-dim
dimensions (rotary_pct), LayerNorm, GELU, the sequential residual or the parallel one (Pythia's); zero biases for
a model without them. Its fused query_key_value rows are ordered by head."""

from __future__ import annotations

import math

import torch

from nanogpt_cli.config import ANY, GPTConfig, only
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.interop.families.base import (
    GELU,
    GELUS,
    MHA,
    NO_GEMMA,
    NO_WINDOW,
    Biases,
    Family,
    holds,
    require,
    rope_params,
    rope_theta,
    unsupported,
)
from nanogpt_cli.interop.families.gguf_base import (
    GELU_TANH,
    LAYERNORM_GGUF_BLOCK,
    LAYERNORM_GGUF_TOP,
    GGUFLayout,
    Keys,
    Shapes,
    common_keys_out,
    layernorm_gguf_config_in,
    on_llama_cpp,
)

BLOCK = {
    "ln_1.weight": "input_layernorm.weight",
    "ln_1.bias": "input_layernorm.bias",
    "attn.c_attn.weight": "attention.query_key_value.weight",
    "attn.c_attn.bias": "attention.query_key_value.bias",
    "attn.c_proj.weight": "attention.dense.weight",
    "attn.c_proj.bias": "attention.dense.bias",
    "ln_2.weight": "post_attention_layernorm.weight",
    "ln_2.bias": "post_attention_layernorm.bias",
    "mlp.c_fc.weight": "mlp.dense_h_to_4h.weight",
    "mlp.c_fc.bias": "mlp.dense_h_to_4h.bias",
    "mlp.c_proj.weight": "mlp.dense_4h_to_h.weight",
    "mlp.c_proj.bias": "mlp.dense_4h_to_h.bias",
}
TOP = {
    "transformer.wte.weight": "gpt_neox.embed_in.weight",
    "transformer.ln_f.weight": "gpt_neox.final_layer_norm.weight",
    "transformer.ln_f.bias": "gpt_neox.final_layer_norm.bias",
}
FUSED = ("attn.c_attn.weight", "attn.c_attn.bias")


def neox_qkv(tensor: torch.Tensor, n_head: int, to_neox: bool) -> torch.Tensor:
    """Our fused c_attn rows are [q of all heads, k, v]; GPT-NeoX's are [q, k, v] of head 0, then head 1, ...
    (rows, ...) -> (rows, ...), for the weight (3C, C) and the bias (3C,)."""
    rest = tensor.shape[1:]
    hs = tensor.size(0) // (3 * n_head)
    shape = (3, n_head, hs) if to_neox else (n_head, 3, hs)
    return tensor.reshape(*shape, *rest).transpose(0, 1).reshape(3 * n_head * hs, *rest)


def to_ours(name: str, tensor: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    return neox_qkv(tensor, config.n_head, to_neox=False) if name.endswith(FUSED) else tensor


def to_theirs(name: str, tensor: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    return neox_qkv(tensor, config.n_head, to_neox=True) if name.endswith(FUSED) else tensor


def config_in(c, biases: Biases) -> GPTConfig:
    rope = rope_params(c)
    partial = rope.get("partial_rotary_factor", getattr(c, "rotary_pct", 1.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise unsupported("rope_scaling", kind, "GPT-NeoX")
    hs = c.hidden_size // c.num_attention_heads
    rotary_dim = int(hs * partial)  # as GPT-NeoX computes rotary_ndims
    if rotary_dim % 2 or rotary_dim == 0:
        raise NanoGPTError(f"GPT-NeoX's rotary dimensions ({rotary_dim} of {hs}) must be even and at least 2")
    if c.hidden_act not in GELUS:
        raise unsupported("hidden_act", c.hidden_act, "GPT-NeoX")
    return GPTConfig(
        vocab_size=c.vocab_size,
        block_size=c.max_position_embeddings,
        n_layer=c.num_hidden_layers,
        n_head=c.num_attention_heads,
        n_embd=c.hidden_size,
        bias=biases.other,
        pos_encoding="rope",
        rope_theta=rope_theta(c, rope),
        norm="layernorm",
        norm_eps=c.layer_norm_eps,
        mlp=GELUS[c.hidden_act],
        mlp_hidden=c.intermediate_size,
        tie_embeddings=c.tie_word_embeddings,
        rotary_dim=None if rotary_dim == hs else rotary_dim,
        parallel_residual=bool(c.use_parallel_residual),
    )


def config_out(c: GPTConfig, special: dict):
    pct = c.rotary_size / c.head_size
    while int(c.head_size * pct) < c.rotary_size:  # GPT-NeoX's rotary_ndims = int(head_size * pct), which rounds down
        pct = math.nextafter(pct, 2.0)
    config = require("transformers").GPTNeoXConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.n_embd,
        intermediate_size=c.hidden_size,
        num_hidden_layers=c.n_layer,
        num_attention_heads=c.n_head,
        hidden_act="gelu_new" if c.mlp == "gelu_tanh" else "gelu",
        max_position_embeddings=c.block_size,
        layer_norm_eps=c.norm_eps,
        rotary_pct=pct,
        rotary_emb_base=c.rope_theta,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta, "partial_rotary_factor": pct},
        use_parallel_residual=c.parallel_residual,
        attention_bias=True,
        tie_word_embeddings=c.tie_embeddings,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **special,
    )
    return config, {"rope_theta": c.rope_theta, "rotary_emb_base": c.rope_theta, "rotary_pct": pct}


FEATURES = holds(
    "GPTNeoXForCausalLM",
    pos_encoding=only("rope"),
    norm=only("layernorm"),
    mlp=GELU,
    bias=ANY,
    parallel_residual=ANY,
    rotary_dim=ANY,
    qk_norm=only(False),
    **MHA,
    **NO_GEMMA,
    **NO_WINDOW,
)


# --- llama.cpp's gptneox: the converter reorders query_key_value into q of every head, then k, then v (ours) -------


def gguf_config_in(keys: Keys, shapes: Shapes) -> dict:
    fields = layernorm_gguf_config_in(keys, shapes)
    hs = fields["n_embd"] // fields["n_head"]
    rotary = int(keys("rope.dimension_count", hs))
    return {
        **fields,
        "pos_encoding": "rope",
        "rope_theta": float(keys("rope.freq_base", 10000.0)),
        "rotary_dim": None if rotary == hs else rotary,
        "parallel_residual": bool(keys.need("use_parallel_residual")),
    }


def gguf_keys_out(writer, c: GPTConfig) -> None:
    common_keys_out(writer, c)
    writer.add_rope_dimension_count(c.rotary_size)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_parallel_residual(c.parallel_residual)
    writer.add_layer_norm_eps(c.norm_eps)


GGUF = GGUFLayout(
    top=LAYERNORM_GGUF_TOP,
    block=LAYERNORM_GGUF_BLOCK,
    config_in=gguf_config_in,
    keys_out=gguf_keys_out,
    features=on_llama_cpp("gptneox", FEATURES, mlp=GELU_TANH),
)


def starcoder2_keys(writer, c: GPTConfig) -> None:
    common_keys_out(writer, c)
    writer.add_head_count_kv(c.kv_heads)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_rope_dimension_count(c.head_size)
    writer.add_vocab_size(c.vocab_size)
    writer.add_layer_norm_eps(c.norm_eps)


# llama.cpp's starcoder2: RoPE on the whole head, LayerNorm, tanh GELU, q, k and v apart; every bias required. Our
# own default block (one residual after the other, every dimension rotated) goes out as it
STARCODER2 = GGUFLayout(
    top=LAYERNORM_GGUF_TOP,
    block={
        **LAYERNORM_GGUF_BLOCK,
        "attn.c_attn.weight": ("attn_q.weight", "attn_k.weight", "attn_v.weight"),
        "attn.c_attn.bias": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    },
    keys_out=starcoder2_keys,
    features=on_llama_cpp("starcoder2", FEATURES, mlp=GELU_TANH, parallel_residual=only(False), rotary_dim=only(None)),
)


def plain_block(c: GPTConfig) -> bool:
    return not c.parallel_residual and c.rotary_dim is None


FAMILY = Family(
    model_type="gpt_neox",
    hf_class="GPTNeoXForCausalLM",
    gguf_arch="gptneox",
    top=TOP,
    block=BLOCK,
    prefix="gpt_neox.layers",
    config_in=config_in,
    config_out=config_out,
    features=FEATURES,
    to_ours=to_ours,
    to_theirs=to_theirs,
    peft_rows=to_theirs,
    gguf_plain=(
        plain_block,
        "starcoder2",
        STARCODER2,
    ),  # a fused q/k/v LoRA's B rows, ordered by head as the weight's are
    names=("Pythia", "GPT-NeoX"),
    gguf=GGUF,
)
