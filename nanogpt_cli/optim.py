"""The optimizers: AdamW alone, or Muon for the matrices inside the blocks and AdamW for everything else.

    optimizer = make_optimizer(model, cfg, device); set_lr(optimizer, lr_at(step, cfg), step, cfg)

Muon (Jordan et al. 2024, as in modded-nanogpt and nanochat) orthogonalises each 2-D update with a few
Newton-Schulz steps; it suits the hidden matrices only, so the embedding, the LM head, the norm gains and the
biases stay with AdamW. The two are stepped, scaled, clipped and checkpointed as one object (Optimizers).
"""

from __future__ import annotations

import torch

from nanogpt_cli.config import TrainConfig
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
        return torch.optim.AdamW(model.optimizer_groups(cfg.weight_decay), lr=cfg.learning_rate,
                                 betas=(cfg.beta1, cfg.beta2), fused=fused)
    if not hasattr(torch.optim, "Muon"):
        raise NanoGPTError(f"--optimizer muon needs torch.optim.Muon (torch 2.9 or newer); this is torch "
                           f"{torch.__version__}: upgrade torch or use --optimizer adamw")
    inner, rest = muon_params(model)
    muon = torch.optim.Muon(inner, lr=cfg.muon_lr, momentum=muon_momentum_at(0, cfg), weight_decay=cfg.weight_decay)
    matrices = [p for p in rest if p.dim() >= 2]  # the embedding and an untied head: decayed, as with AdamW alone
    others = [p for p in rest if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": cfg.weight_decay}, {"params": others, "weight_decay": 0.0}]
    adamw = torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), fused=fused)
    return Optimizers([muon, adamw])


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
                group["lr"] = lr
