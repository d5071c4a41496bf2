"""The one name mapping between our weights and Hugging Face GPT-2 / Llama / GPT-NeoX models, their tokenizers, and
loading a Hugging Face model (`hf:NAME` from the hub, or a local folder) as our GPT plus our tokenizer.

    model = GPT.from_hf(GPT2LMHeadModel.from_pretrained("gpt2"));  hf_model = model.to_hf()
    model, tokenizer_desc = load_pretrained("path/to/hf_dir")  # any tokenizer.json: hf_tokenizer.py

Which stock architecture computes which of our configs exactly (`hf_kind`):
- gpt2: learned or sinusoidal positions (a sinusoidal table becomes the learned table), LayerNorm, GELU (exact or
  tanh); a model without biases gets zero biases.
- llama: RoPE, RMSNorm, SwiGLU; grouped-query attention (num_key_value_heads), any head_dim, RoPE scaling
  (linear, llama3, yarn); biases through Llama's attention_bias (q, k, v and o) and mlp_bias.
- gpt_neox: RoPE (on the whole head, or --rotary-dim of it: rotary_pct), LayerNorm, GELU, the sequential
  residual (our default config) or the parallel one (Pythia's); zero biases.
Importing is the inverse: a model whose bias tensors are all zero becomes a model without biases, one whose only
non-zero biases are on q, k and v (Qwen2's) a model with --qkv-bias.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

import torch

from nanogpt_cli import errors
from nanogpt_cli.config import GPTConfig
from nanogpt_cli.errors import NanoGPTError, first_line
from nanogpt_cli.model import GPT, yarn_attention_factor

# ours <- theirs, per block; {i} is the layer. A tuple on the right is concatenated along dim 0 (fused).
GPT2_BLOCK = {
    "ln_1.weight": "ln_1.weight",
    "ln_1.bias": "ln_1.bias",
    "attn.c_attn.weight": "attn.c_attn.weight",
    "attn.c_attn.bias": "attn.c_attn.bias",
    "attn.c_proj.weight": "attn.c_proj.weight",
    "attn.c_proj.bias": "attn.c_proj.bias",
    "ln_2.weight": "ln_2.weight",
    "ln_2.bias": "ln_2.bias",
    "mlp.c_fc.weight": "mlp.c_fc.weight",
    "mlp.c_fc.bias": "mlp.c_fc.bias",
    "mlp.c_proj.weight": "mlp.c_proj.weight",
    "mlp.c_proj.bias": "mlp.c_proj.bias",
}
GPT2_TOP = {
    "transformer.wte.weight": "transformer.wte.weight",
    "transformer.wpe.weight": "transformer.wpe.weight",
    "transformer.ln_f.weight": "transformer.ln_f.weight",
    "transformer.ln_f.bias": "transformer.ln_f.bias",
}
# GPT-2 stores its linear layers as Conv1D, (in, out): transposed relative to nn.Linear
GPT2_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")

LLAMA_BLOCK = {
    "ln_1.weight": "input_layernorm.weight",
    "attn.c_attn.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "attn.c_attn.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "attn.c_proj.weight": "self_attn.o_proj.weight",
    "attn.c_proj.bias": "self_attn.o_proj.bias",
    "ln_2.weight": "post_attention_layernorm.weight",
    "mlp.c_fc.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.c_fc.bias": ("mlp.gate_proj.bias", "mlp.up_proj.bias"),
    "mlp.c_proj.weight": "mlp.down_proj.weight",
    "mlp.c_proj.bias": "mlp.down_proj.bias",
}
LLAMA_TOP = {"transformer.wte.weight": "model.embed_tokens.weight", "transformer.ln_f.weight": "model.norm.weight"}

NEOX_BLOCK = {
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
NEOX_TOP = {
    "transformer.wte.weight": "gpt_neox.embed_in.weight",
    "transformer.ln_f.weight": "gpt_neox.final_layer_norm.weight",
    "transformer.ln_f.bias": "gpt_neox.final_layer_norm.bias",
}

ARCHS = {  # model_type -> (top names, block names, block prefix, transformers class)
    "gpt2": (GPT2_TOP, GPT2_BLOCK, "transformer.h", "GPT2LMHeadModel"),
    "llama": (LLAMA_TOP, LLAMA_BLOCK, "model.layers", "LlamaForCausalLM"),
    "gpt_neox": (NEOX_TOP, NEOX_BLOCK, "gpt_neox.layers", "GPTNeoXForCausalLM"),
}
GELUS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}  # theirs -> our --mlp


@contextlib.contextmanager
def quiet_transformers():
    """transformers' own progress bars and warnings ("Loading weights ...") off: our commands print one summary
    line, or one error sentence."""
    logging = require("transformers").utils.logging
    hub_logging = require("huggingface_hub").utils.logging  # its retry warnings; download bars stay
    verbosity, hub_verbosity, bars = (
        logging.get_verbosity(),
        hub_logging.get_verbosity(),
        logging.is_progress_bar_enabled(),
    )
    logging.set_verbosity_error()
    hub_logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        hub_logging.set_verbosity(hub_verbosity)
        if bars:
            logging.enable_progress_bar()


def require(module: str):
    """Import an optional dependency of the hf extra, or say in one sentence how to install it."""
    return errors.require(module, "hf")


# --- which architecture ---------------------------------------------------------------------------------


def hf_kind(c: GPTConfig) -> str:
    """The stock architecture that computes exactly what this config computes, or one sentence saying why none
    does, naming the closest one and the flags to change."""
    if c.qk_norm or c.logit_softcap is not None:  # --zero-init-proj changes only the init: it converts
        raise NanoGPTError(
            "no stock Hugging Face architecture has QK-norm or logit soft-capping; a model trained "
            "with --qk-norm or --logit-softcap does not convert (train without them to export)"
        )
    if c.sliding_window is not None:
        raise NanoGPTError(
            "no Hugging Face export here has sliding-window attention: a model trained with --sliding-window does "
            "not convert"
        )
    gemma = [f"--{f.replace('_', '-')}" for f in ("embed_scale", "norm_offset", "post_norms") if getattr(c, f)]
    if gemma or c.mlp == "geglu":
        raise NanoGPTError(
            f"no Hugging Face export here has Gemma's {' '.join(gemma + (['--mlp geglu'] if c.mlp == 'geglu' else []))}"
            ": a model trained with them does not convert"
        )
    gelu = c.mlp in ("gelu", "gelu_tanh")
    neox_only = [f for f, on in (("--parallel-residual", c.parallel_residual), ("--rotary-dim", c.rotary_dim)) if on]
    if neox_only and not (c.pos_encoding == "rope" and c.norm == "layernorm" and gelu):
        raise NanoGPTError(
            f"{' and '.join(neox_only)} export as GPTNeoXForCausalLM only, which needs --pos-encoding rope, "
            "--norm layernorm and --mlp gelu or gelu_tanh"
        )
    kind = _stock_kind(c, gelu)
    extra = [
        flag
        for flag, used in (
            ("--n-kv-head", c.kv_heads != c.n_head),
            ("--head-dim", c.head_size * c.n_head != c.n_embd),
            ("--qkv-bias", c.attn_bias != c.bias),
            ("--rope-scaling", c.rope_scaling != "none"),
        )
        if used
    ]
    if extra and kind != "llama":
        raise NanoGPTError(
            f"{', '.join(extra)} export to LlamaForCausalLM only, which needs --pos-encoding rope --norm rmsnorm "
            "--mlp swiglu"
        )
    return kind


def _stock_kind(c: GPTConfig, gelu: bool) -> str:
    """hf_kind for the block's position scheme, norm and MLP."""
    if c.pos_encoding in ("learned", "sinusoidal"):
        if c.norm == "layernorm" and gelu:
            return "gpt2"
        raise NanoGPTError(
            f"no stock Hugging Face architecture computes --pos-encoding {c.pos_encoding} with --norm "
            f"{c.norm} and --mlp {c.mlp}; the closest, GPT2LMHeadModel, needs --norm layernorm and "
            "--mlp gelu or gelu_tanh"
        )
    if c.norm == "rmsnorm" and c.mlp == "swiglu":
        return "llama"
    if c.norm == "layernorm" and gelu:
        return "gpt_neox"
    # the closest: Llama when the MLP is SwiGLU or the norm RMSNorm, else GPT-NeoX; name only the flags that differ
    if c.mlp == "swiglu" or (c.norm == "rmsnorm" and not gelu):
        closest, needs = (
            "LlamaForCausalLM",
            [
                f
                for f in ("--norm rmsnorm" if c.norm != "rmsnorm" else "", "--mlp swiglu" if c.mlp != "swiglu" else "")
                if f
            ],
        )
    else:
        closest, needs = (
            "GPTNeoXForCausalLM",
            [f for f in ("--norm layernorm" if c.norm != "layernorm" else "", "--mlp gelu" if not gelu else "") if f],
        )
    raise NanoGPTError(
        f"no stock Hugging Face architecture computes RoPE with --norm {c.norm} and --mlp {c.mlp}; "
        f"the closest, {closest}, needs {' '.join(needs)}"
    )


