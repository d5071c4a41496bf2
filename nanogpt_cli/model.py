"""The GPT: a decoder-only Transformer with Pre-LN blocks, RoPE / sinusoidal / learned positions and a KV cache.

    model = GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128))
    logits, loss = model(idx, targets)

Shape legend: B batch, T tokens in this call, S tokens held in the KV cache, C n_embd, nh n_head,
hs head size (C // nh), H MLP hidden width, V vocab_size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.autograd.function import once_differentiable

from nanogpt_cli.config import GPTConfig

__all__ = ["GPT", "GPTConfig", "KVCache", "sinusoidal_table", "rope_tables", "apply_rope", "process_logits"]


# --- positions ---------------------------------------------------------------------------------------


def sinusoidal_table(n_pos: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    """Vaswani et al. (2017): pe[p, 2i] = sin(p / base^(2i/dim)), pe[p, 2i+1] = cos(same). (n_pos, dim)"""
    pos = torch.arange(n_pos, dtype=torch.float64)[:, None]
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = pos * inv_freq  # (n_pos, dim/2)
    pe = torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)  # interleave -> (n_pos, dim)
    return pe.float()


def rope_tables(positions: torch.Tensor, head_size: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin for RoPE (Su et al. 2021) at the given positions, in Llama's half-split layout,
    where x[i] and x[i + hs/2] form a rotating pair. The sin table's first half is negated, so that
    apply_rope needs one roll instead of a split, a negation and a concatenation. (T, hs) each"""
    inv_freq = theta ** (-torch.arange(0, head_size, 2, dtype=torch.float64, device=positions.device) / head_size)
    angles = positions.to(torch.float64)[:, None] * inv_freq  # (T, hs/2)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)  # (T, hs): the two halves of a head share frequencies
    sin = torch.cat([-angles.sin(), angles.sin()], dim=-1)
    return cos.float(), sin.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x[i], x[i + hs/2]) by their position's angle:
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin). x: (..., hs); cos, sin from rope_tables, broadcast to x."""
    half = x.size(-1) // 2
    return torch.addcmul(x * cos, x.roll(half, dims=-1), sin)  # roll: (x1, x2) -> (x2, x1)


# --- the KV cache -------------------------------------------------------------------------------------


class KVCache:
    """Keys and values of the tokens seen so far, preallocated for block_size tokens per layer."""

    def __init__(self, config: GPTConfig, batch_size: int, device, dtype):
        shape = (batch_size, config.n_head, config.block_size, config.head_size)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.capacity, self.dtype = config.block_size, dtype
        self.pos = 0  # tokens held, which is also the position of the next one

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this call's keys and values (B, nh, T, hs) and return all held ones (B, nh, S, hs)."""
        T = k.size(2)
        assert self.pos + T <= self.capacity, f"{self.pos} + {T} tokens overflow a cache of {self.capacity}"
        self.k[layer][:, :, self.pos:self.pos + T] = k
        self.v[layer][:, :, self.pos:self.pos + T] = v
        return self.k[layer][:, :, :self.pos + T], self.v[layer][:, :, :self.pos + T]


# --- layers ---------------------------------------------------------------------------------------------


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    # a function, not nn.Dropout modules: decoding one token at a time pays ~5 us per module call, and
    # dropout has no weights to hold
    return F.dropout(x, p, training) if training and p > 0 else x


