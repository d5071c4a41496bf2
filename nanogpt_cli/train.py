"""Training: one visible loop over random windows of a prepared dataset, with exact resume.

    result = train(plan_run({"preset": "cpu-char", "data": "shk"}, out="checkpoints/shk"))

Reproducibility: the training batches come from their own seeded generator, dropout from torch's global
RNG, and evaluation from fixed batches drawn with a separate seed; all generator states are saved in
trainer.json, so a run stopped and resumed gives the same losses as one that was not.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from nanogpt_cli import checkpoint as ckpt
from nanogpt_cli.loading import load_model
from nanogpt_cli.rundir import RunDir, resolve_weights
from nanogpt_cli import hf
from nanogpt_cli.config import GPTConfig, TrainConfig, build_configs, flag, preset_values, split_values
from nanogpt_cli.data import load_meta, open_split
from nanogpt_cli.device import autocast_for, peak_flops, resolve_device, resolve_dtype
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.model import GPT
from nanogpt_cli.optim import make_optimizer, set_lr
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
    stopped: str | None = None  # None: finished; "max_time" (finished by the clock), "stop_at", "SIGINT", "SIGTERM"


# --- small pure helpers ---


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


# --- data ---


class Batches:
    """Random (block_size + 1)-token windows from the train and val shards, never across two shards."""

    def __init__(self, data_dir: Path, name: str, block_size: int, batch_size: int, device: torch.device,
                 seed: int):
        self.splits = {s: open_split(data_dir, name, s) for s in ("train", "val")}
        for split, tokens in self.splits.items():
            if tokens.num_windows(block_size + 1) == 0:
                longest = f" (the longest of its {len(tokens.counts)} shards has {max(tokens.counts):,})" \
                    if len(tokens.counts) > 1 else ""
                raise NanoGPTError(f"the {split} split of '{name}' has {len(tokens):,} tokens{longest}, fewer than "
                                   f"--block-size + 1 = {block_size + 1}; use a smaller --block-size or more data")
        self.block_size, self.batch_size, self.device = block_size, batch_size, device
        self.generator = torch.Generator().manual_seed(seed)

    def draw(self, split: str, generator: torch.Generator | None = None) -> list[tuple[int, int]]:
        """Where the windows of one batch start, (shard, offset) each: the random part, which every rank
        draws alike."""
        return self.splits[split].starts(self.batch_size, self.block_size + 1, generator or self.generator)

    def load(self, split: str, starts: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        data, T = self.splits[split], self.block_size
        windows = torch.from_numpy(data.read(starts, T + 1).astype(np.int64))
        x, y = windows[:, :-1], windows[:, 1:]  # (B, T) each
        if self.device.type == "cuda":
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device), y.to(self.device)

    def get_batch(self, split: str, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.load(split, self.draw(split, generator))

    def fixed_batches(self, split: str, n: int, seed: int,
                      share: list[int] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The same n batches at every evaluation: curves move because the model does, not the sample. Under
        torchrun a rank loads only its share of them (indices into the n)."""
        g = torch.Generator().manual_seed(seed)
        starts = [self.draw(split, g) for _ in range(n)]
        return [self.load(split, starts[i]) for i in (range(n) if share is None else share)]


def estimate_loss(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], ctx) -> float:
    return eval_losses(model, batches, ctx).mean().item()


@torch.no_grad()
def eval_losses(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], ctx) -> torch.Tensor:
    """The mean loss of each batch. (n,)"""
    was_training = model.training
    model.eval()
    losses = []
    for x, y in batches:
        with ctx:
            _, loss = model(x, y)
        losses.append(loss.float())
    model.train(was_training)
    return torch.stack(losses)


def optimizer_step(model, optimizer, micro_batches, ctx, scaler, grad_clip: float, sync=None) -> torch.Tensor:
    """One update from a list of (x, y) micro-batches (gradient accumulation); returns their mean loss. Under
    torchrun they are this rank's share, and sync(enabled) skips the gradient reduction on all but the last."""
    total = torch.zeros((), device=micro_batches[0][0].device)
    for i, (x, y) in enumerate(micro_batches):
        with sync(i == len(micro_batches) - 1) if sync else contextlib.nullcontext():
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


# --- the run plan: every input of a run, resolved once ---