def _check_kind(hf_config) -> str:
    kind = getattr(hf_config, "model_type", None)
    if kind not in ARCHS:
        raise NanoGPTError(f"only GPT-2, Llama and GPT-NeoX models convert, not {kind!r}")
    return kind


def _rope(c) -> dict[str, Any]:
    """transformers' RoPE parameters (rope_parameters in 5.x, rope_scaling in 4.x), {} when it has none."""
    return getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}


def _rope_theta(c) -> float:
    rope = _rope(c)
    theta = rope.get("rope_theta", getattr(c, "rope_theta", None) or getattr(c, "rotary_emb_base", None) or 1e4)
    return float(theta)


def rope_scaling_from_hf(c) -> dict[str, Any]:
    """Our rope_* fields for a transformers config's RoPE scaling (default, linear, llama3, yarn), or one sentence
    saying it has no counterpart."""
    rope = _rope(c)
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


def config_from_hf(c, bias: bool, qkv_bias: bool | None = None) -> GPTConfig:
    """Our config for a transformers config; `bias`: whether any of the model's bias tensors is non-zero (besides
    q, k and v's when qkv_bias is given: whether theirs are)."""
    kind = _check_kind(c)
    if kind == "gpt2":
        if c.activation_function not in GELUS:
            raise NanoGPTError(f"GPT-2 with activation {c.activation_function!r} has no counterpart here")
        if c.scale_attn_by_inverse_layer_idx or c.reorder_and_upcast_attn or not c.scale_attn_weights:
            raise NanoGPTError("GPT-2 models with non-default attention scaling have no counterpart here")
        config = GPTConfig(
            vocab_size=c.vocab_size,
            block_size=c.n_positions,
            n_layer=c.n_layer,
            n_head=c.n_head,
            n_embd=c.n_embd,
            bias=bias,
            pos_encoding="learned",
            norm="layernorm",
            norm_eps=c.layer_norm_epsilon,
            mlp=GELUS[c.activation_function],
            mlp_hidden=c.n_inner,
            tie_embeddings=c.tie_word_embeddings,
        )
    elif kind == "llama":
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        if c.hidden_act != "silu":
            raise NanoGPTError(f"Llama with activation {c.hidden_act!r} has no counterpart here")
        config = GPTConfig(
            vocab_size=c.vocab_size,
            block_size=c.max_position_embeddings,
            n_layer=c.num_hidden_layers,
            n_head=c.num_attention_heads,
            n_embd=c.hidden_size,
            n_kv_head=c.num_key_value_heads if c.num_key_value_heads != c.num_attention_heads else None,
            head_dim=head_dim if head_dim * c.num_attention_heads != c.hidden_size else None,
            bias=bias,
            qkv_bias=qkv_bias if qkv_bias is not None and qkv_bias != bias else None,
            pos_encoding="rope",
            rope_theta=_rope_theta(c),
            **rope_scaling_from_hf(c),
            norm="rmsnorm",
            norm_eps=c.rms_norm_eps,
            mlp="swiglu",
            mlp_hidden=c.intermediate_size,
            tie_embeddings=c.tie_word_embeddings,
        )
    else:
        config = _neox_config(c, bias)
    if (
        config.mlp_hidden is not None
        and config.mlp_hidden == GPTConfig(**{**config.to_dict(), "mlp_hidden": None}).hidden_size
    ):
        config.mlp_hidden = None  # the default width: keep the config as a user would have written it
    return config