class ReLUSquared(torch.autograd.Function):
    """relu(h)**2 with a hand-written backward, 2 * relu(h) * grad: autograd's own graph for relu().square()
    makes six passes over the (B, T, H) hidden layer where this makes four, and on a CPU, where these passes
    are bound by memory, it was 4.5x slower (8.4 against 1.8 ms for a 12 x 128 x 512 forward and backward)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor) -> torch.Tensor:
        r = F.relu(h)
        ctx.save_for_backward(r)
        return r * r

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (r,) = ctx.saved_tensors
        return grad.mul(r).mul_(2.0)


def activation(h: torch.Tensor, mlp: str) -> torch.Tensor:
    """The MLP's nonlinearity on its hidden layer (B, T, H), or on the fused gate and up halves (B, T, 2H)."""
    if mlp == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    if mlp == "relu2":  # squared ReLU (So et al. 2021, Primer): as cheap as ReLU, trains like GELU or better
        if torch.is_grad_enabled() and h.requires_grad:
            return ReLUSquared.apply(h)
        return F.relu(h).square()  # decoding: no graph, and a Function's call costs more than the two ops
    # exact GELU is ~3x cheaper than the tanh form on CPU; GPT-2's weights need the tanh form
    return F.gelu(h, approximate="tanh" if mlp == "gelu_tanh" else "none")


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma 2's logit soft-capping, cap * tanh(logits / cap), in fp32: a smooth bound on the logits' size that
    keeps early training from making them large. None: the logits as they are."""
    if cap is None:
        return logits
    return cap * torch.tanh(logits.float() / cap)


def make_norm(config: GPTConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.n_embd, eps=config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head, self.head_size = config.n_head, config.head_size
        self.rope = config.pos_encoding == "rope"
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # fused q, k, v
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        if config.qk_norm:  # QK-norm (Dehghani et al. 2023; OLMo 2, Qwen3): bounded attention logits
            self.q_norm = nn.RMSNorm(config.head_size, eps=config.norm_eps)
            self.k_norm = nn.RMSNorm(config.head_size, eps=config.norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos=None, sin=None, cache: KVCache | None = None, layer: int = 0):
        B, T, C = x.size()
        qkv = self.c_attn(x).view(B, T, 3, self.n_head, self.head_size)  # (B, T, 3, nh, hs)
        qk = qkv[:, :, :2]  # (B, T, 2, nh, hs)
        if self.q_norm is not None:  # per head, before RoPE
            qk = torch.stack([self.q_norm(qkv[:, :, 0]), self.k_norm(qkv[:, :, 1])], dim=2)
        if self.rope:
            # rotate q and k together: one set of elementwise ops instead of two
            qk = apply_rope(qk, cos, sin)  # (B, T, 2, nh, hs); cos, sin: (T, 1, 1, hs)
        q, k = qk.unbind(dim=2)
        v = qkv[:, :, 2]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, nh, T, hs)
        if cache is None:
            dropout_p = self.dropout if self.training else 0.0
            if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
                # the CPU flash-attention kernel's bf16 backward is ~5x slower than its fp32 one (torch 2.13),
                # and autocast would cast fp32 inputs back down: run it in fp32 outside autocast
                with torch.autocast("cpu", enabled=False):
                    y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True,
                                                       dropout_p=dropout_p)
            else:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
        else:
            if k.dtype != cache.dtype:  # under autocast the cache holds the autocast dtype
                k, v = k.to(cache.dtype), v.to(cache.dtype)
            k, v = cache.update(layer, k, v)  # (B, nh, S, hs)
            if q.dtype != k.dtype:
                k, v = k.to(q.dtype), v.to(q.dtype)
            if T == 1:  # one new token attends to everything held: no mask needed
                y = F.scaled_dot_product_attention(q, k, v)
            else:  # new tokens at the end of S: token i sees the cache and new tokens up to i
                S = k.size(2)
                mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(diagonal=S - T)
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return dropout(self.c_proj(y), self.dropout, self.training)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.kind = config.mlp
        H = config.hidden_size
        # SwiGLU (Shazeer 2020) fuses its gate and up projections into one matrix: (C, 2H)
        self.c_fc = nn.Linear(config.n_embd, 2 * H if self.kind == "swiglu" else H, bias=config.bias)
        self.c_proj = nn.Linear(H, config.n_embd, bias=config.bias)
        self.dropout = config.dropout

    def forward(self, x):
        h = activation(self.c_fc(x), self.kind)  # (B, T, H)
        return dropout(self.c_proj(h), self.dropout, self.training)


class Block(nn.Module):
    """Pre-LN residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = make_norm(config)
        self.mlp = MLP(config)

    def forward(self, x, cos=None, sin=None, cache=None, layer=0):
        x = x + self.attn(self.ln_1(x), cos, sin, cache, layer)
        return x + self.mlp(self.ln_2(x))


