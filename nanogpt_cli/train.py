"""Training: one visible loop over random windows of a prepared dataset, with exact resume.

    result = train(model_cfg, train_cfg, run_dir=Path("checkpoints/shk"))

Reproducibility: the training batches come from their own seeded generator, dropout from torch's global
RNG, and evaluation from fixed batches drawn with a separate seed; all generator states are saved in
trainer.json, so a run stopped and resumed gives the same losses as one that was not.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nanogpt_cli import __version__
from nanogpt_cli import checkpoint as ckpt
from nanogpt_cli.config import GPTConfig, TrainConfig, build_configs, flag, preset_values, split_values
from nanogpt_cli.data import load_meta, open_split
from nanogpt_cli.device import autocast_for, peak_flops, resolve_device, resolve_dtype
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.model import GPT

@dataclass
class TrainResult:
    run_dir: Path
    step: int  # optimizer updates done
    tokens: int  # training tokens seen
    train_loss: float | None  # last evaluated mean loss (nats/token)
    val_loss: float | None
    eval_step: int | None  # the step those two losses were measured at
    best_val_loss: float | None
    elapsed_s: float  # wall time of this invocation's loop, evaluations and checkpoints included
    tokens_per_s: float  # training speed: evaluations and checkpoints left out
    ms_per_iter: float  # likewise
    mfu: float | None  # model FLOPs utilisation against the device's known peak (CUDA only)
    stopped: str | None = None  # None: finished; "stop_at", "SIGINT", "SIGTERM"


# --- small pure helpers ---


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for update `step` (0-based): linear warmup, then cosine / constant / warmup-stable-decay
    down to min_lr at lr_decay_iters, and min_lr after it."""
    if step < cfg.warmup_iters:
        return cfg.learning_rate * (step + 1) / (cfg.warmup_iters + 1)
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


# --- data ---


