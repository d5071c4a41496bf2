"""A run folder on disk: weights, optimizer and trainer state, all written atomically, no pickle anywhere.

    run = RunDir("checkpoints/shk"); run.save(model, optimizer, TrainerState(step=500, ...), weights_meta)
    loaded = load_for_inference("checkpoints/shk")   # a run folder means its best weights

Layout of a run folder:
    config.json            the effective model and training config
    model.safetensors      the last weights; metadata: config, tokenizer, step, tokens, val_loss, version
    best.safetensors       the weights with the lowest validation loss so far
    optimizer.safetensors  the optimizer's state tensors; its hyperparameters as JSON metadata
    trainer.json           step, tokens, best val loss, RNG states, grad-scaler state
    metrics.jsonl          one JSON object per evaluation (kind "eval") and per --log-interval (kind "train")
    loss.png               the loss curves, when matplotlib is installed
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
from nanogpt_cli.config import GPTConfig
from nanogpt_cli.device import resolve_device, resolve_inference_dtype
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.files import check_creatable
from nanogpt_cli.model import GPT
from nanogpt_cli.tokenizer import Tokenizer, tokenizer_from_description

LAST, BEST = "model.safetensors", "best.safetensors"
OPTIMIZER, TRAINER, CONFIG, METRICS = "optimizer.safetensors", "trainer.json", "config.json", "metrics.jsonl"
LOSS_PLOT = "loss.png"  # drawn from metrics.jsonl at the end of `nanogpt train` when matplotlib is installed


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


def save_model(path: Path, model: GPT, meta: dict[str, Any], state: dict[str, torch.Tensor] | None = None) -> None:
    """Weights in float32-or-as-trained safetensors; meta values are stored as JSON strings (safetensors
    metadata is str -> str). A tied LM head is stored once, as the embedding, and re-tied on load. state: the
    weights when they are not model.state_dict() (gathered from the shards of many processes)."""
    state = model.state_dict() if state is None else state
    tensors = {k: v.detach().contiguous() for k, v in state.items()}
    if model.config.tie_embeddings:
        tensors.pop("lm_head.weight")
    metadata = {"format": "nanogpt", "version": __version__, "config": model.config.to_json()}
    metadata.update({k: json.dumps(v) for k, v in meta.items()})
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def resolve_weights(path: str | Path, last: bool = False) -> Path:
    """A weights file from a run folder (best, or last with last=True) or a file path, with a clear error; a
    damaged file is refused with a pointer to an intact one where the folder has it."""
    path = Path(path)
    if path.is_dir():
        names = [LAST] if last else [BEST, LAST]
        for name in names:
            if (path / name).is_file():
                _check_intact(path / name)
                return path / name
        found = sorted(p.name for p in path.iterdir())
        hint = ""
        if last and (path / BEST).is_file() and damage(path / BEST) is None:
            hint = f"; its {BEST} is intact: use it without --last"
        raise NanoGPTError(f"no checkpoint in {path}: it holds {', '.join(found) or 'nothing'}{hint}")
    if not path.exists():
        runs = sorted(p.name for p in path.parent.glob("*") if (p / LAST).is_file()) if path.parent.is_dir() else []
        hint = f"; runs in {path.parent}: {', '.join(runs)}" if runs else ""
        raise NanoGPTError(f"checkpoint {path} does not exist{hint}")
    _check_intact(path)
    return path


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


def _check_intact(path: Path) -> None:
    """Refuse a damaged weights file, naming an intact alternative in its run folder: best for last and the
    other way round (the --last flag switches), or the previous save kept during a save that was cut short."""
    problem = damage(path)
    if problem is None:
        return
    hints = []
    other = {LAST: BEST, BEST: LAST}.get(path.name)
    if other and damage(path.parent / other) is None:
        step = file_step(path.parent / other)
        use = "with --last" if other == LAST else "without --last"
        hints.append(f"its {other} (step {step}) is intact: use it {use}")
    if damage(_prev(path)) is None:
        hints.append(f"the previous save {_prev(path).name} is intact: move it to {path.name} to use it")
    hint = f"; {'; '.join(hints)}" if hints else ""
    raise NanoGPTError(f"{path} is {problem}{hint}")
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


def load_model(path: str | Path, last: bool = False, device: str | torch.device = "cpu") -> tuple[GPT, dict]:
    """The model rebuilt from a checkpoint alone (its config is in the metadata), and that metadata. A Hugging
    Face model (hf:NAME, or a folder holding a transformers config.json) is converted, and its metadata holds
    the config and our description of its tokenizer (see hf.py)."""
    from nanogpt_cli import hf

    if hf.is_hf_source(path):
        model, tokenizer = hf.load_pretrained(path)
        return model.to(device), {"config": model.config.to_dict(), "tokenizer": tokenizer, "source": str(path)}
    from nanogpt_cli import gguf_file

    if gguf_file.is_gguf(path):  # a GGUF file that nanogpt exported
        model, meta = gguf_file.read_gguf(path)
        return model.to(device), meta
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


@dataclass
class InferenceModel:
    """A checkpoint ready to run: the model cast to its inference dtype on its device, and its tokenizer."""

    model: GPT
    tokenizer: Tokenizer
    meta: dict[str, Any]  # the weights file's metadata (config, tokenizer, step, ...)
    device: torch.device
    dtype: torch.dtype

    @property
    def block_size(self) -> int:
        return self.model.config.block_size


def load_for_inference(checkpoint: str | Path, last: bool = False, device: str = "auto",
                       dtype: str = "auto") -> InferenceModel:
    """The one loader that sample and eval share. Inference casts the weights once instead of autocasting
    every call; `auto` picks the dtype from the device and the size of the weights (device.py)."""
    dev = resolve_device(device)
    model, meta = load_model(checkpoint, last=last)
    if "tokenizer" not in meta:
        raise NanoGPTError(f"{checkpoint} has no tokenizer in its metadata, so its text cannot be decoded")
    tokenizer = tokenizer_from_description(meta["tokenizer"])
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    cast = resolve_inference_dtype(dtype, dev, weight_bytes)
    return InferenceModel(model.to(device=dev, dtype=cast).eval(), tokenizer, meta, dev, cast)


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
    parts = optimizer_parts(optimizer)
    sds = [state] if state is not None and len(parts) == 1 else [part.state_dict() for part in parts]
    tensors, metadata = {}, {"step": json.dumps(step)}
    for prefix, sd in zip(_prefixes(len(sds)), sds):
        for index, param_state in sd["state"].items():
            for name, value in param_state.items():
                tensors[f"{prefix}state.{index}.{name}"] = value if torch.is_tensor(value) else torch.tensor(value)
        metadata[f"{prefix}param_groups"] = json.dumps(sd["param_groups"])
    atomic_write(path, lambda tmp: save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata))


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
                _, index, name = key[len(prefix):].split(".", 2)
                state.setdefault(int(index), {})[name] = value
        groups = json.loads(metadata[f"{prefix}param_groups"])
        for group in groups:  # JSON has no tuples; the optimizers keep betas (and Muon its coefficients) as one
            group.update({k: tuple(v) for k, v in group.items() if k != "params" and isinstance(v, list)})
        sds.append({"state": state, "param_groups": groups})
    return sds, json.loads(metadata["step"])


def load_optimizer(path: Path, optimizer) -> int:
    """Restore the optimizer(s) from save_optimizer's file; returns the step it was saved at."""
    sds, step = read_optimizer(path, optimizer)
    for part, sd in zip(optimizer_parts(optimizer), sds):
        part.load_state_dict(sd)
    return step