# --- the model ------------------------------------------------------------------------------------------


class LayerWeights(NamedTuple):
    """One block's weights as decode_step reads them (norms as functions with their weights bound)."""

    ln_1: Callable[[torch.Tensor], torch.Tensor]
    q_norm: Callable[[torch.Tensor], torch.Tensor] | None  # --qk-norm; None when off
    k_norm: Callable[[torch.Tensor], torch.Tensor] | None
    w_qkv: torch.Tensor
    b_qkv: torch.Tensor | None
    w_o: torch.Tensor
    b_o: torch.Tensor | None
    ln_2: Callable[[torch.Tensor], torch.Tensor]
    w_fc: torch.Tensor
    b_fc: torch.Tensor | None
    w_proj: torch.Tensor
    b_proj: torch.Tensor | None


class DecodePlan(NamedTuple):
    """Everything decode_step reads, looked up once per generation (GPT.decode_plan)."""

    layers: list[LayerWeights]
    wte: torch.Tensor
    ln_f: Callable[[torch.Tensor], torch.Tensor]
    head: torch.Tensor
    pos_table: torch.Tensor | None  # learned or sinusoidal positions; None for RoPE
    cos: torch.Tensor | None  # RoPE tables (block_size, 1, 1, hs)
    sin: torch.Tensor | None
    act: Callable[[torch.Tensor], torch.Tensor]
    logit_softcap: float | None
    n_head: int
    head_size: int
    n_embd: int