class Batches:
    """Random (block_size + 1)-token windows from the train and val memmaps."""

    def __init__(self, data_dir: Path, name: str, block_size: int, batch_size: int, device: torch.device,
                 seed: int):
        self.splits = {s: open_split(data_dir, name, s) for s in ("train", "val")}
        for split, tokens in self.splits.items():
            if len(tokens) < block_size + 1:
                raise NanoGPTError(f"the {split} split of '{name}' has {len(tokens):,} tokens, fewer than "
                                   f"--block-size + 1 = {block_size + 1}; use a smaller --block-size or more data")
        self.block_size, self.batch_size, self.device = block_size, batch_size, device
        self.generator = torch.Generator().manual_seed(seed)

    def get_batch(self, split: str, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        data, T = self.splits[split], self.block_size
        ix = torch.randint(len(data) - T, (self.batch_size,), generator=generator or self.generator).tolist()
        windows = torch.from_numpy(np.stack([data[i:i + T + 1] for i in ix]).astype(np.int64))  # (B, T+1)
        x, y = windows[:, :-1], windows[:, 1:]
        if self.device.type == "cuda":
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device), y.to(self.device)

    def fixed_batches(self, split: str, n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The same n batches at every evaluation: curves move because the model does, not the sample."""
        g = torch.Generator().manual_seed(seed)
        return [self.get_batch(split, g) for _ in range(n)]


@torch.no_grad()
def estimate_loss(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], ctx) -> float:
    was_training = model.training
    model.eval()
    losses = []
    for x, y in batches:
        with ctx:
            _, loss = model(x, y)
        losses.append(loss.float())
    model.train(was_training)
    return torch.stack(losses).mean().item()


def optimizer_step(model, optimizer, micro_batches, ctx, scaler, grad_clip: float) -> torch.Tensor:
    """One update from a list of (x, y) micro-batches (gradient accumulation); returns the mean loss."""
    total = torch.zeros((), device=micro_batches[0][0].device)
    for x, y in micro_batches:
        with ctx:
            _, loss = model(x, y)
        loss = loss / len(micro_batches)
        scaler.scale(loss).backward()
        total += loss.detach()
    if grad_clip > 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return total


def make_optimizer(model: GPT, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    # the fused kernel is one call for all parameters (CUDA and CPU); mps falls back to foreach
    fused = device.type in ("cuda", "cpu")
    return torch.optim.AdamW(model.optimizer_groups(cfg.weight_decay), lr=cfg.learning_rate,
                             betas=(cfg.beta1, cfg.beta2), fused=fused)


# --- run folders ---


def default_run_dir(data: str) -> Path:
    return Path("checkpoints") / f"{data}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


RUN_FILES = (ckpt.LAST, ckpt.BEST, ckpt.OPTIMIZER, ckpt.TRAINER, ckpt.CONFIG, ckpt.METRICS)


def check_run_dir(run_dir: Path, resume: bool, force: bool) -> None:
    """A run folder must be new, empty, or (with --resume / --force) a run; anything else is refused."""
    if run_dir.exists() and not run_dir.is_dir():
        raise NanoGPTError(f"--out {run_dir} is a file, not a folder")
    has_run = run_dir.is_dir() and any((run_dir / n).exists() for n in (ckpt.LAST, ckpt.TRAINER, ckpt.CONFIG))
    if resume:
        if not (run_dir / ckpt.TRAINER).is_file():
            raise NanoGPTError(f"--resume: {run_dir} holds no resumable run (no {ckpt.TRAINER}); "
                               "start it without --resume")
    elif has_run and not force:
        raise NanoGPTError(f"{run_dir} already holds a run; pass --resume to continue it or --force to "
                           "start over (this deletes it)")
    elif not has_run and run_dir.is_dir() and any(run_dir.iterdir()):
        raise NanoGPTError(f"--out {run_dir} holds other files and no run; choose a new or empty folder")


def clear_run(run_dir: Path) -> None:
    """--force: delete the files of the run there, and nothing else."""
    for name in RUN_FILES:
        (run_dir / name).unlink(missing_ok=True)


class StopSignals:
    """Ctrl-C / SIGTERM set a flag; the loop finishes its step, saves and stops. A second Ctrl-C aborts."""

    def __init__(self):
        self.received: str | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: no handlers, Ctrl-C works as usual
                pass
        return self

    def _handle(self, signum, frame):
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


# --- the loop ---


def train(model_cfg: GPTConfig, cfg: TrainConfig, run_dir: Path, resume: bool = False, force: bool = False,
          init_from: str | None = None, on_event: Callable[[str, dict], None] | None = None) -> TrainResult:
    """Train (or resume) a run in run_dir. on_event(kind, info) gets "start", "step", "eval" and "save" events
    for the display; nothing here prints."""
    emit = on_event or (lambda kind, info: None)
    run_dir = Path(run_dir)
    check_run_dir(run_dir, resume, force)
    data_dir = Path(cfg.data_dir)
    meta = load_meta(data_dir, cfg.data)

    if model_cfg.vocab_size < meta["vocab_size"]:
        raise NanoGPTError(f"the model's vocabulary ({model_cfg.vocab_size:,}) is smaller than dataset "
                           f"'{cfg.data}' needs ({meta['vocab_size']:,} tokens)")

    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 matmuls on Ampere and newer
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(cfg.seed)
    batches = Batches(data_dir, cfg.data, model_cfg.block_size, cfg.batch_size, device, cfg.seed)
    eval_sets = {s: batches.fixed_batches(s, cfg.eval_iters, cfg.seed + 1 + i) for i, s in enumerate(("train", "val"))}

    model = GPT(model_cfg)
    if init_from is not None:
        ckpt.load_weights(model, _init_weights_path(init_from, model_cfg))
    model.to(device)
    optimizer = make_optimizer(model, cfg, device)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    ctx = autocast_for(device, dtype)

    step, tokens, best_val, elapsed_before = 0, 0, None, 0.0
    if resume:
        step, tokens, best_val, elapsed_before = _restore(run_dir, model, optimizer, scaler, batches)
        if cfg.stop_at is not None and cfg.stop_at <= step:  # refused before anything in the run changes
            raise NanoGPTError(f"--stop-at {cfg.stop_at} is not after the run's step {step}")
        _truncate_metrics(run_dir / ckpt.METRICS, step)
    else:
        if force and run_dir.is_dir():
            clear_run(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
    ckpt.write_json(run_dir / ckpt.CONFIG, {"model": model_cfg.to_dict(), "train": cfg.to_dict(),
                                            "dataset": meta, "version": __version__})

    compiled = torch.compile(model) if cfg.compile else model
    tokens_per_iter = cfg.batch_size * cfg.gradient_accumulation_steps * model_cfg.block_size
    flops_per_iter = model.flops_per_token() * tokens_per_iter
    peak = peak_flops(device)
    emit("start", dict(step=step, max_iters=cfg.max_iters, device=str(device), dtype=str(dtype).replace("torch.", ""),
                       params=model.num_params(), tokens_per_iter=tokens_per_iter, run_dir=str(run_dir),
                       resume=resume, model=model_cfg.to_dict(), train=cfg.to_dict()))

    last = {"train_loss": None, "val_loss": None, "step": None}
    end = min(cfg.max_iters, cfg.stop_at) if cfg.stop_at else cfg.max_iters

    eval_s = 0.0  # time spent evaluating and saving, left out of the speed figures

    def evaluate_and_save(elapsed: float):
        nonlocal best_val, eval_s, t_window
        t_eval = time.perf_counter()
        losses = {s: estimate_loss(compiled, eval_sets[s], ctx) for s in ("train", "val")}
        if not all(math.isfinite(v) for v in losses.values()):
            raise NanoGPTError(f"the loss became non-finite at step {step}; the last good checkpoint in {run_dir} "
                               "is kept; try a lower --learning-rate or --dtype float32")
        last.update(train_loss=losses["train"], val_loss=losses["val"], step=step)
        record = dict(step=step, train_loss=losses["train"], val_loss=losses["val"], lr=lr_at(max(step - 1, 0), cfg),
                      tokens=tokens, elapsed_s=round(elapsed_before + elapsed, 3))
        with open(run_dir / ckpt.METRICS, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        is_best = best_val is None or losses["val"] < best_val
        if is_best:
            best_val = losses["val"]
        _save(run_dir, model, optimizer, scaler, batches, meta, step, tokens, losses["val"], best_val, is_best,
              elapsed_before + elapsed)
        emit("eval", dict(record, best_val_loss=best_val))
        spent = time.perf_counter() - t_eval
        eval_s += spent
        t_window += spent  # the next progress line reports training speed only

    t0 = time.perf_counter()
    t_window, step_window = t0, step
    first_s = 0.0
    start_step = step
    stopped = None
    with StopSignals() as signals:
        if not resume:
            evaluate_and_save(0.0)
        model.train()
        while step < end:
            lr = lr_at(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            micro = [batches.get_batch("train") for _ in range(cfg.gradient_accumulation_steps)]
            t_step = time.perf_counter()
            loss = optimizer_step(compiled, optimizer, micro, ctx, scaler, cfg.grad_clip)
            if step == start_step:  # the first step warms up (and with --compile, compiles): not speed
                first_s = time.perf_counter() - t_step
            step += 1
            tokens += tokens_per_iter
            if step % cfg.log_interval == 0 or step == end:
                loss_value = loss.item()
                if not math.isfinite(loss_value):
                    raise NanoGPTError(f"the loss became non-finite at step {step}; the last good checkpoint in "
                                       f"{run_dir} is kept; try a lower --learning-rate or --dtype float32")
                now = time.perf_counter()
                dt = (now - t_window) / max(1, step - step_window)
                t_window, step_window = now, step
                emit("step", dict(step=step, loss=loss_value, lr=lr, tokens=tokens, elapsed_s=now - t0,
                                  ms_per_iter=dt * 1000, tokens_per_s=tokens_per_iter / dt,
                                  mfu=flops_per_iter / dt / peak if peak else None))
            if step % cfg.eval_interval == 0 or step == cfg.max_iters:
                evaluate_and_save(time.perf_counter() - t0)
            if signals.received:
                stopped = signals.received
                break
        if step == end and end < cfg.max_iters:
            stopped = "stop_at"
        if stopped and step % cfg.eval_interval != 0:
            _save(run_dir, model, optimizer, scaler, batches, meta, step, tokens, last["val_loss"], best_val, False,
                  elapsed_before + time.perf_counter() - t0)
            emit("save", dict(step=step))

    elapsed = time.perf_counter() - t0
    done = step - start_step
    timed = done - 1 if done > 1 else done  # the speed figures leave out the warm-up step when there are others
    train_s = max(elapsed - eval_s - (first_s if done > 1 else 0.0), 1e-9)
    ms = train_s / timed * 1000 if timed else 0.0
    tps = tokens_per_iter * timed / train_s if timed else 0.0
    return TrainResult(run_dir=run_dir, step=step, tokens=tokens, train_loss=last["train_loss"],
                       val_loss=last["val_loss"], eval_step=last["step"], best_val_loss=best_val, elapsed_s=elapsed,
                       tokens_per_s=tps,
                       ms_per_iter=ms, mfu=(flops_per_iter * timed / train_s / peak) if peak and timed else None,
                       stopped=stopped)


def _init_weights_path(init_from: str, model_cfg: GPTConfig) -> Path:
    path = ckpt.resolve_weights(init_from, last=True)
    theirs = GPTConfig.from_dict(ckpt.read_metadata(path)["config"])
    if dataclasses.replace(theirs, dropout=model_cfg.dropout) != model_cfg:
        raise NanoGPTError(f"--init-from {init_from} has a different architecture; drop the model flags to use its own")
    return path


def run_configs(preset: str | None, overrides: dict[str, Any], run_dir: Path, resume: bool = False,
                init_from: str | None = None) -> tuple[GPTConfig, TrainConfig]:
    """The effective configs of a run. Fresh: preset < overrides (config file, then flags), with the vocabulary
    from the dataset. Resume: the saved run's configs, overrides applied to training fields only. --init-from:
    the checkpoint's architecture (dropout may change), training fields as for a fresh run."""
    model_over, train_over = split_values(overrides)
    if resume:
        config_path = Path(run_dir) / ckpt.CONFIG
        if not config_path.is_file():
            raise NanoGPTError(f"--resume: {run_dir} holds no run to resume (no {ckpt.CONFIG})")
        if model_over:
            raise NanoGPTError(f"--resume takes the architecture from {run_dir}; drop "
                               + ", ".join(f"--{flag(k)}" for k in sorted(model_over)))
        saved = json.loads(config_path.read_text())
        saved["train"]["stop_at"] = None  # a --stop-at ends that invocation, not the run
        return build_configs({**saved["model"], **saved["train"], **train_over})
    values = {**(preset_values(preset) if preset else {}), **overrides}
    model_values, train_values = split_values(values)
    _, train_cfg = build_configs(train_values)
    meta = load_meta(Path(train_cfg.data_dir), train_cfg.data) if train_cfg.data else None
    if meta is None:
        raise NanoGPTError("--data is required: the name of a dataset made by `nanogpt prepare`")
    if init_from is not None:
        path = ckpt.resolve_weights(init_from, last=True)
        weights_meta = ckpt.read_metadata(path)
        if weights_meta.get("tokenizer") != meta["tokenizer"]:
            raise NanoGPTError(f"--init-from {init_from} was trained with a different tokenizer or vocabulary than "
                               f"dataset '{train_cfg.data}'; prepare the data with the checkpoint's tokenizer")
        extra = set(model_over) - {"dropout"}
        if extra:
            raise NanoGPTError("--init-from takes the architecture from the checkpoint; drop "
                               + ", ".join(f"--{flag(k)}" for k in sorted(extra)))
        model_values = {**weights_meta["config"], **model_over}
    elif "vocab_size" not in model_values or model_values["vocab_size"] < meta["vocab_size"]:
        model_values["vocab_size"] = meta["vocab_size"]
    return build_configs({**model_values, **train_values})


def _save(run_dir, model, optimizer, scaler, batches, meta, step, tokens, val_loss, best_val, is_best, elapsed):
    """Write every file under a temporary name first, then rename them into place one after another, so a
    crash can at worst leave files of two adjacent saves, which _restore detects, never a half-written one.
    trainer.json is renamed last: it names the step the others must match."""
    weights_meta = dict(tokenizer=meta["tokenizer"], step=step, tokens=tokens, val_loss=val_loss,
                        dataset=meta.get("name", ""))
    state = dict(step=step, tokens=tokens, best_val_loss=best_val, elapsed_s=elapsed, version=__version__,
                 rng_torch=ckpt.encode_rng(torch.get_rng_state()),
                 rng_batches=ckpt.encode_rng(batches.generator.get_state()),
                 rng_cuda=[ckpt.encode_rng(s) for s in torch.cuda.get_rng_state_all()]
                 if torch.cuda.is_available() else [],
                 scaler=scaler.state_dict() if scaler.is_enabled() else None)
    staged: list[tuple[Path, Path]] = []

    def stage(name: str, write) -> None:
        tmp = run_dir / f".{name}.staged"
        write(tmp)
        staged.append((tmp, run_dir / name))

    try:
        stage(ckpt.LAST, lambda p: ckpt.save_model(p, model, weights_meta))
        if is_best:
            stage(ckpt.BEST, lambda p: ckpt.save_model(p, model, weights_meta))
        stage(ckpt.OPTIMIZER, lambda p: ckpt.save_optimizer(p, optimizer, step))
        stage(ckpt.TRAINER, lambda p: ckpt.write_json(p, state))
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


def _prev(path: Path) -> Path:
    return path.with_name(f".{path.name}.prev")


def _restore(run_dir, model, optimizer, scaler, batches) -> tuple[int, int, float | None, float]:
    state = json.loads((run_dir / ckpt.TRAINER).read_text())
    step = state["step"]
    # a save cut short between its renames leaves newer files beside the older trainer.json: their
    # predecessors are still there as hard links, so take those
    weights, optim = (_matching(run_dir / name, step) for name in (ckpt.LAST, ckpt.OPTIMIZER))
    if weights is None or optim is None:
        found = {name: ckpt.file_step(run_dir / name) for name in (ckpt.LAST, ckpt.OPTIMIZER)}
        raise NanoGPTError(f"the checkpoint files in {run_dir} are from different steps (weights {found[ckpt.LAST]}, "
                           f"optimizer {found[ckpt.OPTIMIZER]}, trainer {step}): a save was cut short; "
                           "start over with --force or --init-from")
    ckpt.load_weights(model, weights)
    ckpt.load_optimizer(optim, optimizer)
    torch.set_rng_state(ckpt.decode_rng(state["rng_torch"]))
    batches.generator.set_state(ckpt.decode_rng(state["rng_batches"]))
    if state.get("rng_cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([ckpt.decode_rng(s) for s in state["rng_cuda"]])
    if state.get("scaler") and scaler.is_enabled():
        scaler.load_state_dict(state["scaler"])
    return state["step"], state["tokens"], state["best_val_loss"], state.get("elapsed_s", 0.0)


def _matching(path: Path, step: int) -> Path | None:
    """path, or its kept predecessor, whichever was saved at step."""
    for candidate in (path, _prev(path)):
        if candidate.is_file() and ckpt.file_step(candidate) == step:
            return candidate
    return None


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines written after the checkpoint we resume from (they will be written again)."""
    if not path.is_file():
        return
    lines = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
    ckpt.atomic_write(path, lambda tmp: tmp.write_text("".join(ln + "\n" for ln in lines)))