def encode_rng(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def decode_rng(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


@dataclass
class TrainerState:
    """Everything besides weights and optimizer that a resumed run needs to continue exactly (trainer.json)."""

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

    def to_json(self) -> dict[str, Any]:
        return dict(step=self.step, tokens=self.tokens, best_val_loss=self.best_val_loss, elapsed_s=self.elapsed_s,
                    eval_s=self.eval_s, max_time_spent=self.max_time_spent,
                    version=__version__, rng_torch=_maybe(encode_rng, self.rng_torch),
                    rng_batches=_maybe(encode_rng, self.rng_batches), rng_cuda=[encode_rng(s) for s in self.rng_cuda],
                    scaler=self.scaler, rng_ranks=None if self.rng_ranks is None else
                    [{k: _maybe(encode_rng, v) for k, v in r.items()} for r in self.rng_ranks])

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TrainerState:
        return cls(step=d["step"], tokens=d["tokens"], best_val_loss=d["best_val_loss"],
                   elapsed_s=d.get("elapsed_s", 0.0), eval_s=d.get("eval_s", 0.0),
                   max_time_spent=d.get("max_time_spent"), rng_torch=_maybe(decode_rng, d.get("rng_torch")),
                   rng_batches=_maybe(decode_rng, d.get("rng_batches")),
                   rng_cuda=[decode_rng(s) for s in d.get("rng_cuda") or []], scaler=d.get("scaler"),
                   rng_ranks=None if d.get("rng_ranks") is None else
                   [{k: _maybe(decode_rng, v) for k, v in r.items()} for r in d["rng_ranks"]])


def _maybe(f, value):
    return None if value is None else f(value)


# --- the run folder ---


class RunDir:
    """The one owner of a run folder's layout (see the module docstring): its checks, the staged multi-file
    save and the resume with its recovery from a save cut short, config.json and metrics.jsonl."""

    FILES = (LAST, BEST, OPTIMIZER, TRAINER, CONFIG, METRICS, LOSS_PLOT)

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __str__(self) -> str:
        return str(self.path)

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    def has_run(self) -> bool:
        return self.path.is_dir() and any((self.path / n).exists() for n in (LAST, TRAINER, CONFIG))

    def check(self, resume: bool, force: bool) -> None:
        """A run folder must be new, empty, or (with --resume / --force) a run; anything else is refused."""
        if self.path.exists() and not self.path.is_dir():
            raise NanoGPTError(f"--out {self.path} is a file, not a folder")
        if resume and force:
            raise NanoGPTError("--resume continues the run in --out and --force deletes it; give one of them")
        if resume:
            if not self.has_run():
                raise NanoGPTError(f"--resume: {self.path} holds no run to resume (no {TRAINER} and {CONFIG}); "
                                   "start it without --resume")
        elif self.has_run() and not force:
            raise NanoGPTError(f"{self.path} already holds a run; pass --resume to continue it or --force to "
                               "start over (this deletes it)")
        elif not self.has_run() and self.path.is_dir() and any(self.path.iterdir()):
            raise NanoGPTError(f"--out {self.path} holds other files and no run; choose a new or empty folder")
        elif not self.has_run():
            check_creatable(self.path, "--out")

    def start(self, force: bool) -> None:
        """A fresh run: with --force delete the files of the run there, and nothing else."""
        if force:
            for name in self.FILES:
                (self.path / name).unlink(missing_ok=True)
        self.path.mkdir(parents=True, exist_ok=True)

    # --- config.json and metrics.jsonl ---

    def write_config(self, config: dict[str, Any]) -> None:
        write_json(self.path / CONFIG, {**config, "version": __version__})

    def read_config(self) -> dict[str, Any]:
        config = self._read_json(CONFIG)
        if not isinstance(config, dict) or not {"model", "train"} <= set(config):
            raise NanoGPTError(f"{self.path / CONFIG} is damaged (no model and train config in it){self._init_hint()}")
        return config

    def read_trainer(self) -> TrainerState:
        try:
            return TrainerState.from_json(self._read_json(TRAINER))
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, NanoGPTError):
                raise
            raise NanoGPTError(f"{self.path / TRAINER} is damaged (missing {e}){self._init_hint()}") from None

    def _read_json(self, name: str) -> Any:
        path = self.path / name
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise NanoGPTError(f"{path} is missing{self._init_hint()}") from None
        except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise NanoGPTError(f"{path} is damaged ({_first_line(e)}){self._init_hint()}") from None

    def _init_hint(self) -> str:
        """How to go on when the run cannot be resumed: its weights, if intact, start a new run."""
        for name in (BEST, LAST):
            if damage(self.path / name) is None:
                flag = "" if name == BEST else " --last"
                return (f"; its {name} (step {file_step(self.path / name)}) is intact: start a new run from it with "
                        f"`nanogpt train --init-from {self.path}{flag} --out NEW_FOLDER ...` (fresh optimizer)")
        return ""

    def append_metrics(self, record: dict[str, Any]) -> None:
        with open(self.path / METRICS, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def read_metrics(self) -> tuple[list[dict[str, Any]], int]:
        """The records of metrics.jsonl, and how many lines were skipped because they are not JSON objects (a
        crash mid-write tears the last line)."""
        path = self.path / METRICS
        if not path.is_file():
            return [], 0
        return read_jsonl(path)

    def truncate_metrics(self, step: int) -> None:
        """Drop metric lines written after the checkpoint we resume from (they will be written again), and
        lines torn by a crash."""
        path = self.path / METRICS
        if not path.is_file():
            return
        records, _ = read_jsonl(path)
        lines = [json.dumps(r) for r in records if r.get("step", 0) <= step]
        atomic_write(path, lambda tmp: tmp.write_text("".join(ln + "\n" for ln in lines), encoding="utf-8"))

    def check_resumable(self) -> tuple[TrainerState, list[str]]:
        """Everything a resume reads, checked before anything is written: the trainer state, and weights and
        optimizer files saved at its step (or their kept predecessors). Returns the state and notes to show."""
        state = self.read_trainer()
        for name in (LAST, OPTIMIZER):
            if _matching(self.path / name, state.step) is None:
                problem = damage(self.path / name)
                if problem is None:
                    problem = f"from step {file_step(self.path / name)}, not the trainer's step {state.step}"
                raise NanoGPTError(f"cannot resume {self.path}: {name} is {problem}{self._init_hint()}")
        notes = []
        _, torn = self.read_metrics()
        if torn:
            notes.append(f"{self.path / METRICS}: skipped {torn} damaged line(s) (a crash while writing?)")
        return state, notes

    # --- save and restore ---

    def save(self, model: GPT, optimizer: torch.optim.Optimizer, state: TrainerState, weights_meta: dict[str, Any],
             is_best: bool, model_state: dict | None = None, optimizer_state: dict | None = None) -> None:
        """Write every file under a temporary name first, then rename them into place one after another, so a
        crash can at worst leave files of two adjacent saves, which latest() detects, never a half-written one.
        trainer.json is renamed last: it names the step the others must match. model_state / optimizer_state:
        the full states when model and optimizer hold shards (gathered by distributed.full_states)."""
        weights_meta = dict(weights_meta, step=state.step, tokens=state.tokens)
        staged: list[tuple[Path, Path]] = []

        def stage(name: str, write) -> None:
            tmp = self.path / f".{name}.staged"
            write(tmp)
            staged.append((tmp, self.path / name))

        try:
            stage(LAST, lambda p: save_model(p, model, weights_meta, model_state))
            if is_best:
                stage(BEST, lambda p: save_model(p, model, weights_meta, model_state))
            stage(OPTIMIZER, lambda p: save_optimizer(p, optimizer, state.step, optimizer_state))
            stage(TRAINER, lambda p: write_json(p, state.to_json()))
            # keep the previous set reachable (hard links: no copy) until the new one is complete
            for _, final in staged:
                _prev(final).unlink(missing_ok=True)
                if final.exists():
                    os.link(final, _prev(final))
            for tmp, final in staged:
                os.replace(tmp, final)
            for _, final in staged:
                _prev(final).unlink(missing_ok=True)
        finally:
            for tmp, _ in staged:
                tmp.unlink(missing_ok=True)

    def latest(self) -> SavePoint:
        """The last complete save, to resume from. A save cut short between its renames leaves newer files
        beside the older trainer.json: their predecessors are still there as hard links, so those are taken."""
        state = self.read_trainer()
        weights, optim = (_matching(self.path / name, state.step) for name in (LAST, OPTIMIZER))
        if weights is None or optim is None:
            found = {name: file_step(self.path / name) for name in (LAST, OPTIMIZER)}
            raise NanoGPTError(f"the checkpoint files in {self.path} are from different steps (weights "
                               f"{found[LAST]}, optimizer {found[OPTIMIZER]}, trainer {state.step}): a save was cut "
                               "short; start over with --force or --init-from")
        return SavePoint(state, weights, optim)


@dataclass
class SavePoint:
    """One complete save in a run folder: the trainer state and the weights and optimizer files of its step.
    The trainer loads the weights before it wraps the model for many processes, the optimizer after."""

    state: TrainerState
    weights: Path
    optimizer: Path


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The JSON objects of a .jsonl file, and how many non-empty lines were not one (skipped)."""
    records, bad = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict):
            records.append(record)
        else:
            bad += 1
    return records, bad


def _first_line(e: BaseException) -> str:
    return (str(e).strip() or type(e).__name__).splitlines()[0]


def _prev(path: Path) -> Path:
    return path.with_name(f".{path.name}.prev")


def _matching(path: Path, step: int) -> Path | None:
    """path, or its kept predecessor, whichever was saved at step."""
    for candidate in (path, _prev(path)):
        if candidate.is_file() and file_step(candidate) == step:
            return candidate
    return None
