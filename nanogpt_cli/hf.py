"""The one name mapping between our weights and Hugging Face GPT-2 / Llama models.

    model = GPT.from_hf(GPT2LMHeadModel.from_pretrained("gpt2"));  hf_model = model.to_hf()
"""

from __future__ import annotations

import torch

from nanogpt_cli.config import GPTConfig
from nanogpt_cli.model import GPT

# ours <- theirs, per block; {i} is the layer. A tuple on the right is concatenated along dim 0 (fused).
GPT2_BLOCK = {
    "ln_1.weight": "ln_1.weight", "ln_1.bias": "ln_1.bias",
    "attn.c_attn.weight": "attn.c_attn.weight", "attn.c_attn.bias": "attn.c_attn.bias",
    "attn.c_proj.weight": "attn.c_proj.weight", "attn.c_proj.bias": "attn.c_proj.bias",
    "ln_2.weight": "ln_2.weight", "ln_2.bias": "ln_2.bias",
    "mlp.c_fc.weight": "mlp.c_fc.weight", "mlp.c_fc.bias": "mlp.c_fc.bias",
    "mlp.c_proj.weight": "mlp.c_proj.weight", "mlp.c_proj.bias": "mlp.c_proj.bias",
}
GPT2_TOP = {"transformer.wte.weight": "transformer.wte.weight", "transformer.wpe.weight": "transformer.wpe.weight",
            "transformer.ln_f.weight": "transformer.ln_f.weight", "transformer.ln_f.bias": "transformer.ln_f.bias"}
# GPT-2 stores its linear layers as Conv1D, (in, out): transposed relative to nn.Linear
GPT2_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")

LLAMA_BLOCK = {
    "ln_1.weight": "input_layernorm.weight",
    "attn.c_attn.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "attn.c_proj.weight": "self_attn.o_proj.weight",
    "ln_2.weight": "post_attention_layernorm.weight",
    "mlp.c_fc.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.c_proj.weight": "mlp.down_proj.weight",
}
LLAMA_TOP = {"transformer.wte.weight": "model.embed_tokens.weight", "transformer.ln_f.weight": "model.norm.weight"}


def _kind(hf_config) -> str:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in ("gpt2", "llama"):
        raise ValueError(f"only GPT-2 and Llama models convert, not {model_type!r}")
    return model_type


def config_from_hf(hf_config) -> GPTConfig:
    if _kind(hf_config) == "gpt2":
        if hf_config.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"GPT-2 with activation {hf_config.activation_function!r} has no counterpart here")
        return GPTConfig(vocab_size=hf_config.vocab_size, block_size=hf_config.n_positions, n_layer=hf_config.n_layer,
                         n_head=hf_config.n_head, n_embd=hf_config.n_embd, bias=True, pos_encoding="learned",
                         norm="layernorm", norm_eps=hf_config.layer_norm_epsilon, mlp="gelu_tanh",
                         mlp_hidden=hf_config.n_inner, tie_embeddings=hf_config.tie_word_embeddings)
    c = hf_config
    if c.num_key_value_heads != c.num_attention_heads:
        raise ValueError("grouped-query attention (num_key_value_heads != num_attention_heads) is not supported")
    if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
        raise ValueError("Llama models with attention or MLP biases are not supported")
    rope = getattr(c, "rope_parameters", None) or {"rope_type": "default", "rope_theta": getattr(c, "rope_theta", 1e4)}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"RoPE scaling {rope['rope_type']!r} is not supported")
    if c.hidden_size // c.num_attention_heads != getattr(c, "head_dim", None) and getattr(c, "head_dim", None):
        raise ValueError("Llama models whose head_dim is not hidden_size / num_attention_heads are not supported")
    return GPTConfig(vocab_size=c.vocab_size, block_size=c.max_position_embeddings, n_layer=c.num_hidden_layers,
                     n_head=c.num_attention_heads, n_embd=c.hidden_size, bias=False, pos_encoding="rope",
                     rope_theta=float(rope["rope_theta"]), norm="rmsnorm", norm_eps=c.rms_norm_eps, mlp="swiglu",
                     mlp_hidden=c.intermediate_size, tie_embeddings=c.tie_word_embeddings)


