"""Gemma 3 text models (Gemma3ForCausalLM, model_type gemma3_text: Gemma 3 270M and 1B). RMSNorm with 1 + w gains
(--norm-offset) before and after each sub-block (--post-norms), QK-norm, embeddings times sqrt(n_embd)
(--embed-scale), the tanh-GELU gate (--mlp geglu), and local sliding-window layers (layer_types ->
--window-pattern) with a RoPE base of their own (--rope-local-theta)."""

from __future__ import annotations

from nanogpt_cli.config import ANY, GPTConfig, Takes, only, show_value
from nanogpt_cli.interop.families.base import (
    LLAMA_ATTN,
    LLAMA_MLP,
    LLAMA_TOP,
    Biases,
    Family,
    head_dim_of,
    holds,
    require,
    rope_params,
    shape_in,
    unsupported,
)
from nanogpt_cli.interop.families.gguf_base import (
    LLAMA_GGUF_BLOCK,
    LLAMA_GGUF_TOP,
    QK_NORM,
    GGUFLayout,
    Keys,
    Shapes,
    llama_gguf_config_in,
    llama_gguf_keys_out,
    on_llama_cpp,
)

BLOCK = {
    "ln_1.weight": "input_layernorm.weight",
    **LLAMA_ATTN,
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "post_ln_1.weight": "post_attention_layernorm.weight",
    "ln_2.weight": "pre_feedforward_layernorm.weight",
    **LLAMA_MLP,
    "post_ln_2.weight": "post_feedforward_layernorm.weight",
}
LAYER_LETTERS = {"sliding_attention": "L", "full_attention": "G"}


def _pattern(layer_types: list[str]) -> str:
    """The shortest cycle of L/G letters that spells the layer types, e.g. LLLLLG for 26 layers."""
    letters = "".join(LAYER_LETTERS[t] for t in layer_types)
    for n in range(1, len(letters) + 1):
        if all(letters[i] == letters[i % n] for i in range(len(letters))):
            return letters[:n]
    return letters


def _thetas(c) -> tuple[float, float]:
    """(global, local) RoPE bases, from 5.x's rope_parameters per layer type or 4.x's two keys; scaling refused."""
    rope = rope_params(c)
    full, local = rope.get("full_attention"), rope.get("sliding_attention")
    if full is None:  # transformers 4.x
        full, local = {**rope, "rope_theta": c.rope_theta}, {"rope_theta": c.rope_local_base_freq}
    for part in (full, local):
        kind = part.get("rope_type", part.get("type", "default"))
        if kind != "default":
            raise unsupported("rope_scaling", kind, "Gemma 3")
    return float(full["rope_theta"]), float(local["rope_theta"])


def config_in(c, biases: Biases) -> GPTConfig:
    if biases.other or biases.qkv:
        raise unsupported("attention_bias", True, "Gemma 3")
    if c.hidden_activation != "gelu_pytorch_tanh":
        raise unsupported("hidden_activation", c.hidden_activation, "Gemma 3")
    head_dim = head_dim_of(c)
    if c.query_pre_attn_scalar != head_dim:  # our attention scales by 1/sqrt(head_dim)
        raise unsupported("query_pre_attn_scalar", c.query_pre_attn_scalar, "Gemma 3")
    for name in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if getattr(c, name, None):
            raise unsupported(name, getattr(c, name), "Gemma 3")
    unknown = set(c.layer_types) - LAYER_LETTERS.keys()
    if unknown:
        raise unsupported("layer_types", sorted(unknown)[0], "Gemma 3")
    theta, local_theta = _thetas(c)
    local = "sliding_attention" in c.layer_types
    return GPTConfig(
        **shape_in(c),
        bias=False,
        pos_encoding="rope",
        rope_theta=theta,
        norm="rmsnorm",
        norm_eps=c.rms_norm_eps,
        mlp="geglu",
        mlp_hidden=c.intermediate_size,
        tie_embeddings=c.tie_word_embeddings,
        qk_norm=True,
        sliding_window=c.sliding_window if local else None,
        window_pattern=_pattern(c.layer_types) if local else None,
        rope_local_theta=local_theta if local else None,
        embed_scale=True,
        norm_offset=True,
        post_norms=True,
        logit_softcap=getattr(c, "final_logit_softcapping", None),
    )


def config_out(c: GPTConfig, special: dict):
    pattern = c.window_pattern or ("L" if c.sliding_window is not None else "G")
    layer_types = [
        "sliding_attention" if c.sliding_window is not None and pattern[i % len(pattern)] == "L" else "full_attention"
        for i in range(c.n_layer)
    ]
    local_theta = c.rope_local_theta if c.rope_local_theta is not None else c.rope_theta
    config = require("transformers").Gemma3TextConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.n_embd,
        intermediate_size=c.hidden_size,
        num_hidden_layers=c.n_layer,
        num_attention_heads=c.n_head,
        num_key_value_heads=c.kv_heads,
        head_dim=c.head_size,
        query_pre_attn_scalar=c.head_size,
        max_position_embeddings=c.block_size,
        rms_norm_eps=c.norm_eps,
        hidden_activation="gelu_pytorch_tanh",
        sliding_window=c.sliding_window or c.block_size,
        layer_types=layer_types,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": c.rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        },
        final_logit_softcapping=c.logit_softcap,
        attn_logit_softcapping=None,
        attention_bias=False,
        tie_word_embeddings=c.tie_embeddings,
        **special,
    )
    return config, {"rope_theta": c.rope_theta, "rope_local_base_freq": local_theta}


