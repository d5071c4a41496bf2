"""Training: one visible loop over random windows of a prepared dataset, with exact resume.

    result = train(plan_run({"preset": "cpu-char", "data": "shk"}, out="checkpoints/shk"))

Reproducibility: the training batches come from their own seeded generator, dropout from torch's global
RNG, and evaluation from fixed batches drawn with a separate seed; all generator states are saved in
trainer.json, so a run stopped and resumed gives the same losses as one that was not.
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from nanogpt_cli import checkpoint as ckpt
from nanogpt_cli.config import GPTConfig, TrainConfig, build_configs, flag, preset_values, split_values
from nanogpt_cli.data import load_meta, open_split
from nanogpt_cli.device import autocast_for, peak_flops, resolve_device, resolve_dtype
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.model import GPT
from nanogpt_cli.tokenizer import describe_difference

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


# --- the run plan: every input of a run, resolved once ---


@dataclass
class RunPlan:
    """What a run needs, resolved and checked before anything is written."""

    model: GPTConfig
    train: TrainConfig
    run_dir: ckpt.RunDir
    dataset: dict[str, Any]  # the prepared dataset's meta.json
    init_weights: Path | None = None  # --init-from: the weights file to start from
    resume: bool = False
    force: bool = False
    step: int = 0  # where the run starts: 0, or the step a resumed run stopped at
    notes: list[str] = field(default_factory=list)  # things the user should know before it starts (warnings)

    @property
    def complete(self) -> bool:
        """A resumed run that has already done its --max-iters."""
        return self.resume and self.step >= self.train.max_iters


def default_run_dir(data: str) -> Path:
    return Path("checkpoints") / f"{data}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def plan_run(flags: dict[str, Any], file_values: dict[str, Any] | None = None, out: str | Path | None = None,
             resume: bool = False, force: bool = False, init_from: str | None = None,
             init_last: bool = False) -> RunPlan:
    """The effective configs of a run. Fresh: preset < config file < flags, with the vocabulary from the dataset.
    Resume: the saved run's configs; the same preset, file and flags may be given again (values equal to the
    saved architecture are accepted, differing ones refused), and training fields they give apply.
    --init-from: the checkpoint's architecture (dropout may change; best weights unless init_last), training
    fields as for a fresh run. `preset` and `out` may come from the flags or the config file (flags win)."""
    values = {**(file_values or {}), **flags}
    preset = values.pop("preset", None)
    out = out or values.pop("out", None)
    values.pop("out", None)
    if resume and out is None:
        raise NanoGPTError("--resume needs --out: the run folder to continue")
    run_dir = ckpt.RunDir(out or default_run_dir(values.get("data") or "run"))
    run_dir.check(resume, force)
    split_values(values)  # unknown keys are refused first
    if resume:
        if init_from is not None:
            raise NanoGPTError("--resume continues a run with its own weights; drop --init-from")
        return _plan_resume(run_dir, preset, values)
    notes: list[str] = []
    explicit_model, _ = split_values(values)
    values = {**(preset_values(preset) if preset else {}), **values}
    model_values, train_values = split_values(values)
    _, train_cfg = build_configs(train_values)
    if not train_cfg.data:
        raise NanoGPTError("--data is required: the name of a dataset made by `nanogpt prepare`")
    meta = load_meta(Path(train_cfg.data_dir), train_cfg.data)
    init_weights = None
    if init_from is not None:
        init_weights = ckpt.resolve_weights(init_from, last=init_last)
        weights_meta = ckpt.read_metadata(init_weights)
        differ = describe_difference(meta["tokenizer"], weights_meta.get("tokenizer") or {},
                                     f"dataset '{train_cfg.data}'", "the checkpoint")
        if differ:
            raise NanoGPTError(f"--init-from {init_from} was trained with another tokenizer than dataset "
                               f"'{train_cfg.data}' ({differ}); prepare the data with the checkpoint's tokenizer")
        extra = set(explicit_model) - {"dropout"}
        if extra:
            raise NanoGPTError("--init-from takes the architecture from the checkpoint; drop "
                               + ", ".join(f"--{flag(k)}" for k in sorted(extra)))
        model_values = {**weights_meta["config"], **{k: v for k, v in model_values.items() if k == "dropout"}}
        val = weights_meta.get("val_loss")
        notes.append(f"--init-from: starting from {init_weights} (step {weights_meta.get('step')}"
                     + (f", val loss {val:.4f}" if isinstance(val, (int, float)) else "") + ")")
    elif "vocab_size" not in model_values:
        model_values["vocab_size"] = meta["vocab_size"]
    model_cfg, train_cfg = build_configs({**model_values, **train_values})
    if model_cfg.vocab_size < meta["vocab_size"]:
        raise NanoGPTError(f"--vocab-size {model_cfg.vocab_size:,} is smaller than the {meta['vocab_size']:,} tokens "
                           f"of dataset '{train_cfg.data}'; drop it to use the dataset's, or give at least that")
    notes += _warnings(model_cfg, train_cfg)
    return RunPlan(model_cfg, train_cfg, run_dir, meta, init_weights=init_weights, force=force, notes=notes)


def _warnings(model_cfg: GPTConfig, cfg: TrainConfig) -> list[str]:
    notes = []
    if cfg.warmup_iters >= cfg.max_iters:
        notes.append(f"--warmup-iters ({cfg.warmup_iters:,}) is not below --max-iters ({cfg.max_iters:,}): the "
                     "learning rate never reaches its peak")
    if cfg.dtype == "float16" and resolve_device(cfg.device).type == "cpu":
        notes.append("--dtype float16 on the CPU runs the GPU's fp16 path (autocast and grad scaler) and is slow "
                     "there; use bfloat16 or float32 for speed")
    return notes


def _plan_resume(run_dir: ckpt.RunDir, preset: str | None, given: dict[str, Any]) -> RunPlan:
    saved = run_dir.read_config()
    state, notes = run_dir.check_resumable()
    # the command that started the run may be given again: what it says must agree with the saved run
    from_preset = preset_values(preset) if preset else {}
    said = {**from_preset, **given}
    model_said, _ = split_values(said)
    differ = [k for k, v in model_said.items() if saved["model"].get(k) != v]
    if differ:
        def where(k):
            return f"--preset {preset} gives" if k not in given else "given"
        raise NanoGPTError(f"--resume takes the architecture from {run_dir}; these differ from it: " + ", ".join(
            f"--{flag(k)} (saved {saved['model'].get(k)!r}, {where(k)} {model_said[k]!r})" for k in sorted(differ)))
    preset_only = [k for k, v in from_preset.items() if k not in given and k in saved["train"]
                   and saved["train"][k] != v]
    if preset_only:
        raise NanoGPTError(f"--preset {preset} would change the resumed run's " + ", ".join(
            f"--{flag(k)} (saved {saved['train'][k]!r}, preset {from_preset[k]!r})" for k in sorted(preset_only))
            + "; drop --preset when resuming, or give those flags")
    _, train_over = split_values(given)
    saved_train = {k: v for k, v in saved["train"].items() if k not in ("stop_at", "out")}  # out: older runs
    model_cfg, train_cfg = build_configs({**saved["model"], **saved_train, **train_over})
    plan_step = state.step
    if state.step < train_cfg.max_iters and train_cfg.stop_at is not None and train_cfg.stop_at <= state.step:
        raise NanoGPTError(f"--stop-at {train_cfg.stop_at} is not after the run's step {state.step}; drop it (or "
                           "raise it) to continue the run")
    meta = load_meta(Path(train_cfg.data_dir), train_cfg.data)
    saved_meta = saved.get("dataset") or {}
    differ_tok = describe_difference(meta["tokenizer"], saved_meta.get("tokenizer", meta["tokenizer"]),
                                     f"dataset '{train_cfg.data}' now", "the run")
    if differ_tok:
        raise NanoGPTError(f"dataset '{train_cfg.data}' was prepared again with another tokenizer since {run_dir} "
                           f"started ({differ_tok}); prepare it as before, or start a new run")
    if saved_meta.get("created") and meta.get("created") != saved_meta.get("created") and \
            train_cfg.data == saved["train"].get("data"):
        notes.append(f"dataset '{train_cfg.data}' was prepared again since this run started (then "
                     f"{saved_meta['created']}, now {meta.get('created')}); the run continues on the new data")
    notes += _warnings(model_cfg, train_cfg)
    return RunPlan(model_cfg, train_cfg, run_dir, meta, resume=True, step=plan_step, notes=notes)


# --- what the loop tells the display ---


@dataclass
class RunStarted:
    step: int
    max_iters: int
    device: str
    dtype: str
    params: int  # non-embedding parameters
    tokens_per_iter: int
    run_dir: str
    resume: bool
    model: dict[str, Any]
    train: dict[str, Any]


@dataclass
class StepLogged:
    """One progress line: also a line of metrics.jsonl (kind "train")."""

    step: int
    loss: float  # this update's mean training loss
    lr: float
    tokens: int
    elapsed_s: float
    ms_per_iter: float  # since the last log line, evaluations and checkpoints left out
    tokens_per_s: float
    mfu: float | None
    skipped: int = 0  # fp16: updates since the last line that the grad scaler skipped (inf/NaN gradients)
    scale: float | None = None  # fp16: the grad scaler's loss scale now

    def record(self) -> dict[str, Any]:
        record = dict(kind="train", step=self.step, loss=self.loss, lr=self.lr, tokens=self.tokens,
                      elapsed_s=round(self.elapsed_s, 3), tokens_per_s=round(self.tokens_per_s, 1))
        if self.scale is not None:
            record.update(skipped=self.skipped, scale=self.scale)
        return record


@dataclass
class Evaluated:
    """One evaluation: also a line of metrics.jsonl (kind "eval"; all fields but best_val_loss). Lines of runs
    from before train lines existed have no kind: they are evaluations."""

    step: int
    train_loss: float
    val_loss: float
    lr: float
    tokens: int
    elapsed_s: float
    best_val_loss: float

    def record(self) -> dict[str, Any]:
        return dict(kind="eval", step=self.step, train_loss=self.train_loss, val_loss=self.val_loss, lr=self.lr,
                    tokens=self.tokens, elapsed_s=self.elapsed_s)


class Display(Protocol):
    def on_start(self, event: RunStarted) -> None: ...
    def on_step(self, event: StepLogged) -> None: ...
    def on_eval(self, event: Evaluated) -> None: ...
    def on_save(self, step: int) -> None: ...
    def on_status(self, text: str) -> None: ...  # what happens before the first step (no long silences)


class NoDisplay:
    def on_start(self, event: RunStarted) -> None:
        pass

    def on_step(self, event: StepLogged) -> None:
        pass

    def on_eval(self, event: Evaluated) -> None:
        pass

    def on_save(self, step: int) -> None:
        pass

    def on_status(self, text: str) -> None:
        pass


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


def non_finite(step: int, run_dir: ckpt.RunDir) -> NanoGPTError:
    return NanoGPTError(f"the loss became non-finite at step {step}; the last good checkpoint in {run_dir} is kept; "
                        "try a lower --learning-rate or --dtype float32")


# --- the loop ---


def train(plan: RunPlan, display: Display | None = None) -> TrainResult:
    """Train (or resume) the planned run. The display gets typed events; nothing here prints."""
    show = display or NoDisplay()
    model_cfg, cfg, run_dir = plan.model, plan.train, plan.run_dir
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 matmuls on Ampere and newer
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(cfg.seed)
    show.on_status("loading the data")
    batches = Batches(Path(cfg.data_dir), cfg.data, model_cfg.block_size, cfg.batch_size, device, cfg.seed)
    eval_sets = {s: batches.fixed_batches(s, cfg.eval_iters, cfg.seed + 1 + i) for i, s in enumerate(("train", "val"))}

    show.on_status("building the model")
    model = GPT(model_cfg)
    if plan.init_weights is not None:
        ckpt.load_weights(model, plan.init_weights)
    model.to(device)
    optimizer = make_optimizer(model, cfg, device)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    ctx = autocast_for(device, dtype)

    if plan.resume:
        state = run_dir.restore(model, optimizer)
        _restore_rng(state, batches, scaler)
        run_dir.truncate_metrics(state.step)
    else:
        state = ckpt.TrainerState()
        run_dir.start(plan.force)
    run_dir.write_config({"model": model_cfg.to_dict(), "train": cfg.to_dict(), "dataset": plan.dataset})
    weights_meta = dict(tokenizer=plan.dataset["tokenizer"], dataset=plan.dataset.get("name") or cfg.data)

    compiled = torch.compile(model) if cfg.compile else model
    tokens_per_iter = cfg.batch_size * cfg.gradient_accumulation_steps * model_cfg.block_size
    flops_per_iter = model.flops_per_token() * tokens_per_iter
    peak = peak_flops(device)
    show.on_start(RunStarted(step=state.step, max_iters=cfg.max_iters, device=str(device),
                             dtype=str(dtype).replace("torch.", ""), params=model.num_params(),
                             tokens_per_iter=tokens_per_iter, run_dir=str(run_dir), resume=plan.resume,
                             model=model_cfg.to_dict(), train=cfg.to_dict()))

    last: Evaluated | None = None
    end = min(cfg.max_iters, cfg.stop_at) if cfg.stop_at else cfg.max_iters
    elapsed_before = state.elapsed_s
    eval_s = 0.0  # time spent evaluating and saving, left out of the speed figures

    def save(val_loss: float | None, is_best: bool) -> None:
        state.elapsed_s = elapsed_before + time.perf_counter() - t0
        _capture_rng(state, batches, scaler)
        run_dir.save(model, optimizer, state, dict(weights_meta, val_loss=val_loss), is_best)

    def evaluate_and_save() -> None:
        nonlocal last, eval_s, t_window
        t_eval = time.perf_counter()
        losses = {s: estimate_loss(compiled, eval_sets[s], ctx) for s in ("train", "val")}
        if not all(math.isfinite(v) for v in losses.values()):
            raise non_finite(state.step, run_dir)
        is_best = state.best_val_loss is None or losses["val"] < state.best_val_loss
        if is_best:
            state.best_val_loss = losses["val"]
        last = Evaluated(step=state.step, train_loss=losses["train"], val_loss=losses["val"],
                         lr=lr_at(max(state.step - 1, 0), cfg), tokens=state.tokens,
                         elapsed_s=round(elapsed_before + t_eval - t0, 3), best_val_loss=state.best_val_loss)
        run_dir.append_metrics(last.record())
        save(losses["val"], is_best)
        show.on_eval(last)
        spent = time.perf_counter() - t_eval
        eval_s += spent
        t_window += spent  # the next progress line reports training speed only

    t0 = time.perf_counter()
    t_window, step_window = t0, state.step
    first_s = 0.0
    start_step = state.step
    skipped = 0  # fp16 updates the scaler skipped since the last log line
    stopped = None
    with StopSignals() as signals:
        if not plan.resume:
            show.on_status("first evaluation")
            evaluate_and_save()
        if cfg.compile:
            show.on_status("compiling the model (the first step takes a while)")
        model.train()
        while state.step < end:
            lr = lr_at(state.step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            micro = [batches.get_batch("train") for _ in range(cfg.gradient_accumulation_steps)]
            t_step = time.perf_counter()
            scale = scaler.get_scale() if scaler.is_enabled() else None  # fp16 only: a sync per step
            loss = optimizer_step(compiled, optimizer, micro, ctx, scaler, cfg.grad_clip)
            if scale is not None and scaler.get_scale() < scale:  # the scaler backs off only when it skips
                skipped += 1
            if state.step == start_step:  # the first step warms up (and with --compile, compiles): not speed
                first_s = time.perf_counter() - t_step
            state.step += 1
            state.tokens += tokens_per_iter
            if state.step % cfg.log_interval == 0 or state.step == end:
                loss_value = loss.item()
                if not math.isfinite(loss_value):
                    raise non_finite(state.step, run_dir)
                now = time.perf_counter()
                dt = (now - t_window) / max(1, state.step - step_window)
                t_window, step_window = now, state.step
                logged = StepLogged(step=state.step, loss=loss_value, lr=lr, tokens=state.tokens,
                                    elapsed_s=elapsed_before + now - t0, ms_per_iter=dt * 1000,
                                    tokens_per_s=tokens_per_iter / dt, mfu=flops_per_iter / dt / peak if peak else None,
                                    skipped=skipped, scale=scaler.get_scale() if scaler.is_enabled() else None)
                run_dir.append_metrics(logged.record())
                show.on_step(logged)
                skipped = 0
            if state.step % cfg.eval_interval == 0 or state.step == cfg.max_iters:
                evaluate_and_save()
            if signals.received:
                stopped = signals.received
                break
        if state.step == end and end < cfg.max_iters:
            stopped = "stop_at"
        if stopped and state.step % cfg.eval_interval != 0:
            save(last.val_loss if last else None, False)
            show.on_save(state.step)

    elapsed = time.perf_counter() - t0
    done = state.step - start_step
    timed = done - 1 if done > 1 else done  # the speed figures leave out the warm-up step when there are others
    train_s = max(elapsed - eval_s - (first_s if done > 1 else 0.0), 1e-9)
    return TrainResult(run_dir=run_dir.path, step=state.step, tokens=state.tokens,
                       train_loss=last.train_loss if last else None, val_loss=last.val_loss if last else None,
                       eval_step=last.step if last else None, best_val_loss=state.best_val_loss, elapsed_s=elapsed,
                       tokens_per_s=tokens_per_iter * timed / train_s if timed else 0.0,
                       ms_per_iter=train_s / timed * 1000 if timed else 0.0,
                       mfu=(flops_per_iter * timed / train_s / peak) if peak and timed else None, stopped=stopped)


def _capture_rng(state: ckpt.TrainerState, batches: Batches, scaler) -> None:
    state.rng_torch = torch.get_rng_state()
    state.rng_batches = batches.generator.get_state()
    state.rng_cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    state.scaler = scaler.state_dict() if scaler.is_enabled() else None


def _restore_rng(state: ckpt.TrainerState, batches: Batches, scaler) -> None:
    torch.set_rng_state(state.rng_torch)
    batches.generator.set_state(state.rng_batches)
    if state.rng_cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state.rng_cuda)
    if state.scaler and scaler.is_enabled():
        scaler.load_state_dict(state.scaler)