@dataclass
class RunPlan:
    """What a run needs, resolved and checked before anything is written."""

    model: GPTConfig
    train: TrainConfig
    run_dir: RunDir
    dataset: dict[str, Any]  # the prepared dataset's meta.json
    init_weights: Path | None = None  # --init-from: the weights file to start from
    init_model: GPT | None = None  # --init-from a Hugging Face model: its weights, converted once while planning
    resume: bool = False
    force: bool = False
    step: int = 0  # where the run starts: 0, or the step a resumed run stopped at
    notes: list[str] = field(default_factory=list)  # things the user should know before it starts (warnings)
    time_spent: float | None = None  # a resumed run that --max-time ended: the --max-time it ended under

    @property
    def complete(self) -> bool:
        """A resumed run that has already done its --max-iters, or spent a --max-time not raised since."""
        return self.resume and (self.step >= self.train.max_iters or self.time_over)

    @property
    def time_over(self) -> bool:
        return self.time_spent is not None and (self.train.max_time or 0) <= self.time_spent


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
    run_dir = RunDir(out or default_run_dir(values.get("data") or "run"))
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
    init_weights = init_model = None
    if init_from is not None:
        if hf.is_hf_source(init_from):
            init_model, weights_meta = load_model(init_from)
            source = init_from
        else:
            init_weights = resolve_weights(init_from, last=init_last)
            weights_meta = ckpt.read_metadata(init_weights)
            source = init_weights
        theirs, ours = (weights_meta.get("tokenizer") or {}).get("name"), meta["tokenizer"]["name"]
        if theirs != ours:
            raise NanoGPTError(f"--init-from {init_from} uses the {theirs} tokenizer but dataset "
                               f"'{train_cfg.data}' was prepared with {ours}; prepare it with --tokenizer {theirs}")
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
        step, val = weights_meta.get("step"), weights_meta.get("val_loss")  # a Hugging Face model has neither
        known = ([f"step {step}"] if step is not None else []) + \
            ([f"val loss {val:.4f}"] if isinstance(val, (int, float)) else [])
        notes.append(f"--init-from: starting from {source}" + (f" ({', '.join(known)})" if known else ""))
    elif "vocab_size" not in model_values:
        model_values["vocab_size"] = meta["vocab_size"]
    model_cfg, train_cfg = build_configs({**model_values, **train_values})
    if model_cfg.vocab_size < meta["vocab_size"]:
        raise NanoGPTError(f"--vocab-size {model_cfg.vocab_size:,} is smaller than the {meta['vocab_size']:,} tokens "
                           f"of dataset '{train_cfg.data}'; drop it to use the dataset's, or give at least that")
    notes += _warnings(model_cfg, train_cfg)
    return RunPlan(model_cfg, train_cfg, run_dir, meta, init_weights=init_weights, init_model=init_model,
                   force=force, notes=notes)


def _warnings(model_cfg: GPTConfig, cfg: TrainConfig) -> list[str]:
    notes = []
    if cfg.warmup_iters >= cfg.max_iters:
        notes.append(f"--warmup-iters ({cfg.warmup_iters:,}) is not below --max-iters ({cfg.max_iters:,}): the "
                     "learning rate never reaches its peak")
    if cfg.dtype == "float16" and resolve_device(cfg.device).type == "cpu":
        notes.append("--dtype float16 on the CPU runs the GPU's fp16 path (autocast and grad scaler) and is slow "
                     "there; use bfloat16 or float32 for speed")
    return notes


def _plan_resume(run_dir: RunDir, preset: str | None, given: dict[str, Any]) -> RunPlan:
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
    saved_optimizer = saved["train"].get("optimizer", "adamw")
    if train_over.get("optimizer", saved_optimizer) != saved_optimizer:
        raise NanoGPTError(f"--resume continues the run's --optimizer {saved_optimizer}; it cannot change to "
                           f"{train_over['optimizer']} (start a new run with --init-from instead)")
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
    return RunPlan(model_cfg, train_cfg, run_dir, meta, resume=True, step=plan_step, notes=notes,
                   time_spent=state.max_time_spent)


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
    # False for the line at --stop-at's step, which metrics.jsonl and the trackers leave out, so a stopped and
    # resumed run records the same lines as an uninterrupted one
    recorded: bool = True

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
    saved: bool = True  # a checkpoint was written after it (never at step 0, where it would resume nothing)

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
    """Ctrl-C / SIGTERM set a flag; the loop finishes its step, saves and stops. A second Ctrl-C aborts, except
    under torchrun, which passes a terminal's Ctrl-C on to its workers a second time (and kills them itself
    if they have not ended 30 s later)."""

    def __init__(self, abort_on_second: bool = True):
        self.abort_on_second = abort_on_second
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
        if self.received is not None and signum == signal.SIGINT and self.abort_on_second:
            raise KeyboardInterrupt
        self.received = self.received or signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def non_finite(step: int, run_dir: RunDir) -> NanoGPTError:
    kept = (f"the last good checkpoint in {run_dir} is kept" if run_dir.last_path.is_file()
            else "no checkpoint had been saved yet")
    return NanoGPTError(f"the loss became non-finite at step {step}; {kept}; try a lower --learning-rate or "
                        "--dtype float32")


