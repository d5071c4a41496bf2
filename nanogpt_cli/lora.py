"""LoRA (Hu et al. 2021): a frozen base linear layer plus a trainable low-rank update, W x + (alpha/r) B A x.

    params = add_lora(model, LoRAConfig(r=8, alpha=16, targets=("attn.c_attn",)))   # only these train
    merge_lora(model)                                                               # W += (alpha/r) B A

The adapted layer keeps its place and its parameter names (`...attn.c_attn.weight` stays the base weight) and
gains `lora_A` (r, in) and `lora_B` (out, r), so a checkpoint of the adapters holds only the `.lora_` keys and
the base loads into the same model unchanged. B starts at zero: at step 0 the model is its base exactly. The
shapes and the dropout on the layer's input are PEFT's, so the adapters map onto a PEFT adapter (hf.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from nanogpt_cli.errors import NanoGPTError

# the projections an adapter can go on, by their path inside a block
TARGETS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
# names that stand for several of them
GROUPS = {"attn": ("attn.c_attn", "attn.c_proj"), "mlp": ("mlp.c_fc", "mlp.c_proj"), "all": TARGETS}
DEFAULT_TARGETS = ("attn.c_attn",)  # the fused q, k, v: what PEFT adapts in GPT-2 by default


@dataclass(frozen=True)
class LoRAConfig:
    r: int = 8  # the rank of the update
    alpha: float = 16.0  # the update is scaled by alpha / r
    dropout: float = 0.0  # on the adapted layer's input, for the adapter's path only
    targets: tuple[str, ...] = DEFAULT_TARGETS  # paths inside each block (TARGETS)

    def __post_init__(self):
        if not isinstance(self.r, int) or self.r <= 0:
            raise NanoGPTError(f"--lora-r must be a positive integer, got {self.r!r}")
        if not math.isfinite(self.alpha) or self.alpha <= 0:
            raise NanoGPTError(f"--lora-alpha must be a positive number, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise NanoGPTError(f"--lora-dropout must be in [0, 1), got {self.dropout!r}")
        object.__setattr__(self, "targets", parse_targets(self.targets))

    @property
    def scaling(self) -> float:
        return self.alpha / self.r

    def to_dict(self) -> dict:
        return {"r": self.r, "alpha": self.alpha, "dropout": self.dropout, "targets": list(self.targets)}

    @classmethod
    def from_dict(cls, d: dict) -> LoRAConfig:
        return cls(r=d["r"], alpha=float(d["alpha"]), dropout=float(d["dropout"]), targets=tuple(d["targets"]))


def parse_targets(names) -> tuple[str, ...]:
    """--lora-targets as given (names or comma-separated lists of them, groups expanded) -> TARGETS in order."""
    wanted: set[str] = set()
    for item in names:
        for name in str(item).split(","):
            name = name.strip()
            if not name:
                continue
            if name in GROUPS:
                wanted.update(GROUPS[name])
            elif name in TARGETS:
                wanted.add(name)
            else:
                raise NanoGPTError(
                    f"--lora-targets: unknown projection {name!r}; choose from {', '.join(TARGETS)} "
                    f"or {', '.join(GROUPS)}"
                )
    if not wanted:
        raise NanoGPTError(f"--lora-targets names no projection; choose from {', '.join(TARGETS)}")
    return tuple(t for t in TARGETS if t in wanted)


class LoRALinear(nn.Linear):
    """nn.Linear (its weight and bias those of the layer it replaces, frozen) plus the low-rank update."""

    def __init__(self, base: nn.Linear, cfg: LoRAConfig):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias  # the same Parameters: names and storage unchanged
        self.scaling, self.lora_dropout = cfg.scaling, cfg.dropout
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(cfg.r, self.in_features, device=w.device, dtype=w.dtype))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, cfg.r, device=w.device, dtype=w.dtype))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # PEFT's init; B = 0, so the update starts at 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)  # (..., out)
        h = F.dropout(x, self.lora_dropout, self.training) if self.training and self.lora_dropout > 0 else x
        return out + F.linear(F.linear(h, self.lora_A), self.lora_B) * self.scaling  # (..., r) -> (..., out)

    def delta(self) -> torch.Tensor:
        """The update this adapter adds to the weight, (alpha/r) B A. (out, in)"""
        return (self.lora_B @ self.lora_A) * self.scaling


def add_lora(model: nn.Module, cfg: LoRAConfig) -> list[nn.Parameter]:
    """Put an adapter on every target projection of every block; returns the adapters' parameters (the only
    ones to train). The base weights are frozen here."""
    for p in model.parameters():
        p.requires_grad_(False)
    params: list[nn.Parameter] = []
    for block in model.transformer.h:
        for target in cfg.targets:
            parent_name, name = target.split(".")
            parent = getattr(block, parent_name)
            layer = LoRALinear(getattr(parent, name), cfg)
            setattr(parent, name, layer)
            params += [layer.lora_A, layer.lora_B]
    return params


@torch.no_grad()
def hold_frozen(model: nn.Module, dtype: torch.dtype) -> int:
    """Hold every frozen linear weight (a LoRA run's base projections and LM head) in `dtype`, for a run under
    autocast to `dtype`: autocast would cast them to it on every forward and keep the casts for the backward, so
    the values computed are the same, bit for bit, at half the memory and without the casts. The adapters, norms,
    biases and the token embedding keep their dtype; a tied LM head gets a copy of its own, so the embedding's
    lookup stays as exact as it was. A trained weight is left as it is. Returns how many weights it cast."""
    held = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if not isinstance(module, nn.Linear) or w is None or w.requires_grad or w.dtype == dtype:
            continue
        if w.is_floating_point():  # a new Parameter: a tied head stops sharing the embedding's
            module.weight = nn.Parameter(w.detach().to(dtype), requires_grad=False)
            held += 1
    return held


def adapters(model: nn.Module) -> dict[str, LoRALinear]:
    """The adapted layers by module name (transformer.h.0.attn.c_attn, ...)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def is_adapter_key(key: str) -> bool:
    return key.endswith((".lora_A", ".lora_B"))


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and put plain nn.Linear layers back: the model computes what
    base + adapters computed, at the base's cost."""
    for name, layer in adapters(model).items():
        parent_name, _, child = name.rpartition(".")
        plain = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
        plain.weight, plain.bias = layer.weight, layer.bias
        plain.weight.add_(layer.delta().to(plain.weight.dtype))
        setattr(model.get_submodule(parent_name), child, plain)
    return model


def weights_hash(model: nn.Module) -> str:
    """The sha256 of a model's weights (names, shapes and float32 values, in name order): what a LoRA run
    records of its base, whatever file or format the base came from."""
    import hashlib

    h = hashlib.sha256()
    for key, t in sorted(model.state_dict().items()):
        if is_adapter_key(key):
            continue
        t = t.detach().to("cpu", torch.float32).contiguous()
        h.update(f"{key}:{tuple(t.shape)};".encode())
        h.update(memoryview(t.numpy()).cast("B"))  # the bytes in place: no copy of a 150 MB embedding
    return h.hexdigest()


# --- several adapters on one base, chosen per row (nanogpt serve --adapter) ------------------------------


class RowAdapters:
    """Which adapter each row of the next forward uses, shared by every RowLoRALinear of a model (0: the base
    alone). The engine calls select before each forward with the rows it runs, in order."""

    def __init__(self, names: list[str], device: torch.device):
        self.names, self.device = names, device  # adapter i + 1 is names[i]
        self.ids: torch.Tensor | None = None  # (B,) adapter per row; None: every row is the base alone

    @property
    def count(self) -> int:
        return len(self.names)

    def select(self, ids: list[int] | None) -> None:
        self.ids = torch.tensor(ids, device=self.device) if ids and any(ids) else None


class RowLoRALinear(nn.Linear):
    """A base linear layer (its Parameters, not a copy) plus, for each row, the low-rank update of that row's
    adapter: x W^T + b + x A_i^T B_i^T (alpha_i/r_i), as two batched matmuls against the stacked A and B gathered
    by row. Adapters of smaller rank, and those without this layer, are padded with zeros, which add nothing."""

    def __init__(self, base: nn.Linear, a_t: torch.Tensor, b_t: torch.Tensor, rows: RowAdapters):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.register_buffer("a_t", a_t, persistent=False)  # (n + 1, in, r): A transposed, index 0 zeros
        self.register_buffer("b_t", b_t, persistent=False)  # (n + 1, r, out): B^T scaled by alpha / r
        self.rows = rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)  # (..., out)
        ids = self.rows.ids
        if ids is None:
            return out
        xb = x.reshape(ids.numel(), -1, self.in_features)  # (B, T, in): the rows' tokens are contiguous
        delta = torch.bmm(torch.bmm(xb, self.a_t[ids]), self.b_t[ids])  # (B, T, r) -> (B, T, out)
        return out + delta.view(out.shape)


