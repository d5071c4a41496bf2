"""The GPT: a decoder-only Transformer with Pre-LN blocks and RoPE / sinusoidal / learned positions.

    model = GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128))
    logits, loss = model(idx, targets)

The architecture only: running it token by token (the KV cache, the decode step, sampling) is the engine's.
Inside, the residual stream is (N, C) with N = B * T: a decode step's few rows and a training batch run the
same code (blocks.py, attention.py).

Shape legend: B batch, T tokens in this call, N = B * T, S tokens held in the KV cache, C n_embd, nh n_head,
hs head size (C // nh unless --head-dim), nkv key/value heads, rd the dimensions RoPE rotates (hs unless
--rotary-dim), H MLP hidden width, V vocab_size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

from nanogpt_cli.config import GPTConfig
from nanogpt_cli.model.attention import Cache, Context, causal_mask, rope_tables, window_mask
from nanogpt_cli.model.blocks import Block, dropout, make_norm, softcap


def sinusoidal_table(n_pos: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    """Vaswani et al. (2017): pe[p, 2i] = sin(p / base^(2i/dim)), pe[p, 2i+1] = cos(same). (n_pos, dim)"""
    pos = torch.arange(n_pos, dtype=torch.float64)[:, None]
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = pos * inv_freq  # (n_pos, dim/2)
    pe = torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)  # interleave -> (n_pos, dim)
    return pe.float()


class ModelOps(NamedTuple):
    """What GPT.hidden_states runs: the modules and tables as they are (GPT.ops), or their decoding form
    (inference/backends/decode.py, built once per model: the tables looked up once, the blocks' primitives faster
    for a few rows)."""

    wte: torch.Tensor  # (V, C) token embeddings
    pos_table: torch.Tensor | None  # (block_size, C) learned or sinusoidal positions, added to the embeddings
    cos: torch.Tensor | None  # RoPE (block_size, 1, 1, rd), shaped to broadcast over (B, T, 2, nh, hs)
    sin: torch.Tensor | None
    blocks: Sequence[Callable]  # each block as (x, ctx, layer) -> x
    ln_f: Callable[[torch.Tensor], torch.Tensor]
    local_cos: torch.Tensor | None = None  # sliding-window layers' RoPE (--rope-local-theta), else cos itself
    local_sin: torch.Tensor | None = None


def embedding(n: int, dim: int, init: bool) -> nn.Embedding:
    """nn.Embedding(n, dim), its N(0, 1) init skipped when not init (GPT's own init follows in any case)."""
    return nn.Embedding(n, dim) if init else nn.Embedding(n, dim, _weight=torch.empty(n, dim))


class HeadCrossEntropy(torch.autograd.Function):
    """The mean cross-entropy of a frozen LM head's logits, h w^T, over the targets that count (-1: none), with
    its gradient with respect to h computed in the forward, a chunk of rows at a time: the (N, V) float32 logits,
    their log-softmax and its gradient, three times N * V * 4 bytes (150 MB for 256 tokens of a 49,152 vocabulary)
    at the peak of a step, are never held at once. The same operations in each chunk as the whole-batch loss (the
    head's matmul in autocast's dtype, then float32), so the values differ by float rounding only. The head's
    weight gets no gradient: only a frozen head takes this path (GPT._head_loss_in_chunks)."""

    # logits per chunk under autocast: 8 MB in float32 (42 rows of a 49,152 vocabulary); four times as many in
    # float32, whose matmuls over fewer rows run below speed. A 256-token LoRA step of SmolLM2-135M's shape in
    # float32 ran 0.96x the whole-batch loss's speed in chunks of 42 rows (peak RSS 1.57 against 1.69 GB) and
    # 1.00x in chunks of 170 (1.62-1.64 GB); in bf16 the speeds were level, and chunks of 85-170 rows raised
    # the step's peak RSS from 1.27 to 1.33 GB
    CHUNK_ELEMENTS = 1 << 21

    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        N, V = h.size(0), w.size(0)
        full = w.dtype == torch.float32 and not torch.is_autocast_enabled(h.device.type)  # float32 matmuls
        rows = max(1, HeadCrossEntropy.CHUNK_ELEMENTS * (4 if full else 1) // V)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad = torch.empty_like(h)  # (N, C)
        for i in range(0, N, rows):
            logits = F.linear(h[i : i + rows], w)  # (n, V) in autocast's dtype, as lm_head computes it
            t = targets[i : i + rows]
            counted = (t != -1).float()
            picked = t.clamp(min=0).unsqueeze(1)  # (n, 1): a placeholder target where none counts
            lf = logits.float()
            lse = torch.logsumexp(lf, dim=-1)  # (n,)
            total += ((lse - lf.gather(1, picked).squeeze(1)) * counted).sum()
            # d(mean)/d(logits) = (softmax - one_hot(target)) / count on the rows that count, in place of lf
            g = lf.sub_(lse.unsqueeze(1)).exp_()
            g.scatter_add_(1, picked, torch.full_like(picked, -1.0, dtype=g.dtype))
            g.mul_((counted / count).unsqueeze(1))
            grad[i : i + rows] = F.linear(g.to(logits.dtype), w.t())  # (n, C): the head's backward matmul
        ctx.save_for_backward(grad)
        return total / count

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return grad * grad_out, None, None, None


# --- the model ------------------------------------------------------------------------------------------


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, init: bool = True):
        """init=False computes nothing: the weights stay as allocated and the position tables are not made, for a
        model built on the meta device and filled from a file (interop/materialize.py), which makes the tables on
        the CPU after. normal_ and arange have no meta kernels: their first call there imports torch's Python ones,
        ~150 MB of resident memory for nothing."""
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=embedding(config.vocab_size, config.n_embd, init),
                h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
                ln_f=make_norm(config),
            )
        )
        if config.pos_encoding == "learned":
            self.transformer["wpe"] = embedding(config.block_size, config.n_embd, init)
        if init:
            self.make_tables()
        # the sliding window when some layer has one (window_mask), else None
        local = any(config.is_local(i) for i in range(config.n_layer))
        self.window = config.sliding_window if local else None
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        if init:
            self.init_weights()

    def init_weights(self) -> None:
        """GPT-2's initialisation: N(0, 0.02) for every matrix and embedding, zero biases."""
        self.apply(self._init_weights)
        # GPT-2: scale the init of each residual branch's output by 1/sqrt(2 * n_layer), as the
        # residual stream sums 2 * n_layer of them; --zero-init-proj starts them at zero instead, so every
        # block begins as the identity (modded-nanogpt, nanochat)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                if self.config.zero_init_proj:
                    nn.init.zeros_(p)
                else:
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))

    def make_tables(self) -> None:
        """The position tables (sinusoidal or RoPE), computed from the config: buffers that no weights file holds,
        made again on the CPU for a model built on the meta device (interop/materialize.py)."""
        config = self.config
        if config.pos_encoding == "sinusoidal":
            self.register_buffer("pos_table", sinusoidal_table(config.block_size, config.n_embd), persistent=False)
        elif config.pos_encoding != "learned":
            self.register_rope("rope", config.rope_theta, config)
            if config.rope_local_theta is not None:  # Gemma 3: local layers turn at a base of their own, unscaled
                self.register_rope("rope_local", config.rope_local_theta)

    def register_rope(self, name: str, theta: float, scaling: GPTConfig | None = None) -> None:
        """RoPE's tables at every position as buffers name_cos, name_sin (block_size, 1, 1, rd), shaped to
        broadcast over (B, T, 2, nh, hs) as they are: no reshapes per call. scaling: the config whose RoPE
        scaling stretches them (rope_tables)."""
        cfg = self.config
        cos, sin = rope_tables(torch.arange(cfg.block_size), cfg.rotary_size, theta, scaling)
        self.register_buffer(f"{name}_cos", cos[:, None, None, :], persistent=False)
        self.register_buffer(f"{name}_sin", sin[:, None, None, :], persistent=False)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    # --- forward ---

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: Cache | None = None,
        last_only: bool = False,
        probs: list[torch.Tensor] | None = None,
        keep_logits: bool = True,
    ):
        """Logits (B, T, V) for every position (or (B, 1, V) with last_only) and the mean cross-entropy
        over targets (B, T) when given (ignore_index -1). With a cache, idx holds the new tokens only. probs: a
        list that gets each layer's attention probabilities (B, nh, T, S), through the explicit kernel.
        keep_logits=False: a caller that wants the loss only; the logits may then be None (a frozen head's
        training loss is computed in chunks, head_cross_entropy)."""
        x = self.hidden_states(idx, cache, probs)
        if last_only:
            x = x[:, -1:]  # (B, 1, C): generation needs only the next token's logits
        if targets is not None and not keep_logits and self._head_loss_in_chunks(x):
            flat = targets.reshape(-1)
            count = (flat != -1).sum().clamp(min=1)
            return None, HeadCrossEntropy.apply(x.reshape(-1, x.size(-1)), self.lm_head.weight, flat, count)
        logits = softcap(self.lm_head(x), self.config.logit_softcap)  # (B, T, V)
        loss = None
        if targets is not None:
            # the mean over the targets that count; a batch with none (a chat window of prompt only) gives 0, not
            # 0/0 = NaN, and no gradient
            flat = targets.reshape(-1)
            total = F.cross_entropy(logits.float().view(-1, logits.size(-1)), flat, ignore_index=-1, reduction="sum")
            loss = total / (flat != -1).sum().clamp(min=1)
        return logits, loss

    def _head_loss_in_chunks(self, x: torch.Tensor) -> bool:
        """Whether HeadCrossEntropy computes this loss: while training a model whose LM head is frozen (LoRA),
        without a soft-cap, and not under float16 autocast, whose unscaled gradient it would underflow."""
        if not (torch.is_grad_enabled() and x.requires_grad) or self.lm_head.weight.requires_grad:
            return False
        fp16 = torch.is_autocast_enabled(x.device.type) and torch.get_autocast_dtype(x.device.type) == torch.float16
        return self.config.logit_softcap is None and not fp16

    def hidden_states(
        self,
        idx: torch.Tensor,
        cache: Cache | None = None,
        probs: list[torch.Tensor] | None = None,
        ops: ModelOps | None = None,
    ) -> torch.Tensor:
        """The last block's output after the final norm (B, T, C): what lm_head turns into logits. A caller that
        needs some positions' logits only (a prefill needs the last one) applies the head to those. With a cache,
        idx holds each row's new tokens, which start at the cache's position (one for all rows, or one per row);
        the cache advances by T. ops: the model's operations in another form (inference/backends/decode.py)."""
        ops = ops or self.ops()
        B, T = idx.size()
        x = torch.embedding(ops.wte, idx)  # (B, T, C)
        if self.config.embed_scale:  # Gemma: the embedding's rows at the residual stream's scale
            x = x * math.sqrt(self.config.n_embd)
        ctx = Context(B, T, cache=cache, probs=probs)
        x = self.positions(x, ctx, ops)
        if self.training:
            x = dropout(x, self.config.dropout, True)
        x = x.view(B * T, -1)  # (N, C)
        for i, block in enumerate(ops.blocks):
            x = block(x, ctx, i)
        return ops.ln_f(x).view(B, T, -1)

    def ops(self) -> ModelOps:
        """The modules and tables as hidden_states runs them; the position scheme decides which tables."""
        kind, tr = self.config.pos_encoding, self.transformer
        pos_table = tr.wpe.weight if kind == "learned" else self.pos_table if kind == "sinusoidal" else None
        cos, sin = (self.rope_cos, self.rope_sin) if kind == "rope" else (None, None)
        local_cos, local_sin = cos, sin
        if kind == "rope" and self.config.rope_local_theta is not None:
            local_cos, local_sin = self.rope_local_cos, self.rope_local_sin
        return ModelOps(tr.wte.weight, pos_table, cos, sin, tr.h, tr.ln_f, local_cos, local_sin)

    def positions(self, x: torch.Tensor, ctx: Context, ops: ModelOps) -> torch.Tensor:
        """The new tokens' positions: added to their embeddings x (B, T, C) (learned, sinusoidal), or RoPE's angles
        put in ctx; with a cache, also the causal mask over what it holds."""
        T, cache = ctx.T, ctx.cache
        start = 0 if cache is None else cache.pos
        if isinstance(start, int):  # every row at one position; select for one token is the cheaper call
            end, at = start + T, None
            rows = (lambda t: t.select(0, start)) if T == 1 else (lambda t: t.narrow(0, start, T))
        else:  # a position per row: at (B, T)
            end, at = max(start) + T, torch.tensor(start, device=x.device).unsqueeze(1)  # unsqueeze: no [:, None]
            at = at if T == 1 else at + torch.arange(T, device=x.device)
            rows = lambda t: t[at]  # noqa: E731
        assert end <= self.config.block_size, f"{end} tokens exceed the context of {self.config.block_size}"
        if cache is not None and not (at is None and T == 1):  # one token per row at one position sees all held
            ctx.mask = causal_mask(torch.arange(start, end, device=x.device) if at is None else at, end)
        if self.window is not None:  # sliding-window layers: the keys of the window, from what the cache holds
            query = torch.arange(start, end, device=x.device) if at is None else at
            keys = query if cache is None else cache.window_keys(T, x.device)
            ctx.local_mask = None if keys is None else window_mask(query, keys, self.window)
        if ops.cos is not None:  # (T, 1, 1, rd), (1, 1, rd) for one token, or (B, T, 1, 1, rd) a row each
            ctx.cos, ctx.sin = rows(ops.cos), rows(ops.sin)
            if self.window is not None:
                same = ops.local_cos is ops.cos  # one base for both kinds: the same tables
                ctx.local_cos = ctx.cos if same else rows(ops.local_cos)
                ctx.local_sin = ctx.sin if same else rows(ops.local_sin)
            return x
        return x + rows(ops.pos_table)

    # --- accounting ---

    def cast(self, dtype: torch.dtype) -> GPT:
        """The weights in `dtype` for inference; the RoPE tables stay fp32 as in training (apply_rope meets
        q and k in their dtype)."""
        self.to(dtype)
        if self.config.pos_encoding == "rope":
            self.rope_cos, self.rope_sin = self.rope_cos.float(), self.rope_sin.float()
            if self.config.rope_local_theta is not None:
                self.rope_local_cos, self.rope_local_sin = self.rope_local_cos.float(), self.rope_local_sin.float()
        return self

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
        (the LM head included, embeddings lookups excluded) plus 12 * nh * hs * T per layer for attention scores
        and their weighted sum, T being the keys a layer attends to: a sliding-window layer's window where it is
        shorter (key/value heads shared by several query heads still meet each query head)."""
        cfg = self.config
        T = seq_len or cfg.block_size
        matmul = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        keys = sum(cfg.keys_seen(i, T) for i in range(cfg.n_layer))
        return 6 * matmul + 12 * cfg.n_head * cfg.head_size * keys
