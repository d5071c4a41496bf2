"""The checkpoint file formats: weights and optimizer state in safetensors (no pickle anywhere; small JSON
values in the header metadata), and the trainer state as a JSON-ready dict. Which files a run folder holds, and
under which names, is rundir.py's business; loading a model for inference is loading.py's.

    save_model(path, model, {"step": 500, "tokenizer": tok.describe()}); load_weights(GPT(config), path)
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from nanogpt_cli import __version__
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.files import atomic_write
from nanogpt_cli.lora import is_adapter_key
from nanogpt_cli.model import GPT

# --- weights ---


def save_model(path: Path, model: GPT, meta: dict[str, Any], state: dict[str, torch.Tensor] | None = None) -> None:
    """Weights in float32-or-as-trained safetensors; meta values are stored as JSON strings (safetensors
    metadata is str -> str). A tied LM head is stored once, as the embedding, and re-tied on load. state: the
    weights when they are not model.state_dict() (gathered from the shards of many processes). A LoRA run
    (meta has "lora") stores its adapters only; its metadata names the base they go on."""
    write_tensors(path, *model_tensors(model, meta, state))


def model_tensors(
    model: GPT, meta: dict[str, Any], state: dict[str, torch.Tensor] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """What save_model writes: the tensors (the live ones, not copies) and the header metadata."""
    state = model.state_dict() if state is None else state
    tensors = {k: v.detach() for k, v in state.items()}
    if "lora" in meta:
        tensors = {k: v for k, v in tensors.items() if is_adapter_key(k)}
    elif model.config.tie_embeddings:
        tensors.pop("lm_head.weight")
    metadata = {"format": "nanogpt", "version": __version__, "config": model.config.to_json()}
    metadata.update({k: json.dumps(v) for k, v in meta.items()})
    return tensors, metadata


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """One safetensors file, written atomically. safetensors releases the GIL while it writes, so a thread can
    write while another trains."""
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def damage(path: Path) -> str | None:
    """Why a weights or optimizer file cannot be read ("missing", "truncated or damaged: ..."), None if it can."""
    if not path.is_file():
        return "missing"
    try:
        with safe_open(str(path), framework="pt") as f:
            f.metadata()
    except (SafetensorError, OSError, ValueError) as e:
        return f"truncated or damaged: {e}"
    return None


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
    """The training step a weights or optimizer file was saved at (None if it has none or cannot be read)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            step = (f.metadata() or {}).get("step")
        return json.loads(step) if step is not None else None
    except (SafetensorError, OSError, ValueError):
        return None


