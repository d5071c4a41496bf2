"""The optimizers: AdamW alone, or Muon for the matrices inside the blocks and AdamW for everything else.

    optimizer = make_optimizer(model, cfg, device); set_lr(optimizer, lr_at(step, cfg), step, cfg)

Muon (Jordan et al. 2024, as in modded-nanogpt and nanochat) orthogonalises each 2-D update with a few
Newton-Schulz steps; it suits the hidden matrices only, so the embedding, the LM head, the norm gains and the
biases stay with AdamW. The two are stepped, scaled, clipped and checkpointed as one object (Optimizers).
"""

from __future__ import annotations

import math

import torch

from nanogpt_cli.config import TrainConfig, in_use
from nanogpt_cli.device import cpu_has_bf16
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.model import GPT

MUON_MOMENTUM_START = 0.85  # where --muon-momentum-warmup starts (modded-nanogpt)


class Optimizers:
    """Several torch optimizers that the loop, the grad scaler and the checkpoint treat as one: `param_groups`
    lists all their groups, `step` and `zero_grad` call each. checkpoint.save_optimizer stores each one's state."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    def step(self, closure=None) -> None:
        assert closure is None, "Optimizers.step takes no closure"
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def orthogonalize(
    G: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration in `dtype` on a stack of wide matrices G (k, m, n), m <= n: each
    -> roughly the nearest semi-orthogonal matrix (U V^T of its SVD, with singular values near 1)."""
    a, b, c = coefficients
    X = G.to(dtype)
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        A = X @ X.mT
        X = torch.baddbmm(X, torch.baddbmm(A, A, A, beta=b, alpha=c), X, beta=a)
    return X


class CPUMuon(torch.optim.Muon if hasattr(torch.optim, "Muon") else torch.optim.Optimizer):
    """torch.optim.Muon's update with the Newton-Schulz steps made for a CPU: the matrices of one shape (each
    block's c_attn, say; a tall one as its transpose) are stacked and orthogonalised together, in bf16 where the
    CPU multiplies it natively (AVX-512 BF16 or AMX) and in fp32 elsewhere. A 4 x 128 model's 16 matrices took
    4.4 ms so, against 15.7 ms one by one in fp32 (11.6 in bf16) on two AMX cores: a matrix of these sizes is too
    small to keep the cores busy alone. The update is otherwise torch's (Nesterov momentum, the "original" shape
    scaling sqrt(max(1, rows / cols)), decoupled weight decay), and so are the state and the param groups: a
    checkpoint moves between the two."""

    def __init__(self, params, *args, ns_dtype: torch.dtype | None = None, **kwargs):
        super().__init__(params, *args, **kwargs)
        self.ns_dtype = ns_dtype or (torch.bfloat16 if cpu_has_bf16() else torch.float32)

    @torch.no_grad()
    def step(self, closure=None) -> None:
        assert closure is None, "CPUMuon.step takes no closure"
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            for p in params:
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad)
            bufs = [self.state[p]["momentum_buffer"] for p in params]
            torch._foreach_lerp_(bufs, grads, 1 - momentum)
            updates = torch._foreach_lerp(grads, bufs, momentum) if group["nesterov"] else bufs
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
            # one stack per shape once each is turned wide (a tall matrix's transpose): a block's c_fc (4C, C) and
            # its MLP c_proj (C, 4C) go through one batched Newton-Schulz
            by_shape: dict[tuple[int, int], list[int]] = {}
            for i, p in enumerate(params):
                by_shape.setdefault((min(p.shape), max(p.shape)), []).append(i)
            for members in by_shape.values():
                tall = [params[i].size(0) > params[i].size(1) for i in members]
                stack = torch.stack([updates[i].mT if t else updates[i] for i, t in zip(members, tall)])
                ortho = orthogonalize(stack, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)
                for o, i, t in zip(ortho, members, tall):
                    p = params[i]
                    scale = max(1.0, p.size(0) / p.size(1)) ** 0.5
                    p.add_((o.mT if t else o).to(p.dtype), alpha=-lr * scale)


