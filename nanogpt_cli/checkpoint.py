"""A run folder on disk: weights, optimizer and trainer state, all written atomically, no pickle anywhere.

    save_model(run_dir / "model.safetensors", model, {"step": 500, "tokenizer": tok.describe()})
    model, meta = load_model("checkpoints/shk")   # a run folder means its best weights

Layout of a run folder:
    config.json            the effective model and training config
    model.safetensors      the last weights; metadata: config, tokenizer, step, tokens, val_loss, version
    best.safetensors       the weights with the lowest validation loss so far
    optimizer.safetensors  the optimizer's state tensors; its hyperparameters as JSON metadata
    trainer.json           step, tokens, best val loss, RNG states, grad-scaler state
    metrics.jsonl          one JSON object per evaluation
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from nanogpt_cli import __version__
from nanogpt_cli.config import GPTConfig
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.model import GPT

LAST, BEST = "model.safetensors", "best.safetensors"
OPTIMIZER, TRAINER, CONFIG, METRICS = "optimizer.safetensors", "trainer.json", "config.json", "metrics.jsonl"


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Run write(tmp) on a temporary file beside path, then rename it into place: a crash mid-write
    leaves the previous file intact."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: Path, obj: Any) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8"))


# --- weights ---


def save_model(path: Path, model: GPT, meta: dict[str, Any]) -> None:
    """Weights in float32-or-as-trained safetensors; meta values are stored as JSON strings (safetensors
    metadata is str -> str). A tied LM head is stored once, as the embedding, and re-tied on load."""
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        tensors.pop("lm_head.weight")
    metadata = {"format": "nanogpt", "version": __version__, "config": model.config.to_json()}
    metadata.update({k: json.dumps(v) for k, v in meta.items()})
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def resolve_weights(path: str | Path, last: bool = False) -> Path:
    """A weights file from a run folder (best, or last with last=True) or a file path, with a clear error."""
    path = Path(path)
    if path.is_dir():
        names = [LAST] if last else [BEST, LAST]
        for name in names:
            if (path / name).is_file():
                return path / name
        found = sorted(p.name for p in path.iterdir())
        raise NanoGPTError(f"no checkpoint in {path}: it holds {', '.join(found) or 'nothing'}")
    if not path.exists():
        runs = sorted(p.name for p in path.parent.glob("*") if (p / LAST).is_file()) if path.parent.is_dir() else []
        hint = f"; runs in {path.parent}: {', '.join(runs)}" if runs else ""
        raise NanoGPTError(f"checkpoint {path} does not exist{hint}")
    return path


def read_metadata(path: Path) -> dict[str, Any]:
    """The metadata of a nanogpt weights file, JSON values decoded."""
    try:
        with safe_open(str(path), framework="pt") as f:
            raw = f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as e:
        raise NanoGPTError(f"{path} is not a valid safetensors checkpoint ({e})") from None
    if raw.get("format") != "nanogpt" or "config" not in raw:
        raise NanoGPTError(f"{path} is a safetensors file but not a nanogpt checkpoint (no config in its metadata)")
    meta: dict[str, Any] = {}
    for key, value in raw.items():
        try:
            meta[key] = json.loads(value)
        except json.JSONDecodeError:
            meta[key] = value
    return meta


def file_step(path: Path) -> int | None:
    """The training step a weights or optimizer file was saved at (None if it has none)."""
    with safe_open(str(path), framework="pt") as f:
        step = (f.metadata() or {}).get("step")
    return json.loads(step) if step is not None else None


def load_model(path: str | Path, last: bool = False, device: str | torch.device = "cpu") -> tuple[GPT, dict]:
    """The model rebuilt from a checkpoint alone (its config is in the metadata), and that metadata."""
    path = resolve_weights(path, last)
    meta = read_metadata(path)
    try:
        config = GPTConfig.from_dict(meta["config"])
    except (TypeError, ValueError) as e:
        raise NanoGPTError(f"{path} holds an invalid model config: {e}") from None
    model = GPT(config)
    load_weights(model, path)
    return model.to(device), meta


def load_weights(model: GPT, path: Path) -> None:
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise NanoGPTError(f"{path} is not a valid safetensors checkpoint ({e})") from None
    if model.config.tie_embeddings:
        tensors["lm_head.weight"] = tensors["transformer.wte.weight"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise NanoGPTError(f"{path} does not match its config: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if model.config.tie_embeddings:  # load_state_dict copies into both names; keep them one tensor
        model.lm_head.weight = model.transformer.wte.weight


# --- optimizer and trainer state ---


def save_optimizer(path: Path, optimizer: torch.optim.Optimizer, step: int) -> None:
    """Per-parameter state tensors as `state.<index>.<name>`; the param groups (lr, betas, ...) as JSON."""
    sd = optimizer.state_dict()
    tensors = {}
    for index, state in sd["state"].items():
        for name, value in state.items():
            tensors[f"state.{index}.{name}"] = value if torch.is_tensor(value) else torch.tensor(value)
    metadata = {"param_groups": json.dumps(sd["param_groups"]), "step": json.dumps(step)}
    atomic_write(path, lambda tmp: save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata))


def load_optimizer(path: Path, optimizer: torch.optim.Optimizer) -> int:
    """Restore the optimizer from save_optimizer's file; returns the step it was saved at."""
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(path))
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        _, index, name = key.split(".", 2)
        state.setdefault(int(index), {})[name] = value
    groups = json.loads(metadata["param_groups"])
    for group in groups:  # JSON has no tuples; the optimizers keep betas as one
        group.update({k: tuple(v) for k, v in group.items() if k != "params" and isinstance(v, list)})
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    return json.loads(metadata["step"])


def encode_rng(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def decode_rng(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()