def _neox_config(c, bias: bool) -> GPTConfig:
    """Our config for a GPTNeoXConfig (config_from_hf)."""
    rope = _rope(c)
    partial = rope.get("partial_rotary_factor", getattr(c, "rotary_pct", 1.0))
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        kind = rope.get("rope_type", rope.get("type"))
        raise NanoGPTError(f"RoPE scaling {kind!r} on GPT-NeoX has no counterpart here")
    hs = c.hidden_size // c.num_attention_heads
    rotary_dim = int(hs * partial)  # as GPT-NeoX computes rotary_ndims
    if rotary_dim % 2 or rotary_dim == 0:
        raise NanoGPTError(f"GPT-NeoX's rotary dimensions ({rotary_dim} of {hs}) must be even and at least 2")
    if c.hidden_act not in GELUS:
        raise NanoGPTError(f"GPT-NeoX with activation {c.hidden_act!r} has no counterpart here")
    return GPTConfig(
        vocab_size=c.vocab_size,
        block_size=c.max_position_embeddings,
        n_layer=c.num_hidden_layers,
        n_head=c.num_attention_heads,
        n_embd=c.hidden_size,
        bias=bias,
        pos_encoding="rope",
        rope_theta=_rope_theta(c),
        norm="layernorm",
        norm_eps=c.layer_norm_eps,
        mlp=GELUS[c.hidden_act],
        mlp_hidden=c.intermediate_size,
        tie_embeddings=c.tie_word_embeddings,
        rotary_dim=None if rotary_dim == hs else rotary_dim,
        parallel_residual=bool(c.use_parallel_residual),
    )