def muon_params(model: GPT) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the 2-D weight matrices inside the blocks, everything else)."""
    inner, rest = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (inner if name.startswith("transformer.h.") and p.dim() == 2 else rest).append(p)
    return inner, rest


def make_optimizer(model: GPT, cfg: TrainConfig, device: torch.device):
    # the fused AdamW kernel is one call for all parameters (CUDA and CPU); mps falls back to foreach
    fused = device.type in ("cuda", "cpu")
    if cfg.optimizer == "adamw":
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(
            adamw_groups(model, params, cfg), lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), fused=fused
        )
    if not hasattr(torch.optim, "Muon"):
        raise NanoGPTError(
            f"--optimizer muon needs torch.optim.Muon (torch 2.9 or newer); this is torch "
            f"{torch.__version__}: upgrade torch or use --optimizer adamw"
        )
    inner, rest = muon_params(model)
    muon_class = CPUMuon if device.type == "cpu" else torch.optim.Muon
    muon = muon_class(
        inner,
        lr=cfg.muon_lr,
        momentum=muon_momentum_at(0, cfg),
        weight_decay=cfg.weight_decay,
        ns_steps=cfg.muon_ns_steps,
    )
    adamw = torch.optim.AdamW(
        adamw_groups(model, rest, cfg), lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), fused=fused
    )
    return Optimizers([muon, adamw])


def adamw_groups(model: GPT, params: list[torch.Tensor], cfg: TrainConfig) -> list[dict]:
    """AdamW's groups of `params`: weight decay on matrices and embeddings (2-D and up), none on biases and norm
    gains; with --embedding-lr, an untied token embedding in a third group at that peak (its `lr_scale` against
    --learning-rate, which set_lr applies)."""
    wte = model.transformer.wte.weight
    own = in_use(cfg, "embedding_lr", model.config) and any(p is wte for p in params)  # its Needs: untied
    groups = [
        {"params": [p for p in params if p.dim() >= 2 and not (own and p is wte)], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    if own:
        scale = cfg.embedding_lr / cfg.learning_rate
        groups.append({"params": [wte], "weight_decay": cfg.weight_decay, "lr_scale": scale})
    return groups


def muon_momentum_at(step: int, cfg: TrainConfig) -> float:
    """Muon's momentum: linear from 0.85 to --muon-momentum over --muon-momentum-warmup updates, then constant."""
    if step >= cfg.muon_momentum_warmup:
        return cfg.muon_momentum
    frac = step / cfg.muon_momentum_warmup
    return MUON_MOMENTUM_START + frac * (cfg.muon_momentum - MUON_MOMENTUM_START)


def set_lr(optimizer: torch.optim.Optimizer | Optimizers, lr: float, step: int, cfg: TrainConfig) -> None:
    """Apply the schedule's learning rate for this update: AdamW groups get lr, Muon's get --muon-lr scaled by
    the same factor (lr / --learning-rate), and Muon's momentum follows its warm-up."""
    for opt in getattr(optimizer, "optimizers", [optimizer]):
        is_muon = isinstance(opt, getattr(torch.optim, "Muon", ()))
        for group in opt.param_groups:
            if is_muon:
                group["lr"] = cfg.muon_lr * (lr / cfg.learning_rate)
                group["momentum"] = muon_momentum_at(step, cfg)
            else:
                group["lr"] = lr * group.get("lr_scale", 1.0)


def lr_at(step: int, cfg: TrainConfig, time_frac: float | None = None) -> float:
    """Learning rate for update `step` (0-based): linear warmup, then cosine / constant / warmup-stable-decay
    down to min_lr at lr_decay_iters, and min_lr after it. With --max-time, `time_frac` is the share of it spent:
    after the warmup (always counted in updates) the schedule stands at the step or at that share of
    lr_decay_iters, whichever is further, so a run cut short by the clock still ends its decay on time."""
    if step < cfg.warmup_iters:
        return cfg.learning_rate * (step + 1) / (cfg.warmup_iters + 1)
    if time_frac is not None:
        step = max(step, math.ceil(time_frac * cfg.decay_iters))
    if cfg.lr_schedule == "constant":
        return cfg.learning_rate
    decay_iters = cfg.decay_iters
    if step >= decay_iters:
        return cfg.min_lr
    if cfg.lr_schedule == "wsd":
        decay_start = max(cfg.warmup_iters, decay_iters - round(cfg.wsd_decay_frac * decay_iters))
        if step < decay_start:
            return cfg.learning_rate
        frac = (step - decay_start) / max(1, decay_iters - decay_start)
        return cfg.learning_rate + frac * (cfg.min_lr - cfg.learning_rate)
    frac = (step - cfg.warmup_iters) / max(1, decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * frac)) * (cfg.learning_rate - cfg.min_lr)