# --- many processes ---


def processes(cfg: TrainConfig):
    """`with processes(cfg) as world:` the process group of a torchrun launch (a distributed.World), or None in
    a plain one-process run, which then imports nothing distributed."""
    n = int(os.environ.get("WORLD_SIZE", "1"))
    if n <= 1:
        return contextlib.nullcontext(None)
    from nanogpt_cli import distributed

    distributed.per_rank(cfg.gradient_accumulation_steps, n)  # refused before any process waits for another
    return distributed.process_group(cfg.device)


STOP_CODES = {None: 0, "SIGINT": 1, "SIGTERM": 2}  # all-reduced with max: a signal to any rank stops them all


# --- the loop ---


def train(plan: RunPlan, display: Display | None = None, world=None) -> TrainResult:
    """Train (or resume) the planned run. The display gets typed events; nothing here prints. Under torchrun
    every process calls this, in `processes(plan.train)` (world) or else joining the process group for the
    call; rank 0 writes the run folder."""
    if world is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        with processes(plan.train) as world:
            return train(plan, display, world)
    if world:
        from nanogpt_cli import distributed as dist

        if plan.train.max_time is not None:
            raise NanoGPTError("--max-time runs in one process only: under torchrun each rank's clock would set its "
                               "own learning rate; use --max-iters")
        dist.barrier()  # every rank has planned (looked at the run folder) before rank 0 changes it
    main = world is None or world.main
    show = display or NoDisplay()
    model_cfg, cfg, run_dir = plan.model, plan.train, plan.run_dir
    device = world.device if world else resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 matmuls on Ampere and newer
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(cfg.seed)
    show.on_status("loading the data")
    batches = Batches(Path(cfg.data_dir), cfg.data, model_cfg.block_size, cfg.batch_size, device, cfg.seed)
    # under torchrun each rank evaluates a share of the fixed batches, and the losses are summed over ranks
    share, counted = dist.eval_share(cfg.eval_iters, world) if world else (None, cfg.eval_iters)
    eval_sets = {s: batches.fixed_batches(s, cfg.eval_iters, cfg.seed + 1 + i, share)
                 for i, s in enumerate(("train", "val"))}

    show.on_status("building the model")
    model = GPT(model_cfg)
    if plan.init_weights is not None:
        ckpt.load_weights(model, plan.init_weights)
    elif plan.init_model is not None:
        model.load_state_dict(plan.init_model.state_dict())  # copies in place: a tied head stays tied
    saved = run_dir.restore() if plan.resume else None
    if saved:
        ckpt.load_weights(model, saved.weights)  # on every rank, before DDP or FSDP takes the model over
    model.to(device)
    tokens_per_iter = cfg.batch_size * cfg.gradient_accumulation_steps * model_cfg.block_size  # all ranks'
    flops_per_iter = model.flops_per_token() * tokens_per_iter
    params = model.num_params()
    wrapped = model
    if world:
        torch.manual_seed(cfg.seed + world.rank)  # dropout: each rank its own masks, as its own batches
        wrapped = dist.wrap(model, cfg.parallel, world, dtype)
    optimizer = make_optimizer(model, cfg, device)  # FSDP has sharded the parameters in place
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    ctx = autocast_for(device, dtype)

    if saved:
        state = saved.state
        optimizer_states, _ = ckpt.read_optimizer(saved.optimizer, optimizer)
        for part, sd in zip(ckpt.optimizer_parts(optimizer), optimizer_states):
            if world:
                dist.load_optimizer_state(wrapped, part, sd)
            else:
                part.load_state_dict(sd)
        _restore_rng(state, batches, scaler, world, cfg.seed)
        if main:
            run_dir.truncate_metrics(state.step)
    else:
        state = ckpt.TrainerState()
        if main:
            run_dir.start(plan.force)
    if main:
        run_dir.write_config({"model": model_cfg.to_dict(), "train": cfg.to_dict(), "dataset": plan.dataset})
    weights_meta = dict(tokenizer=plan.dataset["tokenizer"], dataset=plan.dataset.get("name") or cfg.data)

    compiled = torch.compile(wrapped) if cfg.compile else wrapped
    peak = peak_flops(device)
    if peak and world:
        peak *= world.size  # MFU of all the GPUs together
    show.on_start(RunStarted(step=state.step, max_iters=cfg.max_iters,
                             device=f"{world.size} x {device.type}, {cfg.parallel}" if world else str(device),
                             dtype=str(dtype).replace("torch.", ""), params=params,
                             tokens_per_iter=tokens_per_iter, run_dir=str(run_dir), resume=plan.resume,
                             model=model_cfg.to_dict(), train=cfg.to_dict()))
    # every rank draws each update's micro-batches from the one stream, and runs its own share of them
    mine = dist.micro_share(cfg.gradient_accumulation_steps, world) if world else range(cfg.gradient_accumulation_steps)
    sync = (lambda enabled: dist.gradient_sync(wrapped, enabled)) if world else None

    last: Evaluated | None = None
    end = min(cfg.max_iters, cfg.stop_at) if cfg.stop_at else cfg.max_iters
    lr = lr_at(max(state.step - 1, 0), cfg)  # the last update's rate, for the evaluation lines; the loop sets it
    elapsed_before = state.elapsed_s
    eval_s = 0.0  # time spent evaluating and saving, left out of the speed figures

    def save(val_loss: float | None, is_best: bool) -> None:
        nonlocal saved_at
        saved_at = state.step
        state.elapsed_s = elapsed_before + time.perf_counter() - t0
        _capture_rng(state, batches, scaler, world)
        if not world:
            run_dir.save(model, optimizer, state, dict(weights_meta, val_loss=val_loss), is_best)
            return
        model_state, optimizer_state = dist.full_states(wrapped, optimizer, world)  # every rank takes part
        try:
            if world.main:
                run_dir.save(model, optimizer, state, dict(weights_meta, val_loss=val_loss), is_best,
                             model_state, optimizer_state)
        finally:
            dist.barrier()  # no rank goes on (or ends) before the save is complete

    def losses_on(split: str) -> float:
        if not world:
            return estimate_loss(compiled, eval_sets[split], ctx)
        return dist.mean_loss(eval_losses(compiled, eval_sets[split], ctx), counted, cfg.eval_iters)

    def evaluate_and_save(checkpoint: bool = True) -> None:
        nonlocal last, eval_s, t_window
        t_eval = time.perf_counter()
        losses = {s: losses_on(s) for s in ("train", "val")}
        if not all(math.isfinite(v) for v in losses.values()):
            raise non_finite(state.step, run_dir)
        is_best = state.best_val_loss is None or losses["val"] < state.best_val_loss
        if is_best:
            state.best_val_loss = losses["val"]
        last = Evaluated(step=state.step, train_loss=losses["train"], val_loss=losses["val"],
                         lr=lr, tokens=state.tokens,
                         elapsed_s=round(elapsed_before + t_eval - t0, 3), best_val_loss=state.best_val_loss,
                         saved=checkpoint)
        if main:
            run_dir.append_metrics(last.record())
        if checkpoint:
            save(losses["val"], is_best)
        show.on_eval(last)
        spent = time.perf_counter() - t_eval
        eval_s += spent
        state.eval_s = spent  # --max-time keeps this much free for the final evaluation (saved with the next save)
        t_window += spent  # the next progress line reports training speed only

    def elapsed_now() -> float:
        return elapsed_before + time.perf_counter() - t0

    def time_share() -> float | None:
        """--max-time: the share of it spent, out of the time left once the final evaluation is set aside."""
        if cfg.max_time is None:
            return None
        return elapsed_now() / max(cfg.max_time - state.eval_s, 1e-9)

    saved_at = None  # the step of the last checkpoint this call wrote
    if plan.complete:  # --max-time spent (and not raised since): nothing to train
        end = state.step
    state.max_time_spent = None
    step_s = 0.0  # the last update's length: --max-time ends the run when the next would not fit

    t0 = time.perf_counter()
    t_window, step_window = t0, state.step
    first_s = 0.0
    start_step = state.step
    skipped = 0  # fp16 updates the scaler skipped since the last log line
    stopped = None
    with StopSignals(abort_on_second=world is None) as signals:
        if not plan.resume:  # the loss at init, for the record; a checkpoint of it would resume nothing
            show.on_status("first evaluation")
            evaluate_and_save(checkpoint=False)
        if cfg.compile:
            show.on_status("compiling the model (the first step takes a while)")
        model.train()
        while state.step < end:
            lr = lr_at(state.step, cfg, time_share())
            set_lr(optimizer, lr, state.step, cfg)
            starts = [batches.draw("train") for _ in range(cfg.gradient_accumulation_steps)]
            micro = [batches.load("train", starts[i]) for i in mine]
            t_step = time.perf_counter()
            scale = scaler.get_scale() if scaler.is_enabled() else None  # fp16 only: a sync per step
            loss = optimizer_step(compiled, optimizer, micro, ctx, scaler, cfg.grad_clip, sync)
            if scale is not None and scaler.get_scale() < scale:  # the scaler backs off only when it skips
                skipped += 1
            step_s = time.perf_counter() - t_step
            if state.step == start_step:  # the first step warms up (and with --compile, compiles): not speed
                first_s = step_s
            state.step += 1
            state.tokens += tokens_per_iter
            due = state.step % cfg.eval_interval == 0 or state.step == cfg.max_iters
            # --max-time: end now if another update and the final evaluation (after the one due now) would not fit
            out_of_time = cfg.max_time is not None and state.step < cfg.max_iters and \
                elapsed_now() + step_s + state.eval_s * (2 if due else 1) >= cfg.max_time
            if state.step % cfg.log_interval == 0 or state.step == end or out_of_time:
                loss_value = (dist.mean_all(loss, world) if world else loss).item()
                if not math.isfinite(loss_value):
                    raise non_finite(state.step, run_dir)
                now = time.perf_counter()
                dt = (now - t_window) / max(1, state.step - step_window)
                t_window, step_window = now, state.step
                logged = StepLogged(step=state.step, loss=loss_value, lr=lr, tokens=state.tokens,
                                    elapsed_s=elapsed_before + now - t0, ms_per_iter=dt * 1000,
                                    tokens_per_s=tokens_per_iter / dt, mfu=flops_per_iter / dt / peak if peak else None,
                                    skipped=skipped, scale=scaler.get_scale() if scaler.is_enabled() else None,
                                    recorded=state.step % cfg.log_interval == 0 or state.step == cfg.max_iters
                                    or out_of_time)
                if main and logged.recorded:  # one writer, rank 0
                    run_dir.append_metrics(logged.record())
                show.on_step(logged)
                skipped = 0
            if out_of_time:
                state.max_time_spent = cfg.max_time  # saved with the final checkpoint: a resume trains no more
            if due or out_of_time:
                evaluate_and_save()
            received = signals.received
            if world:  # once per step, so that every rank stops after the same one
                received = {code: name for name, code in STOP_CODES.items()}[
                    dist.max_int(STOP_CODES[received], world)]
            if received or out_of_time:
                stopped = received or "max_time"
                break
        if not stopped and state.step == end and end < cfg.max_iters and not plan.complete:
            stopped = "stop_at"
        if stopped and saved_at != state.step:
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