def hf_config_for(c: GPTConfig, kind: str, special: dict[str, int | None]) -> tuple[Any, dict[str, Any]]:
    """The transformers config for our config, and keys to add to its config.json for older transformers versions
    (4.x reads only the top-level RoPE keys; llama.cpp's GPT-2 converter wants n_ctx). special: bos/eos/pad ids."""
    transformers = require("transformers")
    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    if kind == "gpt2":
        act = "gelu_new" if c.mlp == "gelu_tanh" else "gelu"
        config = transformers.GPT2Config(
            vocab_size=c.vocab_size,
            n_positions=c.block_size,
            n_embd=c.n_embd,
            n_layer=c.n_layer,
            n_head=c.n_head,
            n_inner=c.hidden_size,
            activation_function=act,
            layer_norm_epsilon=c.norm_eps,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=c.tie_embeddings,
            **special,
        )
        return config, {"n_ctx": c.block_size}
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=c.vocab_size,
            hidden_size=c.n_embd,
            intermediate_size=c.hidden_size,
            num_hidden_layers=c.n_layer,
            num_attention_heads=c.n_head,
            num_key_value_heads=c.kv_heads,
            head_dim=c.head_size,
            max_position_embeddings=c.block_size,
            rms_norm_eps=c.norm_eps,
            attention_bias=c.bias or c.attn_bias,  # q, k, v and o together: an o_proj bias we lack is zero
            mlp_bias=c.bias,
            rope_theta=c.rope_theta,
            rope_parameters=rope_scaling_to_hf(c),
            tie_word_embeddings=c.tie_embeddings,
            **special,
        )
        extra: dict[str, Any] = {"rope_theta": c.rope_theta}
        if c.rope_scaling != "none":  # 4.x reads the scaling from rope_scaling
            extra["rope_scaling"] = {k: v for k, v in rope_scaling_to_hf(c).items() if k != "rope_theta"}
        return config, extra
    pct = c.rotary_size / c.head_size
    while int(c.head_size * pct) < c.rotary_size:  # GPT-NeoX's rotary_ndims = int(head_size * pct), which rounds down
        pct = math.nextafter(pct, 2.0)
    config = transformers.GPTNeoXConfig(
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
        rope_parameters={**rope, "partial_rotary_factor": pct},
        use_parallel_residual=c.parallel_residual,
        attention_bias=True,
        tie_word_embeddings=c.tie_embeddings,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **special,
    )
    return config, {"rope_theta": c.rope_theta, "rotary_emb_base": c.rope_theta, "rotary_pct": pct}


# --- weights --------------------------------------------------------------------------------------------


def _mapping(config: GPTConfig, kind: str) -> dict[str, str | tuple[str, ...]]:
    """Every one of our state-dict names -> the Hugging Face name(s) it comes from."""
    top, block, prefix, _ = ARCHS[kind]
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


