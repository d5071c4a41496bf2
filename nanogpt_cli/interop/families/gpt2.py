"""GPT-2 (GPT2LMHeadModel): learned or sinusoidal positions (a sinusoidal table becomes the learned table),
LayerNorm, GELU (exact or tanh); a model without biases gets zero biases. Its linear layers are Conv1D, (in, out)."""

from __future__ import annotations

from nanogpt_cli.config import ANY, GPTConfig, only
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
    unsupported,
)
from nanogpt_cli.interop.families.gguf_base import (
    GELU_TANH,
    LAYERNORM_GGUF_BLOCK,
    LAYERNORM_GGUF_TOP,
    GGUFLayout,
    common_keys_out,
    layernorm_gguf_config_in,
    on_llama_cpp,
)

BLOCK = {
    name: name
    for name in (
        "ln_1.weight",
        "ln_1.bias",
        "attn.c_attn.weight",
        "attn.c_attn.bias",
        "attn.c_proj.weight",
        "attn.c_proj.bias",
        "ln_2.weight",
        "ln_2.bias",
        "mlp.c_fc.weight",
        "mlp.c_fc.bias",
        "mlp.c_proj.weight",
        "mlp.c_proj.bias",
    )
}
TOP = {
    name: name
    for name in ("transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight", "transformer.ln_f.bias")
}
TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def config_in(c, biases: Biases) -> GPTConfig:
    if c.activation_function not in GELUS:
        raise unsupported("activation_function", c.activation_function, "GPT-2")
    for name in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if getattr(c, name):
            raise unsupported(name, True, "GPT-2")
    if not c.scale_attn_weights:
        raise unsupported("scale_attn_weights", False, "GPT-2")
    return GPTConfig(
        vocab_size=c.vocab_size,
        block_size=c.n_positions,
        n_layer=c.n_layer,
        n_head=c.n_head,
        n_embd=c.n_embd,
        bias=biases.other,
        pos_encoding="learned",
        norm="layernorm",
        norm_eps=c.layer_norm_epsilon,
        mlp=GELUS[c.activation_function],
        mlp_hidden=c.n_inner,
        tie_embeddings=c.tie_word_embeddings,
    )


def config_out(c: GPTConfig, special: dict):
    config = require("transformers").GPT2Config(
        vocab_size=c.vocab_size,
        n_positions=c.block_size,
        n_embd=c.n_embd,
        n_layer=c.n_layer,
        n_head=c.n_head,
        n_inner=c.mlp_hidden,  # None: GPT-2's 4 * n_embd
        activation_function="gelu_new" if c.mlp == "gelu_tanh" else "gelu",
        layer_norm_epsilon=c.norm_eps,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=c.tie_embeddings,
        **special,
    )
    return config, {"n_ctx": c.block_size}  # llama.cpp's GPT-2 converter wants n_ctx


FEATURES = holds(
    "GPT2LMHeadModel",
    pos_encoding=only("learned", "sinusoidal"),
    norm=only("layernorm"),
    mlp=GELU,
    bias=ANY,
    parallel_residual=only(False),
    rotary_dim=only(None),
    qk_norm=only(False),
    **MHA,
    **NO_GEMMA,
    **NO_WINDOW,
)


def transpose(name: str, tensor, config: GPTConfig):
    return tensor.t() if name.endswith(TRANSPOSED) else tensor


def gguf_keys_out(writer, c: GPTConfig) -> None:
    common_keys_out(writer, c)
    writer.add_layer_norm_eps(c.norm_eps)


# llama.cpp's gpt2: the converter writes Conv1D's matrices transposed, (out, in), which our Linear layers already are
GGUF = GGUFLayout(
    top={**LAYERNORM_GGUF_TOP, "transformer.wpe.weight": "position_embd.weight"},
    block=LAYERNORM_GGUF_BLOCK,
    config_in=lambda keys, shapes: {**layernorm_gguf_config_in(keys, shapes), "pos_encoding": "learned"},
    keys_out=gguf_keys_out,
    features=on_llama_cpp("gpt2", FEATURES, mlp=GELU_TANH),
)

FAMILY = Family(
    model_type="gpt2",
    hf_class="GPT2LMHeadModel",
    gguf_arch="gpt2",
    top=TOP,
    block=BLOCK,
    prefix="transformer.h",
    config_in=config_in,
    config_out=config_out,
    features=FEATURES,
    conv1d=True,
    to_ours=transpose,
    to_theirs=transpose,
    names=("GPT-2", "DistilGPT2"),
    gguf=GGUF,
)