def add_row_adapters(model: nn.Module, named: dict[str, tuple[LoRAConfig, dict[str, torch.Tensor]]]) -> RowAdapters:
    """Put several adapters on a model's one copy of its weights, chosen per row: named maps an adapter's name
    to its config and its `.lora_A`/`.lora_B` tensors by state-dict key. Returns the selector the engine sets."""
    w = model.transformer.wte.weight
    rows = RowAdapters(list(named), w.device)
    layers = sorted({k.rsplit(".", 1)[0] for _, tensors in named.values() for k in tensors if is_adapter_key(k)})
    for name in layers:
        parent_name, _, child = name.rpartition(".")
        base = model.get_submodule(name)
        r = max(tensors[f"{name}.lora_A"].size(0) for _, tensors in named.values() if f"{name}.lora_A" in tensors)
        a_t = torch.zeros(len(named) + 1, base.in_features, r, device=w.device, dtype=base.weight.dtype)
        b_t = torch.zeros(len(named) + 1, r, base.out_features, device=w.device, dtype=base.weight.dtype)
        for i, (cfg, tensors) in enumerate(named.values(), start=1):
            if f"{name}.lora_A" in tensors:
                a, b = tensors[f"{name}.lora_A"], tensors[f"{name}.lora_B"]  # (r_i, in), (out, r_i)
                a_t[i, :, : a.size(0)] = a.t().to(a_t.dtype)
                b_t[i, : b.size(1)] = (b.float() * cfg.scaling).t().to(b_t.dtype)
        setattr(model.get_submodule(parent_name), child, RowLoRALinear(base, a_t, b_t, rows))
    return rows