def _neox_qkv(tensor: torch.Tensor, n_head: int, to_neox: bool) -> torch.Tensor:
    """Our fused c_attn rows are [q of all heads, k, v]; GPT-NeoX's are [q, k, v] of head 0, then head 1, ...
    (rows, ...) -> (rows, ...), for the weight (3C, C) and the bias (3C,)."""
    rest = tensor.shape[1:]
    hs = tensor.size(0) // (3 * n_head)
    shape = (3, n_head, hs) if to_neox else (n_head, 3, hs)
    return tensor.reshape(*shape, *rest).transpose(0, 1).reshape(3 * n_head * hs, *rest)


def _to_ours(kind: str, name: str, tensor: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    if kind == "gpt2" and name.endswith(GPT2_TRANSPOSED):
        return tensor.t()
    if kind == "gpt_neox" and name.endswith(("attn.c_attn.weight", "attn.c_attn.bias")):
        return _neox_qkv(tensor, config.n_head, to_neox=False)
    return tensor


def _to_theirs(kind: str, name: str, tensor: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    if kind == "gpt2" and name.endswith(GPT2_TRANSPOSED):
        return tensor.t()
    if kind == "gpt_neox" and name.endswith(("attn.c_attn.weight", "attn.c_attn.bias")):
        return _neox_qkv(tensor, config.n_head, to_neox=True)
    return tensor


def peft_tensors(
    config: GPTConfig, kind: str, layers: dict[str, tuple[torch.Tensor, torch.Tensor]]
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Our LoRA adapters ({module name: (A (r, in), B (out, r))}) as a PEFT adapter's tensors for the `kind` model,
    and the exact paths of the modules they go on. A fused projection of ours that is several modules there
    (Llama's q/k/v_proj, gate/up_proj) gives each its rows of B and the same A: B_q A is the q rows of B A.
    GPT-NeoX's fused rows are ordered by head (_neox_qkv); GPT-2's Conv1D needs no transpose here, as PEFT keeps
    lora_A and lora_B as linear layers there too (fan_in_fan_out applies to the merge)."""
    names = _mapping(config, kind)
    tensors: dict[str, torch.Tensor] = {}
    targets: list[str] = []
    for module, (a, b) in layers.items():
        theirs = names[f"{module}.weight"]
        theirs = theirs if isinstance(theirs, tuple) else (theirs,)
        if kind == "gpt_neox" and module.endswith("attn.c_attn"):
            b = _neox_qkv(b, config.n_head, to_neox=True)
        sizes = _fused_sizes(config, module, b.size(0), len(theirs))
        for name, part in zip(theirs, b.split(sizes, dim=0)):
            path = name.removesuffix(".weight")
            tensors[f"base_model.model.{path}.lora_A.weight"] = a.float().contiguous().clone()
            tensors[f"base_model.model.{path}.lora_B.weight"] = part.float().contiguous().clone()
            targets.append(path)
    return tensors, targets


def _fused_sizes(config: GPTConfig, module: str, rows: int, parts: int) -> list[int]:
    """The rows of each part of one of our fused projections: q, k and v (nh, nkv, nkv heads), or equal parts."""
    if parts == 3 and module.endswith("attn.c_attn"):
        return [n * config.head_size for n in (config.n_head, config.kv_heads, config.kv_heads)]
    return [rows // parts] * parts


def _has_bias(state: dict[str, torch.Tensor], qkv: bool | None = None) -> bool:
    """Whether any bias is non-zero; qkv True: among q, k and v's only, False: among the others only."""

    def counted(name: str) -> bool:
        on_qkv = name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))
        return qkv is None or on_qkv == qkv

    biases = [t for name, t in state.items() if name.endswith(".bias") and counted(name)]
    return any(t.is_floating_point() and bool(t.any()) for t in biases)


def from_hf(hf_model) -> GPT:
    """Our GPT with the weights of a transformers GPT2LMHeadModel, LlamaForCausalLM or GPTNeoXForCausalLM."""
    kind = _check_kind(hf_model.config)
    theirs = {k: v.float() for k, v in hf_model.state_dict().items()}
    if kind == "llama":  # Qwen2-style biases on q, k and v only are --qkv-bias
        config = config_from_hf(hf_model.config, bias=_has_bias(theirs, qkv=False), qkv_bias=_has_bias(theirs, True))
    else:
        config = config_from_hf(hf_model.config, bias=_has_bias(theirs))
    model = GPT(config)
    ours = model.state_dict()
    with torch.no_grad():
        for name, source in _mapping(config, kind).items():
            if name not in ours:
                continue  # a bias of theirs that is zero, or positions we compute (RoPE)
            sources = source if isinstance(source, tuple) else (source,)
            if not all(s in theirs for s in sources):  # only biases may be absent (Llama without mlp_bias)
                assert name.endswith(".bias"), f"{name}: {sources} missing from the Hugging Face model"
                ours[name].zero_()
                continue
            tensor = _to_ours(kind, name, torch.cat([theirs[s] for s in sources], dim=0), config)
            assert tensor.shape == ours[name].shape, f"{name}: {tuple(tensor.shape)} vs {tuple(ours[name].shape)}"
            ours[name].copy_(tensor)
    return model


def to_hf(model: GPT, special: dict[str, int | None] | None = None):
    """A transformers model computing what `model` computes (raises NanoGPTError when no stock one does).
    special: bos_token_id / eos_token_id / pad_token_id for its config (default: none)."""
    c = model.config
    kind = hf_kind(c)
    special = special or {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    hf_config, _ = hf_config_for(c, kind, special)
    transformers = require("transformers")
    hf_model = getattr(transformers, ARCHS[kind][3])(hf_config)
    ours = model.state_dict()
    if c.pos_encoding == "sinusoidal":  # the fixed table becomes GPT-2's learned one
        ours["transformer.wpe.weight"] = model.pos_table
    theirs = hf_model.state_dict()
    filled = set()
    with torch.no_grad():
        for name, target in _mapping(c, kind).items():
            if name not in ours:
                continue  # a bias we do not have: zeroed below
            tensor = _to_theirs(kind, name, ours[name].detach(), c)
            targets = target if isinstance(target, tuple) else (target,)
            for t, part in zip(targets, tensor.split([theirs[t].size(0) for t in targets], dim=0)):
                theirs[t].copy_(part)
                filled.add(t)
        for name, tensor in theirs.items():
            if name in filled or (c.tie_embeddings and name == "lm_head.weight"):
                continue
            assert name.endswith(".bias"), f"{name} of the {kind} model has no counterpart in ours"
            tensor.zero_()  # a model without biases is the same model with zero biases
    hf_model.eval()
    return hf_model


# --- tokenizers -----------------------------------------------------------------------------------------


def _gpt2_files() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """GPT-2's vocabulary (token string -> id) and merges, from the packaged files tiktoken's gpt2 is built from."""
    from nanogpt_cli.tokenizer import ASSETS_DIR

    vocab = json.loads((ASSETS_DIR / "encoder.json").read_text(encoding="utf-8"))
    lines = (ASSETS_DIR / "vocab.bpe").read_text(encoding="utf-8").split("\n")[1:]  # line 0 is a version comment
    merges = [tuple(line.split(" ")) for line in lines if line]
    return vocab, merges


def byte_alphabet() -> list[str]:
    """The printable character GPT-2's byte-level BPE writes for each byte value 0..255, read off the packaged
    GPT-2 vocabulary: its first 256 tokens are the single bytes."""
    from nanogpt_cli.tokenizer import build_tokenizer

    enc = build_tokenizer("gpt2").enc
    vocab, _ = _gpt2_files()
    by_id = {i: s for s, i in vocab.items() if i < 256}
    alphabet = [""] * 256
    for i in range(256):
        alphabet[enc.decode_single_token_bytes(i)[0]] = by_id[i]
    return alphabet


def tokenizers_object(desc: dict[str, Any]):
    """A `tokenizers.Tokenizer` with the same ids as our tokenizer described by `desc`, and its end-of-text token
    (or None). gpt2: GPT-2's byte-level BPE; char: a BPE with no merges over the characters, joined back by a Fuse
    decoder; byte: a BPE with no merges over GPT-2's byte alphabet. Other encodings: one sentence."""
    tk = require("tokenizers")
    name = desc["name"]
    if name == "gpt2":
        vocab, merges = _gpt2_files()
        tok = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=merges))
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tk.decoders.ByteLevel()
        tok.add_special_tokens([tk.AddedToken("<|endoftext|>", special=True)])
        return tok, "<|endoftext|>"
    if name == "byte":
        tok = tk.Tokenizer(tk.models.BPE(vocab={ch: b for b, ch in enumerate(byte_alphabet())}, merges=[]))
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = tk.decoders.ByteLevel()
        return tok, None
    if name == "char":
        tok = tk.Tokenizer(tk.models.BPE(vocab={ch: i for i, ch in enumerate(desc["chars"])}, merges=[]))
        tok.decoder = tk.decoders.Fuse()
        return tok, None
    if desc.get("kind") == "bpe":
        return _trained_bpe_object(desc, tk)
    raise NanoGPTError(
        f"the {name} tokenizer does not export: only gpt2, char, byte and trained vocabularies have an "
        "exact Hugging Face tokenizer here"
    )


def _trained_bpe_object(desc: dict[str, Any], tk):
    """A trained BPE as a byte-level `tokenizers` BPE: the ranks in GPT-2's byte alphabet, merges derived from the
    ranks, the split pattern, and `ignore_merges` (a piece that is a whole token is that token, as in tiktoken)."""
    from nanogpt_cli.tokenizer import EOT, PATTERNS, merges_from_ranks, spell_bytes, tokenizer_from_description

    ours = tokenizer_from_description(desc)
    vocab = {spell_bytes(t): i for i, t in enumerate(ours.ranks)}
    merges = [(spell_bytes(a), spell_bytes(b)) for a, b in merges_from_ranks(ours.ranks)]
    tok = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    if ours.pattern == PATTERNS["gpt2"]:  # the ByteLevel pre-tokenizer's own regex is GPT-2's
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = tk.pre_tokenizers.Sequence(
            [
                tk.pre_tokenizers.Split(tk.Regex(ours.pattern), behavior="isolated"),
                tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = tk.decoders.ByteLevel()
    tok.add_special_tokens(
        [
            tk.AddedToken(t, special=True, normalized=False)
            for t in sorted(ours.special_tokens, key=ours.special_tokens.get)
        ]
    )
    return tok, EOT if EOT in ours.special_tokens else None


def _describe_trained_bpe(backend, spec: dict[str, Any]) -> dict[str, Any] | None:
    """Our description of a byte-level BPE that `_trained_bpe_object` wrote (ids 0..255 the bytes in order, the
    ranks after them, special tokens last), or None when the tokenizer is not one."""
    from nanogpt_cli.tokenizer import PATTERNS, BPETokenizer, byte_to_unicode

    byte_of = {ch: b for b, ch in enumerate(byte_to_unicode())}
    added = {t.content: i for i, t in backend.get_added_tokens_decoder().items()}
    regular = sorted((i, t) for t, i in backend.get_vocab(with_added_tokens=False).items())
    if (
        [i for i, _ in regular] != list(range(len(regular)))
        or len(regular) < 256
        or any(not set(t) <= byte_of.keys() for _, t in regular)
    ):
        return None
    ranks = [bytes(byte_of[ch] for ch in t) for _, t in regular]
    if ranks[:256] != [bytes([b]) for b in range(256)]:
        return None
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        pattern = PATTERNS["gpt2"]
    elif pre.get("type") == "Sequence" and [p.get("type") for p in pre.get("pretokenizers", [])] == [
        "Split",
        "ByteLevel",
    ]:
        pattern = pre["pretokenizers"][0].get("pattern", {}).get("Regex")
    else:
        return None
    names = {v: k for k, v in PATTERNS.items()}
    return BPETokenizer("bpe", ranks, pattern, added, names.get(pattern)).describe()


def describe_hf_tokenizer(backend) -> dict[str, Any]:
    """Our tokenizer description for a `tokenizers.Tokenizer` (a fast tokenizer's backend_tokenizer): GPT-2's BPE,
    or a char or byte vocabulary as `tokenizers_object` writes them; anything else is one sentence."""
    from nanogpt_cli.tokenizer import build_tokenizer

    vocab = backend.get_vocab(with_added_tokens=True)
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    merges = model.get("merges") or []
    decoder = (spec.get("decoder") or {}).get("type")
    if model.get("type") == "BPE":
        gpt2_vocab, _ = _gpt2_files()
        if vocab == gpt2_vocab and len(merges) == 50000:
            return build_tokenizer("gpt2").describe()
        if not merges and len(vocab) == 256 and vocab == {ch: b for b, ch in enumerate(byte_alphabet())}:
            return {"name": "byte", "vocab_size": 256}
        trained = _describe_trained_bpe(backend, spec) if merges else None
        if trained is not None:
            return trained
        chars = "".join(sorted(vocab, key=vocab.get))
        if (
            not merges
            and decoder == "Fuse"
            and all(len(t) == 1 for t in vocab)
            and sorted(vocab.values()) == list(range(len(vocab)))
            and chars == "".join(sorted(chars))
        ):
            return {"name": "char", "vocab_size": len(chars), "chars": chars}
    raise NanoGPTError(
        "this Hugging Face tokenizer is neither GPT-2's BPE nor a char, byte or trained vocabulary "
        "exported by nanogpt, so nanogpt cannot encode text for it"
    )


# --- loading a Hugging Face model -------------------------------------------------------------------------


def is_hf_source(source: str | Path) -> bool:
    """hf:NAME, or a folder holding a transformers config.json (not one of our run folders)."""
    if str(source).startswith("hf:"):
        return True
    path = Path(source)
    if not (path / "config.json").is_file() or ((path / "model.safetensors").is_file() and _is_ours(path)):
        return False
    try:
        return "model_type" in json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False


def _is_ours(path: Path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            return (f.metadata() or {}).get("format") == "nanogpt"
    except Exception:  # not a readable safetensors file: not ours either
        return False


def load_pretrained(source: str | Path) -> tuple[GPT, dict[str, Any]]:
    """Our GPT and our tokenizer description from `hf:NAME` (the hub, through from_pretrained) or a local folder
    (offline). Anything that cannot be loaded or converted is one sentence."""
    model, meta = load_pretrained_meta(source)
    return model, meta["tokenizer"]


def load_pretrained_meta(source: str | Path) -> tuple[GPT, dict[str, Any]]:
    """load_pretrained, with the metadata loading.load_model gives: the tokenizer's description; for a Hugging
    Face tokenizer the folder its tokenizer.json is in ("tokenizer_dir") and its chat template, when it has one."""
    transformers = require("transformers")
    source = str(source)
    online = source.startswith("hf:")
    name = source[3:] if online else source
    where = f"hf:{name}" if online else name
    if online and not name:
        raise NanoGPTError("hf: needs a model name, such as hf:gpt2")
    if not online and not Path(name).is_dir():
        raise NanoGPTError(f"{name} is not a folder holding a Hugging Face model")
    kwargs = {} if online else {"local_files_only": True}
    try:
        with quiet_transformers():
            hf_config = transformers.AutoConfig.from_pretrained(name, **kwargs)
    except OSError as e:
        if online:
            raise NanoGPTError(
                f"could not load {where} from the Hugging Face hub (offline, misspelt, or gated?): {first_line(e)}"
            ) from None
        raise NanoGPTError(f"{where} holds no readable Hugging Face config.json ({first_line(e)})") from None
    except ValueError as e:
        raise NanoGPTError(f"{where}: {first_line(e)}") from None
    _check_kind(hf_config)
    meta = _pretrained_tokenizer(transformers, name, where, kwargs)
    try:
        with quiet_transformers():
            hf_model = transformers.AutoModelForCausalLM.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as e:
        raise NanoGPTError(f"could not load the weights of {where} ({first_line(e)})") from None
    model = from_hf(hf_model)
    desc = meta["tokenizer"]
    if desc["vocab_size"] > model.config.vocab_size:
        raise NanoGPTError(
            f"{where} has {desc['vocab_size']:,} tokens but only {model.config.vocab_size:,} rows of embeddings"
        )
    return model, meta


def _pretrained_tokenizer(transformers, name: str, where: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The tokenizer of a Hugging Face model: ours when it is GPT-2's or one nanogpt exported, else its own
    tokenizer.json (hf_tokenizer.py), with the folder that holds it and its chat template."""
    from nanogpt_cli.hf_tokenizer import HF_FILE, TOKENIZER_DIR, read_hf_tokenizer

    try:
        with quiet_transformers():
            tokenizer = transformers.AutoTokenizer.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as e:
        raise NanoGPTError(f"{where} has no tokenizer that loads ({first_line(e)})") from None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise NanoGPTError(f"{where} has only a slow tokenizer; nanogpt reads tokenizer.json")
    try:
        return {"tokenizer": describe_hf_tokenizer(backend)}
    except NanoGPTError:
        if not where.startswith("hf:") and not (Path(name) / HF_FILE).is_file():
            raise
    tok = read_hf_tokenizer(where if where.startswith("hf:") else name)
    meta = {"tokenizer": tok.describe(), TOKENIZER_DIR: str(tok.folder)}
    if tok.chat_template:
        meta["chat_template"] = tok.chat_template
    return meta