def _capture_rng(state: ckpt.TrainerState, batches: Batches, scaler, world=None) -> None:
    state.rng_torch = torch.get_rng_state()
    state.rng_batches = batches.generator.get_state()
    state.rng_cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    state.scaler = scaler.state_dict() if scaler.is_enabled() else None
    state.rng_ranks = None
    if world:  # every rank's dropout generators (rank 0's are also the ones above)
        from nanogpt_cli import distributed as dist

        mine = {"cpu": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state(batches.device) if batches.device.type == "cuda" else None}
        state.rng_ranks = dist.gather_objects(mine, world)


def _restore_rng(state: ckpt.TrainerState, batches: Batches, scaler, world=None, seed: int = 0) -> None:
    batches.generator.set_state(state.rng_batches)
    if state.scaler and scaler.is_enabled():
        scaler.load_state_dict(state.scaler)
    ranks = state.rng_ranks or []
    if world and len(ranks) == world.size:  # as many processes as were saved: each continues its own dropout
        torch.set_rng_state(ranks[world.rank]["cpu"])
        if ranks[world.rank]["cuda"] is not None and batches.device.type == "cuda":
            torch.cuda.set_rng_state(ranks[world.rank]["cuda"], batches.device)
    elif world and world.rank > 0:  # another world size: dropout cannot continue as it was anyway
        torch.manual_seed(seed + world.rank + state.step)
    else:
        torch.set_rng_state(state.rng_torch)
        if state.rng_cuda and torch.cuda.is_available():  # as many GPUs as this machine has of those saved
            for i, s in enumerate(state.rng_cuda[:torch.cuda.device_count()]):
                torch.cuda.set_rng_state(s, i)