class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=make_norm(config),
        ))
        if config.pos_encoding == "learned":
            self.transformer["wpe"] = nn.Embedding(config.block_size, config.n_embd)
        elif config.pos_encoding == "sinusoidal":
            self.register_buffer("pos_table", sinusoidal_table(config.block_size, config.n_embd), persistent=False)
        else:
            cos, sin = rope_tables(torch.arange(config.block_size), config.head_size, config.rope_theta)
            # shaped to broadcast over (B, T, 2, nh, hs) as they are: no reshapes per call
            self.register_buffer("rope_cos", cos[:, None, None, :], persistent=False)  # (block_size, 1, 1, hs)
            self.register_buffer("rope_sin", sin[:, None, None, :], persistent=False)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        # GPT-2: scale the init of each residual branch's output by 1/sqrt(2 * n_layer), as the
        # residual stream sums 2 * n_layer of them; --zero-init-proj starts them at zero instead, so every
        # block begins as the identity (modded-nanogpt, nanochat)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                if config.zero_init_proj:
                    nn.init.zeros_(p)
                else:
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    # --- forward ---

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache: KVCache | None = None,
                last_only: bool = False):
        """Logits (B, T, V) for every position (or (B, 1, V) with last_only) and the mean cross-entropy
        over targets (B, T) when given (ignore_index -1). With a cache, idx holds the new tokens only."""
        B, T = idx.size()
        pos = cache.pos if cache is not None else 0
        assert pos + T <= self.config.block_size, f"{pos + T} tokens exceed the context of {self.config.block_size}"
        x = self.transformer.wte(idx)  # (B, T, C)
        cos = sin = None
        if self.config.pos_encoding == "learned":
            x = x + self.transformer.wpe(torch.arange(pos, pos + T, device=idx.device))
        elif self.config.pos_encoding == "sinusoidal":
            x = x + self.pos_table[pos:pos + T]
        else:
            cos, sin = self.rope_cos[pos:pos + T], self.rope_sin[pos:pos + T]
        x = dropout(x, self.config.dropout, self.training)
        for i, block in enumerate(self.transformer.h):
            x = block(x, cos, sin, cache, i)
        if cache is not None:
            cache.pos += T
        x = self.transformer.ln_f(x)
        if last_only:
            x = x[:, -1:]  # (B, 1, C): generation needs only the next token's logits
        logits = softcap(self.lm_head(x), self.config.logit_softcap)  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    # --- generation ---

    def new_cache(self, batch_size: int) -> KVCache:
        w = self.transformer.wte.weight
        dtype = torch.get_autocast_dtype(w.device.type) if torch.is_autocast_enabled(w.device.type) else w.dtype
        return KVCache(self.config, batch_size, w.device, dtype)

    def decode_plan(self) -> DecodePlan:
        """What decode_step reads, looked up once per generation: each nn.Module attribute lookup costs about
        a microsecond, and a small model's token makes ~100 of them. Tensors are shared, not copied."""
        cfg = self.config

        def as_function(module: nn.Module | None):  # a norm module -> a one-argument function, weights bound
            if module is None:
                return None
            shape, weight, eps = module.normalized_shape, module.weight, module.eps
            if isinstance(module, nn.RMSNorm):
                return lambda x: F.rms_norm(x, shape, weight, eps)
            bias = module.bias
            return lambda x: torch.layer_norm(x, shape, weight, bias, eps)

        layers = [LayerWeights(ln_1=as_function(b.ln_1), q_norm=as_function(b.attn.q_norm),
                               k_norm=as_function(b.attn.k_norm), w_qkv=b.attn.c_attn.weight, b_qkv=b.attn.c_attn.bias,
                               w_o=b.attn.c_proj.weight, b_o=b.attn.c_proj.bias, ln_2=as_function(b.ln_2),
                               w_fc=b.mlp.c_fc.weight, b_fc=b.mlp.c_fc.bias, w_proj=b.mlp.c_proj.weight,
                               b_proj=b.mlp.c_proj.bias) for b in self.transformer.h]
        pos_table = None  # added to the embedding: learned or sinusoidal positions
        if cfg.pos_encoding == "learned":
            pos_table = self.transformer.wpe.weight
        elif cfg.pos_encoding == "sinusoidal":
            pos_table = self.pos_table
        return DecodePlan(layers=layers, wte=self.transformer.wte.weight, ln_f=as_function(self.transformer.ln_f),
                          head=self.lm_head.weight, pos_table=pos_table, cos=getattr(self, "rope_cos", None),
                          sin=getattr(self, "rope_sin", None), act=lambda h: activation(h, cfg.mlp),
                          logit_softcap=cfg.logit_softcap,
                          n_head=cfg.n_head, head_size=cfg.head_size, n_embd=cfg.n_embd)

    def decode_step(self, idx: torch.Tensor, cache: KVCache, plan: DecodePlan | None = None) -> torch.Tensor:
        """Logits (B, V) after one new token per row, idx (B, 1), through the cache: the same computation as
        forward(idx, cache=cache), written against the weights directly. Decoding a small model on a CPU is
        bound by per-call overhead, and skipping the module calls and lookups makes a token ~1.5x cheaper
        (tests check the two agree for every kind of block). Call it under torch.inference_mode()."""
        p = plan or self.decode_plan()
        pos, B = cache.pos, idx.size(0)
        nh, hs, C = p.n_head, p.head_size, p.n_embd
        x = torch.embedding(p.wte, idx)  # (B, 1, C)
        rope = p.pos_table is None
        if rope:
            cos, sin = p.cos[pos], p.sin[pos]  # (1, 1, hs)
        else:
            x = x + p.pos_table[pos]
        act = p.act
        # narrow/select rather than x[:, :, a:b]: Python's tuple indexing costs a few microseconds a call
        for i, w in enumerate(p.layers):
            qkv = F.linear(w.ln_1(x), w.w_qkv, w.b_qkv).view(B, 3, nh, hs)  # T = 1 folded away
            qk = qkv.narrow(1, 0, 2)  # (B, 2, nh, hs)
            if w.q_norm is not None:
                qk = torch.stack([w.q_norm(qkv.select(1, 0)), w.k_norm(qkv.select(1, 1))], dim=1)
            if rope:
                qk = apply_rope(qk, cos, sin)
            k_all, v_all = cache.k[i], cache.v[i]  # (B, nh, block_size, hs)
            k_all.select(2, pos).copy_(qk.select(1, 1))
            v_all.select(2, pos).copy_(qkv.select(1, 2))
            q = qk.narrow(1, 0, 1)  # (B, 1, nh, hs) viewed as (B, nh, 1, hs) below
            q = q.view(B, nh, 1, hs) if q.dtype == k_all.dtype else q.view(B, nh, 1, hs).to(k_all.dtype)
            y = F.scaled_dot_product_attention(q, k_all.narrow(2, 0, pos + 1), v_all.narrow(2, 0, pos + 1))
            x = x + F.linear(y.view(B, 1, C), w.w_o, w.b_o)
            x = x + F.linear(act(F.linear(w.ln_2(x), w.w_fc, w.b_fc)), w.w_proj, w.b_proj)
        cache.pos += 1
        return softcap(F.linear(p.ln_f(x[:, -1]), p.head), p.logit_softcap)  # (B, V)

    @torch.inference_mode()
    def next_logits(self, idx: torch.Tensor, use_cache: bool = True) -> Iterator[torch.Tensor]:
        """A coroutine over generation: yields the next-token logits (B, V) for idx, then for idx plus each
        token sent in (a (B,) or (B, 1) tensor).

        Without the cache every step is a full forward over the last block_size tokens (nanoGPT's way).
        With it, a prefill then one-token steps; when the context is full the cache restarts from the last
        half of the window (one batched forward), so a token costs the same however many came before, and
        past the context each token sees between half and all of the last block_size tokens. Up to
        block_size tokens the two paths compute the same logits."""
        block_size = self.config.block_size
        keep = max(1, block_size // 2)
        idx = idx[:, -block_size:]
        cache = self.new_cache(idx.size(0)) if use_cache else None
        plan = self.decode_plan() if use_cache else None
        new = idx
        while True:
            if cache is None:
                logits, _ = self(idx, last_only=True)
            elif cache.pos + new.size(1) > block_size:
                cache.pos = 0  # the buffers are overwritten from the start
                logits, _ = self(idx[:, -keep:], cache=cache, last_only=True)
            elif new.size(1) == 1:
                logits = self.decode_step(new, cache, plan)
            else:
                logits, _ = self(new, cache=cache, last_only=True)
            token = yield (logits[:, -1] if logits.dim() == 3 else logits).float()
            new = token.view(-1, 1).to(idx.device)
            idx = torch.cat([idx, new], dim=1)[:, -block_size:]

    @torch.inference_mode()
    def generate_tokens(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                        top_k: int | None = None, top_p: float | None = None, min_p: float | None = None,
                        repetition_penalty: float = 1.0, use_cache: bool = True,
                        generator: torch.Generator | None = None, vocab_size: int | None = None,
                        prompt_tails: list[list[int]] | None = None) -> Iterator[torch.Tensor]:
        """The generation loop: yields the next token of every row (B,), up to max_new_tokens times; a caller
        that stops early (a stop text, end of text) just stops iterating. vocab_size: never pick a token at
        or above it (a padded head has rows the tokenizer lacks). See process_logits for the filters.

        Prompts of different lengths: idx holds the part all rows have (the shortest prompt's length) and
        prompt_tails the rest of each row's prompt. Those tokens are fed in place of sampled ones, one step at a
        time, so every row stays at the same position and one cache serves the batch with no padding or masks
        (each row computes exactly what it would alone). The loop then runs max_new_tokens + the longest tail
        steps, and row r's first len(prompt_tails[r]) tokens are its own prompt's."""
        forced = None
        if prompt_tails is not None and any(prompt_tails):
            forced = torch.full((idx.size(0), max(map(len, prompt_tails))), -1, dtype=torch.long, device=idx.device)
            for r, tail in enumerate(prompt_tails):
                forced[r, :len(tail)] = torch.tensor(tail, dtype=torch.long)
            max_new_tokens += forced.size(1)
        if max_new_tokens <= 0:
            return
        seen = None
        if repetition_penalty != 1.0:
            seen = torch.zeros(idx.size(0), self.config.vocab_size, dtype=torch.bool, device=idx.device)
            seen.scatter_(1, idx, True)
        steps = self.next_logits(idx, use_cache)
        try:
            logits = next(steps)
            for i in range(max_new_tokens):
                if vocab_size is not None and logits.size(-1) != vocab_size:
                    logits = logits[:, :vocab_size]
                filtered = process_logits(logits, temperature, top_k, top_p, min_p, repetition_penalty,
                                          seen[:, :logits.size(-1)] if seen is not None else None)
                token = sample_token(filtered, temperature, generator)  # (B,)
                if forced is not None and i < forced.size(1):  # rows still inside their prompt take its token
                    token = torch.where(forced[:, i] >= 0, forced[:, i], token)
                yield token
                if seen is not None:
                    seen.scatter_(1, token[:, None], True)
                if i + 1 < max_new_tokens:
                    logits = steps.send(token)
        finally:
            steps.close()

    @torch.inference_mode()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, use_cache: bool = True, generator: torch.Generator | None = None):
        """Continue idx (B, T) by max_new_tokens sampled tokens; temperature 0 is greedy. Returns (B, T + new)."""
        new = [t[:, None] for t in self.generate_tokens(idx, max_new_tokens, temperature, top_k, top_p,
                                                        use_cache=use_cache, generator=generator)]
        return torch.cat([idx, *new], dim=1)

    # --- accounting ---

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters, each shared tensor once; non_embedding leaves out the token and position tables."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wte.weight.numel()
            if "wpe" in self.transformer:
                n -= self.transformer.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (forward + backward = 3 x forward), PaLM-style: 6 per matmul weight
        (the LM head included, embeddings lookups excluded) plus 12 * n_layer * C * T for attention scores."""
        cfg = self.config
        T = seq_len or cfg.block_size
        matmul = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        return 6 * matmul + 12 * cfg.n_layer * cfg.n_embd * T

    def optimizer_groups(self, weight_decay: float) -> list[dict]:
        """Weight decay on matrices and embeddings (2-D and up), none on biases and norm gains."""
        params = [p for p in self.parameters() if p.requires_grad]
        return [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]


# --- sampling -------------------------------------------------------------------------------------------


def process_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                   top_p: float | None = None, min_p: float | None = None, repetition_penalty: float = 1.0,
                   seen: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token logits (B, V) -> filtered logits, in this order: repetition penalty on the raw logits,
    temperature, top-k, top-p, min-p. Filtered-out tokens get -inf. temperature 0 leaves the logits for an
    argmax. seen: (B, V) bool of tokens already in the sequence, for the repetition penalty."""
    logits = logits.float()
    if repetition_penalty != 1.0 and seen is not None:
        # CTRL (Keskar et al. 2019): make seen tokens less likely whatever the sign of their logit
        penalized = torch.where(logits > 0, logits / repetition_penalty, logits * repetition_penalty)
        logits = torch.where(seen, penalized, logits)
    if temperature > 0:
        logits = logits / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        # keep the smallest set of most likely tokens whose probability reaches top_p
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = (cum - sorted_logits.softmax(dim=-1)) >= top_p  # mass before this token already reaches p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if min_p is not None and min_p > 0.0:
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return logits


def sample_token(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row from processed logits (B, V); greedy when temperature is 0. (B,)"""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
