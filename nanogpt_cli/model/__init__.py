"""The model: the GPT (gpt.py), its blocks (blocks.py), its attention with RoPE and the KV cache's interface
(attention.py). How a decode step is computed fast lives in inference/backends/.

    from nanogpt_cli.model import GPT
    model = GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128))

Imports torch and config only.
"""

from nanogpt_cli.config import GPTConfig
from nanogpt_cli.model.attention import (
    AttentionOps,
    Cache,
    CausalSelfAttention,
    Context,
    NormRopeQKV,
    apply_rope,
    attention,
    causal_mask,
    rope_inv_freq,
    rope_tables,
    yarn_attention_factor,
)
from nanogpt_cli.model.blocks import MLP, Block, BlockOps, activation, block_forward, softcap
from nanogpt_cli.model.gpt import GPT, ModelOps, sinusoidal_table

__all__ = [
    "GPT",
    "MLP",
    "AttentionOps",
    "Block",
    "BlockOps",
    "Cache",
    "CausalSelfAttention",
    "Context",
    "GPTConfig",
    "ModelOps",
    "NormRopeQKV",
    "activation",
    "apply_rope",
    "attention",
    "block_forward",
    "causal_mask",
    "rope_inv_freq",
    "rope_tables",
    "sinusoidal_table",
    "softcap",
    "yarn_attention_factor",
]