def _mapping(config: GPTConfig, kind: str) -> dict[str, str | tuple[str, ...]]:
    """Every one of our state-dict names -> the Hugging Face name(s) it comes from."""
    top, block, prefix = (GPT2_TOP, GPT2_BLOCK, "transformer.h") if kind == "gpt2" else \
        (LLAMA_TOP, LLAMA_BLOCK, "model.layers")
    names: dict[str, str | tuple[str, ...]] = dict(top)
    for i in range(config.n_layer):
        for ours, theirs in block.items():
            if isinstance(theirs, tuple):
                names[f"transformer.h.{i}.{ours}"] = tuple(f"{prefix}.{i}.{t}" for t in theirs)
            else:
                names[f"transformer.h.{i}.{ours}"] = f"{prefix}.{i}.{theirs}"
    if not config.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    return names


def from_hf(hf_model) -> GPT:
    config = config_from_hf(hf_model.config)
    kind = _kind(hf_model.config)
    theirs = hf_model.state_dict()
    model = GPT(config)
    ours = model.state_dict()
    with torch.no_grad():
        for name, source in _mapping(config, kind).items():
            if name not in ours:
                continue
            if isinstance(source, tuple):
                tensor = torch.cat([theirs[s] for s in source], dim=0)
            else:
                tensor = theirs[source]
                if kind == "gpt2" and name.endswith(GPT2_TRANSPOSED):
                    tensor = tensor.t()
            assert tensor.shape == ours[name].shape, f"{name}: {tuple(tensor.shape)} vs {tuple(ours[name].shape)}"
            ours[name].copy_(tensor)
    return model


def to_hf(model: GPT):
    import transformers

    c = model.config
    if c.qk_norm or c.logit_softcap is not None:  # zero_init_proj changes only the init: it converts
        raise ValueError("GPT-2 and Llama have no QK-norm or logit soft-capping, so a model trained with --qk-norm "
                         "or --logit-softcap does not convert to Hugging Face")
    if c.pos_encoding == "learned" and c.norm == "layernorm" and c.mlp == "gelu_tanh" and c.bias:
        kind = "gpt2"
        hf_config = transformers.GPT2Config(vocab_size=c.vocab_size, n_positions=c.block_size, n_embd=c.n_embd,
                                            n_layer=c.n_layer, n_head=c.n_head, n_inner=c.hidden_size,
                                            activation_function="gelu_new", layer_norm_epsilon=c.norm_eps,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                            tie_word_embeddings=c.tie_embeddings)
        hf_model = transformers.GPT2LMHeadModel(hf_config)
    elif c.pos_encoding == "rope" and c.norm == "rmsnorm" and c.mlp == "swiglu" and not c.bias:
        kind = "llama"
        hf_config = transformers.LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.n_embd,
                                             intermediate_size=c.hidden_size, num_hidden_layers=c.n_layer,
                                             num_attention_heads=c.n_head, num_key_value_heads=c.n_head,
                                             max_position_embeddings=c.block_size, rms_norm_eps=c.norm_eps,
                                             rope_theta=c.rope_theta, tie_word_embeddings=c.tie_embeddings)
        hf_model = transformers.LlamaForCausalLM(hf_config)
    else:
        raise ValueError("only GPT-2 shaped (learned positions, LayerNorm, gelu_tanh, biases) or Llama shaped "
                         "(RoPE, RMSNorm, SwiGLU, no biases) models convert to Hugging Face")
    ours = model.state_dict()
    theirs = hf_model.state_dict()
    with torch.no_grad():
        for name, target in _mapping(c, kind).items():
            tensor = ours[name]
            if isinstance(target, tuple):
                for t, part in zip(target, tensor.split([theirs[t].size(0) for t in target], dim=0)):
                    theirs[t].copy_(part)
            else:
                if kind == "gpt2" and name.endswith(GPT2_TRANSPOSED):
                    tensor = tensor.t()
                theirs[target].copy_(tensor)
    hf_model.eval()
    return hf_model