def load_weights(model: GPT, path: Path) -> None:
    """Load a weights file into `model`. An adapters file (a LoRA run's) loads into a model that has those
    adapters already on its base (lora.add_lora): only the adapters are replaced."""
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise NanoGPTError(f"{path} is not a valid safetensors checkpoint ({e})") from None
    own = model.state_dict()
    for name, tensor in tensors.items():
        if name in own and tuple(own[name].shape) != tuple(tensor.shape):
            raise NanoGPTError(
                f"{path} does not match its config: {name} has shape {tuple(tensor.shape)}, and the config implies "
                f"{tuple(own[name].shape)}"
            )
    if tensors and all(is_adapter_key(k) for k in tensors):
        ours = {k for k in own if is_adapter_key(k)}
        if ours != set(tensors):
            raise NanoGPTError(
                f"{path} holds adapters for other layers than this model's: missing "
                f"{sorted(ours - set(tensors))[:3]}, unexpected {sorted(set(tensors) - ours)[:3]}"
            )
        model.load_state_dict(tensors, strict=False)
        return
    if model.config.tie_embeddings:
        tensors["lm_head.weight"] = tensors["transformer.wte.weight"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise NanoGPTError(f"{path} does not match its config: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if model.config.tie_embeddings:  # load_state_dict copies into both names; keep them one tensor
        model.lm_head.weight = model.transformer.wte.weight


CONVERT_BYTES = 4 * 2**20  # TensorFile.get converts this much float32 at a time
# safetensors' dtype names -> torch's
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class TensorFile:
    """A safetensors weights file read one tensor at a time, each into memory of its own with a plain read.
    safe_open maps the whole file, and every page it has read stays in the process's resident memory until it is
    closed: reading a model through it costs the file's size on top of the model being built (interop/materialize).

        file = TensorFile(path); w = file.get("transformer.wte.weight")
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                n = int.from_bytes(f.read(8), "little")
                if size < 8 or n > size - 8:  # checked before the header is read: the length may be damage
                    raise NanoGPTError(
                        f"{path} is not a valid safetensors checkpoint (its header length {n:,} passes the end of "
                        f"the file, {size:,} bytes)"
                    )
                header = json.loads(f.read(n))
        except (OSError, ValueError) as e:
            raise NanoGPTError(f"{path} is not a valid safetensors checkpoint ({e})") from None
        if not isinstance(header, dict):
            raise NanoGPTError(f"{path} is not a valid safetensors checkpoint (its header is not a JSON object)")
        header.pop("__metadata__", None)
        self.start, self.entries = 8 + n, header
        for name, entry in header.items():
            problem = _entry_problem(entry, size - self.start)
            if problem:
                raise NanoGPTError(f"{path} is a damaged safetensors file: {name} {problem}")

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(entry["shape"]) for name, entry in self.entries.items()}

    def keys(self) -> set[str]:
        return set(self.entries)

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor as stored, or in dtype by way of float32 (what loading it into a float32 model and casting
        that after gives), converted a slice of rows at a time: never a whole float32 copy of a large tensor."""
        entry = self.entries[name]
        begin, end = entry["data_offsets"]
        stored, shape = SAFETENSORS_DTYPES[entry["dtype"]], entry["shape"]
        if dtype is None or dtype == stored:
            return self._read(name, begin, end, torch.empty(shape, dtype=stored))
        out = torch.empty(shape, dtype=dtype)
        if out.numel() == 0:
            return out
        rows = out.view(-1, shape[-1]) if len(shape) > 1 else out.view(1, -1)  # (rows, last dim)
        step = max(1, CONVERT_BYTES // (4 * rows.size(1)))
        row_bytes = rows.size(1) * stored.itemsize
        for r in range(0, rows.size(0), step):
            chunk = torch.empty(min(step, rows.size(0) - r), rows.size(1), dtype=stored)
            start = begin + r * row_bytes
            rows[r : r + chunk.size(0)] = self._read(
                name, start, start + chunk.numel() * stored.itemsize, chunk
            ).float()
        return out

    def _read(self, name: str, begin: int, end: int, into: torch.Tensor) -> torch.Tensor:
        buffer = memoryview(into.reshape(-1).view(torch.uint8).numpy())  # (bytes,): the tensor's own memory
        with open(self.path, "rb") as f:
            f.seek(self.start + begin)
            read = f.readinto(buffer)
        if read != end - begin or read != len(buffer):
            raise NanoGPTError(f"{self.path} is truncated or damaged: {name} has {read:,} of {len(buffer):,} bytes")
        return into


def _entry_problem(entry: Any, data_bytes: int) -> str | None:
    """Why one safetensors header entry cannot be read from a data section of data_bytes, or None: its dtype, its
    shape and its offsets must agree with each other and lie inside the file, before anything is allocated."""
    if not isinstance(entry, dict) or entry.get("dtype") not in SAFETENSORS_DTYPES:
        return f"has dtype {entry.get('dtype') if isinstance(entry, dict) else None!r}, which safetensors lacks"
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        return f"has shape {shape!r}, not a list of sizes"
    ok = isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
    if not ok or not 0 <= offsets[0] <= offsets[1] <= data_bytes:
        return f"has data offsets {offsets!r} outside the file's {data_bytes:,} bytes of data"
    n = SAFETENSORS_DTYPES[entry["dtype"]].itemsize
    for d in shape:
        n *= d
    if n != offsets[1] - offsets[0]:
        return f"of shape {tuple(shape)} needs {n:,} bytes, and its offsets hold {offsets[1] - offsets[0]:,}"
    return None


# --- optimizer and trainer state ---


def optimizer_parts(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside one: itself, or each of several (optim.Optimizers: Muon and AdamW)."""
    return list(getattr(optimizer, "optimizers", [optimizer]))


def _prefixes(n: int) -> list[str]:
    # a lone optimizer has no prefix (the original layout); each of several has "opt<j>."
    return [""] if n == 1 else [f"opt{j}." for j in range(n)]


def save_optimizer(path: Path, optimizer, step: int, state: dict | None = None) -> None:
    """Per-parameter state tensors as `<prefix>state.<index>.<name>`; each optimizer's param groups (lr, betas,
    ...) as JSON in `<prefix>param_groups`. state: the state dict of a lone optimizer when it is not
    optimizer.state_dict() (gathered from the shards of many processes)."""
    write_tensors(path, *optimizer_tensors(optimizer, step, state))


def optimizer_tensors(
    optimizer, step: int, state: dict | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """What save_optimizer writes: the state tensors (the live ones, not copies) and the header metadata."""
    parts = optimizer_parts(optimizer)
    sds = [state] if state is not None and len(parts) == 1 else [part.state_dict() for part in parts]
    tensors, metadata = {}, {"step": json.dumps(step)}
    for prefix, sd in zip(_prefixes(len(sds)), sds):
        for index, param_state in sd["state"].items():
            for name, value in param_state.items():
                tensors[f"{prefix}state.{index}.{name}"] = value if torch.is_tensor(value) else torch.tensor(value)
        metadata[f"{prefix}param_groups"] = json.dumps(sd["param_groups"])
    return tensors, metadata


def read_optimizer(path: Path, optimizer) -> tuple[list[dict[str, Any]], int]:
    """save_optimizer's file as one state dict per optimizer part of `optimizer` (parameters by position), and
    the step it was saved at; a file of another kind of optimizer is one sentence."""
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(path))
    n = len(optimizer_parts(optimizer))
    if sum(k.endswith("param_groups") for k in metadata) != n:
        raise NanoGPTError(f"{path} holds the state of a different optimizer than this run's --optimizer")
    sds = []
    for prefix in _prefixes(n):
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            if key.startswith(prefix + "state."):
                _, index, name = key[len(prefix) :].split(".", 2)
                state.setdefault(int(index), {})[name] = value
        groups = json.loads(metadata[f"{prefix}param_groups"])
        for group in groups:  # JSON has no tuples; the optimizers keep betas (and Muon its coefficients) as one
            group.update({k: tuple(v) for k, v in group.items() if k != "params" and isinstance(v, list)})
        sds.append({"state": state, "param_groups": groups})
    return sds, json.loads(metadata["step"])


def load_optimizer(path: Path, optimizer, load: Callable[[torch.optim.Optimizer, dict], None] | None = None) -> int:
    """Restore the optimizer(s) from save_optimizer's file; returns the step it was saved at. load(part, state):
    how one part takes its state dict (under torchrun a wrapped model's optimizer takes it through
    distributed); part.load_state_dict by default."""
    sds, step = read_optimizer(path, optimizer)
    for part, sd in zip(optimizer_parts(optimizer), sds):
        if load is None:
            part.load_state_dict(sd)
        else:
            load(part, sd)
    return step


def encode_rng(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def decode_rng(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


@dataclass
class TrainerState:
    """Everything besides weights and optimizer that a resumed run needs to continue exactly."""

    step: int = 0  # optimizer updates done
    tokens: int = 0  # training tokens seen
    best_val_loss: float | None = None
    elapsed_s: float = 0.0  # wall time of all invocations so far
    rng_torch: torch.Tensor | None = None  # torch's global generator: dropout
    rng_batches: torch.Tensor | None = None  # the training batches' own generator
    rng_cuda: list[torch.Tensor] = dataclasses.field(default_factory=list)
    scaler: dict[str, Any] | None = None  # the fp16 grad scaler's state
    # under torchrun: each rank's dropout generators, {"cpu": state, "cuda": state or None} in rank order
    rng_ranks: list[dict[str, torch.Tensor | None]] | None = None
    eval_s: float = 0.0  # the last evaluation's length: --max-time keeps it free for the final one
    max_time_spent: float | None = None  # the --max-time that ended the run; None: the clock did not end it
    speed: dict[str, Any] | None = None  # the last invocation's events.RunSpeed, for `info`
    # a CPU run's torch threads at this save: sums differ by thread count, so a resume keeps it (None: a GPU run,
    # or a run saved before this was kept)
    threads: int | None = None
    # --max-time with no --eval-iters given: the batches a split that every evaluation scores, fixed by the first one
    # (Trainer.bound_evaluations); None: all of --eval-iters
    eval_batches: int | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(
            step=self.step,
            tokens=self.tokens,
            best_val_loss=self.best_val_loss,
            elapsed_s=self.elapsed_s,
            eval_s=self.eval_s,
            max_time_spent=self.max_time_spent,
            speed=self.speed,
            threads=self.threads,
            eval_batches=self.eval_batches,
            version=__version__,
            rng_torch=_maybe(encode_rng, self.rng_torch),
            rng_batches=_maybe(encode_rng, self.rng_batches),
            rng_cuda=[encode_rng(s) for s in self.rng_cuda],
            scaler=self.scaler,
            rng_ranks=None
            if self.rng_ranks is None
            else [{k: _maybe(encode_rng, v) for k, v in r.items()} for r in self.rng_ranks],
        )

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TrainerState:
        return cls(
            step=d["step"],
            tokens=d["tokens"],
            best_val_loss=d["best_val_loss"],
            elapsed_s=d.get("elapsed_s", 0.0),
            eval_s=d.get("eval_s", 0.0),
            max_time_spent=d.get("max_time_spent"),
            speed=d.get("speed"),
            threads=d.get("threads"),
            eval_batches=d.get("eval_batches"),
            rng_torch=_maybe(decode_rng, d.get("rng_torch")),
            rng_batches=_maybe(decode_rng, d.get("rng_batches")),
            rng_cuda=[decode_rng(s) for s in d.get("rng_cuda") or []],
            scaler=d.get("scaler"),
            rng_ranks=None
            if d.get("rng_ranks") is None
            else [{k: _maybe(decode_rng, v) for k, v in r.items()} for r in d["rng_ranks"]],
        )


def _maybe(f, value):
    return None if value is None else f(value)