FEATURES = holds(
    "Gemma3ForCausalLM",
    pos_encoding=only("rope"),
    norm=only("rmsnorm"),
    mlp=only("geglu"),
    qk_norm=only(True),
    embed_scale=only(True),
    norm_offset=only(True),
    post_norms=only(True),
    logit_softcap=ANY,
    bias=only(False),
    qkv_bias=Takes(lambda v, c: not c.attn_bias, "none or false (no biases)", (False,)),
    parallel_residual=only(False),
    rotary_dim=only(None),
    rope_scaling=only("none"),
    n_kv_head=ANY,
    head_dim=ANY,
    sliding_window=ANY,
    window_pattern=ANY,
    rope_local_theta=ANY,
)


# --- llama.cpp's gemma3 -------------------------------------------------------------------------------------------

GGUF_PATTERN, GGUF_LOCAL_THETA = "LLLLLG", 10000.0  # what llama.cpp's gemma3 assumes: the file has no key for them


def gguf_config_in(keys: Keys, shapes: Shapes) -> dict:
    """Our fields for a gemma3 file: Llama's, with Gemma's set, the window on llama.cpp's pattern of layers."""
    window = keys("attention.sliding_window")
    return {
        **llama_gguf_config_in(keys, shapes),
        "mlp": "geglu",
        "embed_scale": True,  # llama.cpp's gemma3 scales the embeddings by sqrt(n_embd) itself
        "norm_offset": True,
        "post_norms": True,
        "sliding_window": int(window) if window else None,
        "window_pattern": GGUF_PATTERN if window else None,
        "rope_local_theta": GGUF_LOCAL_THETA if window else None,
        "logit_softcap": keys("final_logit_softcapping"),
    }


def gguf_keys_out(writer, c: GPTConfig) -> None:
    llama_gguf_keys_out(writer, c)
    writer.add_sliding_window(c.sliding_window or c.block_size)  # llama.cpp's loader requires one


def gguf_layers_match(c: GPTConfig) -> bool:
    """llama.cpp's gemma3 makes every sixth layer global and turns the others at RoPE base 10000 in the window the
    file gives: whether our layers compute the same (a global layer of ours is a local one whose window holds the
    whole context)."""
    whole = c.sliding_window is None or c.sliding_window >= c.block_size
    for i in range(c.n_layer):
        local, theirs = c.is_local(i), i % len(GGUF_PATTERN) != len(GGUF_PATTERN) - 1
        theta = c.rope_local_theta if local and c.rope_local_theta is not None else c.rope_theta
        if (local and not theirs) or (theirs and (theta != GGUF_LOCAL_THETA or not (local or whole))):
            return False
    return True


GGUF_FEATURES = on_llama_cpp(
    "gemma3",
    FEATURES,
    logit_softcap=only(None),  # the file has no key for a final logit soft-capping
    head_dim=Takes(  # llama.cpp scales a 62-layer gemma3's queries by n_embd / n_head, not by the head size
        lambda v, c: c.n_layer != 62 or c.n_embd // c.n_head == c.head_size,
        "--head-dim none (llama.cpp scales a 62-layer gemma3's queries by --n-embd / --n-head)",
        shows=lambda c: f"--head-dim {c.head_size} in 62 layers",
    ),
    window_pattern=Takes(
        lambda v, c: gguf_layers_match(c),
        f"--window-pattern {GGUF_PATTERN} and --rope-local-theta 10000 (llama.cpp's gemma3 makes every sixth layer "
        "global and turns the others at RoPE base 10000)",
        shows=lambda c: (
            f"--window-pattern {show_value(c.window_pattern)} with --rope-local-theta {show_value(c.rope_local_theta)}"
        ),
    ),
)


def _shift(name: str, tensor, c: GPTConfig, by: float):
    return tensor + by if name.endswith("norm.weight") else tensor


GGUF = GGUFLayout(
    top=LLAMA_GGUF_TOP,
    block={
        **{k: v for k, v in LLAMA_GGUF_BLOCK.items() if k != "attn.c_attn.bias"},
        **QK_NORM,
        "post_ln_1.weight": "post_attention_norm.weight",
        "post_ln_2.weight": "post_ffw_norm.weight",
    },
    config_in=gguf_config_in,
    keys_out=gguf_keys_out,
    features=GGUF_FEATURES,
    to_ours=lambda name, t, c: _shift(name, t, c, -1.0),  # the converter stores every norm gain as 1 + w
    to_theirs=lambda name, t, c: _shift(name, t, c, 1.0),
)

FAMILY = Family(
    model_type="gemma3_text",
    hf_class="Gemma3ForCausalLM",
    gguf_arch="gemma3",
    top=LLAMA_TOP,
    block=BLOCK,
    prefix="model.layers",
    config_in=config_in,
    config_out=config_out,
    features=FEATURES,
    names=("Gemma 3 270M", "Gemma 3 1B"),
    gguf=GGUF,
)
