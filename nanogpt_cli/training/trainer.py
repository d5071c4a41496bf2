"""Training: one loop for every world size and every loss, over random windows of a prepared dataset, with
exact resume.

    result = Trainer(plan_run(RunRequest({"preset": "cpu-char", "data": "shk"}, out=Path("checkpoints/shk")))).fit()
    Trainer(plan, loss=masked_loss, trainable=lora_parameters).fit()   # fine-tuning reuses the same loop

Reproducibility: the training batches come from their own seeded generator, dropout from torch's global
RNG, and evaluation from fixed batches drawn with a separate seed; the run folder keeps every generator's
state, so a run stopped and resumed gives the same losses as one that was not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nanogpt_cli.data.batches import Batches
from nanogpt_cli.data.chat import checkpoint_template
from nanogpt_cli.device import (
    autocast_for,
    enable_tf32,
    keep_freed_memory,
    peak_flops,
    release_freed_memory,
    resolve_device,
    resolve_dtype,
)
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.lora import hold_frozen
from nanogpt_cli.model import GPT
from nanogpt_cli.runs.checkpoint import TrainerState, load_weights
from nanogpt_cli.runs.rundir import RunDir, SavePoint, Saver
from nanogpt_cli.training.clock import EVAL_SHARE, Clock, busy_hint, cpu_cores, load_average, thread_tuner
from nanogpt_cli.training.distributed import World, eval_prefix, launched_size
from nanogpt_cli.training.events import (
    Display,
    EvalProgress,
    Evaluated,
    NoDisplay,
    RunStarted,
    StepLogged,
    TrainResult,
)
from nanogpt_cli.training.optim import lr_at, make_optimizer, set_lr
from nanogpt_cli.training.plan import RunPlan
from nanogpt_cli.training.signals import Interrupted, StopSignals

# (model, x, y) -> mean loss, a scalar. A loss with reads_teacher = True gets the train split's y as a Taught
# (the targets with the teacher's labels that prepare --teacher wrote; data/batches.py)
LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
Trainable = Callable[[GPT], Iterable[nn.Parameter]]  # the parameters to train; every other one is frozen


def next_token_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Pre-training's loss: the mean cross-entropy of each next token (nats/token), as the model computes it."""
    _, loss = model(x, y, keep_logits=False)  # the logits unkept: a frozen head's loss is computed in chunks
    return loss


@torch.no_grad()
def eval_losses(
    model: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    ctx,
    loss_fn: LossFn = next_token_loss,
    after: Callable[[], None] | None = None,
) -> torch.Tensor:
    """The mean loss of each batch. (n,) after: called after each batch (progress)."""
    was_training = model.training
    model.eval()
    losses = []
    for x, y in batches:
        with ctx:
            loss = loss_fn(model, x, y)
        losses.append(loss.float())
        if after is not None:
            after()
    model.train(was_training)
    return torch.stack(losses)


def optimizer_step(
    model, optimizer, micro_batches, ctx, scaler, grad_clip: float, sync=None, loss_fn: LossFn = next_token_loss
) -> torch.Tensor:
    """One update from a list of (x, y) micro-batches (gradient accumulation); returns their mean loss. Under
    torchrun they are this rank's share, and sync(enabled) skips the gradient reduction on all but the last."""
    total = torch.zeros((), device=micro_batches[0][0].device)
    for i, (x, y) in enumerate(micro_batches):
        with sync(i == len(micro_batches) - 1) if sync else contextlib.nullcontext():
            with ctx:
                loss = loss_fn(model, x, y)
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


def scale_tensor(scaler: torch.amp.GradScaler, device: torch.device) -> torch.Tensor:
    """The fp16 loss scale as a tensor on the device, read without waiting for it (get_scale() syncs)."""
    scale = scaler._get_scale_async()  # None until the first scale(): the initial (or restored) value then
    return scale.clone() if scale is not None else torch.tensor(scaler.get_scale(), device=device)


EVAL_QUIET_S = 3.0  # an evaluation reports its progress (on_eval_progress) once it has taken this long
STOP_CODES = {None: 0, "SIGINT": 1, "SIGTERM": 2}  # reduced with max: a signal to any rank stops them all


def non_finite(step: int, run_dir: RunDir) -> NanoGPTError:
    kept = (
        f"the last good checkpoint in {run_dir} is kept"
        if run_dir.last_path.is_file()
        else "no checkpoint had been saved yet"
    )
    return NanoGPTError(
        f"the loss became non-finite at step {step}; {kept}; try a lower --learning-rate or --dtype float32"
    )


# --- the trainer ---


@dataclass
class TrainerParts:
    """What a run trains with, built once before the loop (Trainer._setup) and read by it."""

    batches: Batches  # the training stream (and its generator, saved with the run)
    eval_sets: dict[str, list[tuple[torch.Tensor, torch.Tensor]]]  # each split's fixed batches, this rank's share
    eval_counted: int  # the evaluation batches that count, over all ranks
    model: GPT  # the module itself: what is saved, and whose parameters the optimizer holds
    wrapped: nn.Module  # the model under DDP or FSDP (the model itself in one process)
    compiled: nn.Module  # what the loop runs: `wrapped`, or its torch.compile with --compile
    optimizer: Any  # a torch optimizer, or Optimizers (Muon and AdamW)
    scaler: torch.amp.GradScaler  # fp16's loss scaling; disabled in other precisions
    ctx: Any  # the autocast context every forward runs in
    state: TrainerState  # what a save writes and a resume reads back: step, tokens, best loss, generators
    weights_meta: dict[str, Any]  # the weights files' metadata: tokenizer, dataset, chat template, LoRA
    tokens_per_iter: int  # the tokens of one update, over all ranks
    flops_per_token: float  # the model's training FLOPs per token (MFU)
    peak: float | None  # the devices' peak FLOP/s together (None: unknown, no MFU)
    masked: bool  # a chat dataset: the speed counts the targets trained on, not every token read
    start_step: int  # the step this invocation starts at
    end: int  # the step it stops at: --max-iters, --stop-at, or the start when the run is complete
    signals: StopSignals  # Ctrl-C and SIGTERM, noted for the loop
    saver: Saver  # writes the checkpoints (in the background unless --sync-save)
    clock: Clock  # wall time, --max-time's budget and the steady step time


class Trainer:
    """Trains (or resumes) a planned run in a world of one process or many. `loss` scores a batch and `trainable`
    picks the parameters the optimizer updates: pre-training takes the defaults (next-token cross-entropy,
    every parameter); fine-tuning passes its own (a masked loss; adapters only) and reuses the loop. The display
    gets typed events; nothing here prints. Rank 0 writes the run folder."""

    def __init__(
        self,
        plan: RunPlan,
        display: Display | None = None,
        world: World | None = None,
        loss: LossFn = next_token_loss,
        trainable: Trainable | None = None,
    ):
        if world is None:
            if launched_size() > 1:
                raise NanoGPTError(
                    "under torchrun every process trains in the process group: open it with "
                    "`with distributed.open_world(plan.train) as world:` and pass world=world"
                )
            world = World(resolve_device(plan.train.device))
        self.plan, self.cfg, self.run_dir, self.world = plan, plan.train, plan.run_dir, world
        self.show = display or NoDisplay()
        self.loss_fn, self.trainable = loss, trainable
        self.last: Evaluated | None = None  # the latest evaluation
        self.saved_at: int | None = None  # the step of the last checkpoint this call wrote
        self.unsaid: Evaluated | None = None  # an evaluation whose checkpoint is still being written: shown after
        self.stopped: str | None = None
        self.skipped = 0  # fp16 updates the scaler skipped since the last progress line
        self.hinted = False  # the busy-machine hint is given once
        self.trained_total = 0.0  # the targets trained on in this invocation (a chat dataset)
        # says the CPU threads, adapts them (None: stay); a resume keeps the count the run last trained with
        self.tuner = thread_tuner(world.device, world.size, plan.threads if plan.resume else None)

    def fit(self) -> TrainResult:
        """Train to the end (or a stop). A signal while the run is being set up raises Interrupted (nothing of
        this invocation is saved then); a second Ctrl-C, KeyboardInterrupt, once the save being written is."""
        # Ctrl-C and SIGTERM from the start: loading a large dataset or model is dropped at once
        with (
            StopSignals(abort_on_second=self.world.size == 1, abandon=self.world.size == 1) as self.signals,
            self._owning_the_run_dir(),
        ):
            self.parts = self._setup()
            step = self.parts.state.step
            self.lr = lr_at(max(step - 1, 0), self.cfg)  # the last update's rate, for evaluation lines
            self.logged_step = step
            # the targets trained on since the last progress line (a chat dataset), counted on the device
            self.trained = torch.zeros((), dtype=torch.int64, device=self.world.device)
            self.watch_load()  # busy before the first step already
            self._loop()
        return self._result()

    @contextlib.contextmanager
    def _owning_the_run_dir(self):
        """Rank 0 owns the run folder while it trains: `runs` says "running", another start there is refused;
        taken once every rank has planned, as each one checks that no process owns it."""
        self.world.barrier()
        with self.run_dir.hold() if self.world.main else contextlib.nullcontext():
            yield

    # --- the loop ---

    def _loop(self) -> None:
        cfg, p = self.cfg, self.parts
        state = p.state
        with p.saver:  # leaving it waits for the save being written, on every way out
            self.stopped = self.stop_requested()  # a signal while the run folder was being written
            if not self.stopped:
                self.bound_evaluations()
            if not self.stopped and not self.plan.resume and cfg.eval_first:
                self.show.on_status("first evaluation")  # the loss at init; a checkpoint of it would resume nothing
                self.evaluate(checkpoint=False)
            elif not self.stopped and self.evaluation_missed():  # a stop dropped it: done now, as it would have been
                self.evaluate()
            if cfg.compile and not self.stopped:
                self.show.on_status("compiling the model (the first step takes a while)")
            p.model.train()
            while state.step < p.end and not self.stopped:
                loss = self.train_step()
                self.watch_load()
                self.say_saved()
                due = state.step % cfg.eval_interval == 0 or state.step == cfg.max_iters
                out_of_time = state.step < cfg.max_iters and p.clock.out_of_time(due)
                if state.step % cfg.log_interval == 0 or state.step == p.end or out_of_time:
                    self.log(
                        loss, recorded=state.step % cfg.log_interval == 0 or state.step == cfg.max_iters or out_of_time
                    )
                if out_of_time:
                    state.max_time_spent = cfg.max_time  # saved with the final checkpoint: a resume trains no more
                if due or out_of_time:
                    self.evaluate()
                    if self.stopped:  # a signal dropped the evaluation: the step is saved without it
                        break
                every = self.world.stop_check_every or cfg.log_interval
                received = self.stop_requested() if state.step % every == 0 or due or state.step == p.end else None
                if received or out_of_time:
                    self.stopped = received or "max_time"
                    break
            if not self.stopped and state.step == p.end < cfg.max_iters and not self.plan.complete:
                self.stopped = "stop_at"
            # a stop saves the steps trained since the last save; none trained: the run folder holds them already
            final = self.stopped and self.saved_at != state.step and state.step > p.start_step
            ended = time.perf_counter()
            if final:
                if self.stopped in STOP_CODES:
                    self.show.on_status(f"{self.stopped}: saving step {state.step:,}")
                self.save(self.last.val_loss if self.last else None, is_best=False)
            waiting = time.perf_counter()
            self.say_saved(wait=True)
            p.saver.wait()  # the end of a run, stopped or not, is a complete save on disk
            p.clock.saved(waiting)
            p.clock.ended(ended)
            if final:
                self.show.on_save(state.step)

    def train_step(self) -> torch.Tensor:
        """One optimizer update at the scheduled learning rate; returns its mean loss (a tensor: no sync)."""
        cfg, p = self.cfg, self.parts
        state, scaler = p.state, p.scaler
        self.lr = lr_at(state.step, cfg, p.clock.share())
        set_lr(p.optimizer, self.lr, state.step, cfg)
        # every rank draws each update's micro-batches from the one stream, and runs its own share of them
        starts = [p.batches.draw("train") for _ in range(cfg.gradient_accumulation_steps)]
        micro = [p.batches.load("train", starts[i]) for i in self.world.micro_share(len(starts))]
        if p.masked:  # a chat dataset: speed counts the targets trained on (counted on the device, read at logs)
            self.trained = self.trained + sum((getattr(y, "targets", y) != -1).sum() for _, y in micro)
        started = time.perf_counter()
        # fp16: the scaler backs off only when it skips an update; compared on the device, read at the next log
        scale = scale_tensor(scaler, self.world.device) if scaler.is_enabled() else None
        loss = optimizer_step(
            p.compiled,
            p.optimizer,
            micro,
            p.ctx,
            scaler,
            cfg.grad_clip,
            lambda enabled: self.world.gradient_sync(p.wrapped, enabled),
            self.loss_fn,
        )
        if scale is not None:
            self.skipped = self.skipped + (scale_tensor(scaler, self.world.device) < scale).int()
        p.clock.stepped(started, first=state.step == p.start_step)  # the first step warms up: not speed
        state.step += 1
        state.tokens += p.tokens_per_iter
        return loss

    def log(self, loss: torch.Tensor, recorded: bool) -> None:
        """A progress line (and, when recorded, a metrics line): the loss averaged over ranks, and the speed."""
        p = self.parts
        state, scaler = p.state, p.scaler
        value = self.world.mean(loss).item()
        if not math.isfinite(value):
            raise non_finite(state.step, self.run_dir)
        updates = max(1, state.step - self.logged_step)
        self.logged_step = state.step
        dt, elapsed = p.clock.window(state.step)
        per_iter = p.tokens_per_iter if not p.masked else self._take_trained() / updates
        logged = StepLogged(
            step=state.step,
            loss=value,
            lr=self.lr,
            tokens=state.tokens,
            elapsed_s=elapsed,
            ms_per_iter=dt * 1000,
            tokens_per_s=per_iter / dt,
            mfu=p.flops_per_token * per_iter / dt / p.peak if p.peak else None,
            skipped=int(self.skipped),
            scale=scaler.get_scale() if scaler.is_enabled() else None,
            recorded=recorded,
        )
        if self.world.main and logged.recorded:  # one writer, rank 0
            self.run_dir.append_metrics(logged.record())
        self.show.on_step(logged)
        self.skipped = 0

    def watch_load(self) -> None:
        """On the CPU, after each update: the thread count follows the load (clock.ThreadTuner, which says when
        it changes it), and one hint (once) when the machine is busy and fewer threads cannot help: busy_hint."""
        if self.world.device.type != "cpu":
            return
        said = self.tuner.watch(self.parts.clock.steps) if self.tuner is not None else None
        if said:
            self.show.on_hint(said)
        if self.hinted or (self.tuner is not None and not self.tuner.fixed and self.tuner.threads > 1):
            return
        hint = busy_hint(self.parts.clock.steps, load_average(), cpu_cores(), torch.get_num_threads())
        if hint is not None:
            self.hinted = True
            self.show.on_hint(hint)

    def _take_trained(self) -> float:
        """The targets trained on (mask 1) since the last call, summed over ranks; the count starts again."""
        trained = (self.world.mean(self.trained.double()) * self.world.size).item()
        self.trained_total += trained
        self.trained = torch.zeros((), dtype=torch.int64, device=self.world.device)
        return trained

    def evaluate(self, checkpoint: bool = True) -> None:
        """Both splits' loss on the fixed evaluation batches, a metrics line, and (unless told not to) a save."""
        cfg, p = self.cfg, self.parts
        state = p.state
        started = time.perf_counter()
        scored, total = [0], sum(len(p.eval_sets[s]) for s in ("train", "val"))

        def progress() -> None:
            scored[0] += 1
            elapsed = time.perf_counter() - started
            if elapsed >= EVAL_QUIET_S:
                self.show.on_eval_progress(EvalProgress(state.step, scored[0], total, elapsed))

        try:
            with self.signals.interruptible():  # a signal drops the evaluation: it only reads the weights
                losses = {
                    s: self.world.mean_loss(
                        eval_losses(p.compiled, p.eval_sets[s], p.ctx, self.loss_fn, progress),
                        p.eval_counted,
                        min(state.eval_batches or cfg.eval_iters, cfg.eval_iters),
                    )
                    for s in ("train", "val")
                }
        except Interrupted as stop:
            self.stopped = stop.signal
            p.compiled.train()
            p.clock.set_aside(started)
            return
        if not all(math.isfinite(v) for v in losses.values()):
            raise non_finite(state.step, self.run_dir)
        is_best = state.best_val_loss is None or losses["val"] < state.best_val_loss
        if is_best:
            state.best_val_loss = losses["val"]
        self.last = Evaluated(
            step=state.step,
            train_loss=losses["train"],
            val_loss=losses["val"],
            lr=self.lr,
            tokens=state.tokens,
            elapsed_s=round(p.clock.elapsed(started), 3),
            best_val_loss=state.best_val_loss,
            saved=checkpoint,
        )
        if self.world.main:
            self.run_dir.append_metrics(self.last.record())
        if checkpoint:
            try:
                self.save(losses["val"], is_best)
            except BaseException:
                self.show.on_eval(dataclasses.replace(self.last, saved=False))
                raise
            self.unsaid = self.last  # said once its files are on disk
            self.say_saved()
        else:
            self.show.on_eval(self.last)
        p.clock.set_aside(started)

    def bound_evaluations(self) -> None:
        """--max-time with no --eval-iters given (plan.eval_limit_s): an evaluation of both splits takes at most
        EVAL_SHARE of the time. Before the first one, one val batch is timed (uncompiled, warm-up included: it errs
        short) and the splits keep as many batches as fit, at least one; every later evaluation, a resumed run's
        too, scores the same ones (state.eval_batches), so their losses compare."""
        cfg, p = self.cfg, self.parts
        state = p.state
        if state.eval_batches is None and self.plan.eval_limit_s is not None:
            started = time.perf_counter()
            try:
                with self.signals.interruptible():  # not compiled (--compile's first call compiles); read: synced
                    eval_losses(p.wrapped, p.eval_sets["val"][:1], p.ctx, self.loss_fn).sum().item()
            except Interrupted as stop:
                self.stopped = stop.signal
                return
            finally:
                p.wrapped.train()
                p.clock.set_aside(started, evaluation=False)
            batch_s = p.clock.agree([time.perf_counter() - started])[0]  # rank 0's: every rank keeps as many
            fits = int(self.plan.eval_limit_s / (2 * batch_s))
            state.eval_batches = max(1, min(cfg.eval_iters, fits))
            if state.eval_batches < cfg.eval_iters:
                self.show.on_hint(
                    f"evaluations of {state.eval_batches:,} batch{'es' if state.eval_batches > 1 else ''} a split, "
                    f"not {cfg.eval_iters:,}: one took {batch_s:,.1f} s, and --max-time {cfg.max_time:g} keeps an "
                    f"evaluation to {self.plan.eval_limit_s:,.1f} s ({EVAL_SHARE:.0%}); give --eval-iters to choose"
                )
        if state.eval_batches is None or state.eval_batches >= cfg.eval_iters:
            return
        # the first eval_batches of the fixed batches (each split's are drawn in order: the same ones), this rank's
        # share of them
        shortened = {s: eval_prefix(b, state.eval_batches, self.world) for s, b in p.eval_sets.items()}
        p.eval_sets = {s: b for s, (b, _) in shortened.items()}
        p.eval_counted = shortened["val"][1]
        p.clock.eval_steps = self._eval_steps(p.eval_sets)

    def evaluation_missed(self) -> bool:
        """Whether a resumed run's step was due an evaluation that a signal dropped (the metrics have none at it):
        the run then evaluates (and saves) it first, so its metrics are those of a run that was never stopped."""
        cfg, step = self.cfg, self.parts.state.step
        if self.world.size > 1:  # under torchrun no rank drops an evaluation (StopSignals.abandon)
            return False
        if not self.plan.resume or step == 0 or (step % cfg.eval_interval and step != cfg.max_iters):
            return False
        records, _ = self.run_dir.read_metrics()
        return not any(r.get("kind", "eval") == "eval" and r.get("step") == step for r in records)

    def stop_requested(self) -> str | None:
        """A signal any rank received ("SIGINT", "SIGTERM"), agreed by all once per step, or None."""
        code = self.world.max_int(STOP_CODES[self.signals.received])
        return {code: name for name, code in STOP_CODES.items()}[code]

    def say_saved(self, wait: bool = False) -> None:
        """The line of an evaluation whose checkpoint was being written, once it is on disk ("checkpoint saved"
        is said of files that are there); at once with wait=True. A write that failed is raised here, after the
        line, which then says nothing of a save."""
        if self.unsaid is None or (self.parts.saver.busy() and not wait):
            return
        evaluated, self.unsaid = self.unsaid, None
        try:
            self.parts.saver.wait()
        except BaseException:
            self.show.on_eval(dataclasses.replace(evaluated, saved=False))
            raise
        self.show.on_eval(evaluated)

    def save(self, val_loss: float | None, is_best: bool) -> None:
        p = self.parts
        state, clock = p.state, p.clock
        self.say_saved(wait=True)  # the previous save's line first (the new save waits for it anyway)
        self.saved_at = state.step
        state.threads = torch.get_num_threads() if self.world.device.type == "cpu" else None
        state.elapsed_s = clock.elapsed()
        state.eval_s = clock.last_eval_s  # --max-time keeps this much free for the final evaluation
        timed, train_s, _ = clock.training_time(state.step - p.start_step)
        state.speed = dataclasses.asdict(clock.speed(train_s / timed * 1000 if timed else 0.0))
        self._capture_rng()
        # the run's last save is waited for anyway: written on this thread, it needs no copy of the state
        last = self.stopped is not None or state.step >= p.end or state.max_time_spent is not None
        started = time.perf_counter()
        try:  # the loop stalls for the wait on the previous save, the gather and the host copy, not the write
            p.saver.save(
                p.model,
                p.optimizer,
                state,
                dict(p.weights_meta, val_loss=val_loss),
                is_best,
                lambda: self.world.full_states(p.wrapped, p.optimizer),  # every rank takes part
                background=not last,
            )
        finally:
            self.world.barrier()  # no rank goes on before rank 0 holds the save
            clock.saved(started)

    # --- before the loop ---

    def _setup(self) -> TrainerParts:
        """Everything the loop reads, built in this order: the device, the data, the model with its starting (or
        saved) weights, its optimizer and precision, the resumed state, the run folder's config, the clock."""
        plan, cfg, world = self.plan, self.cfg, self.world
        world.barrier()  # every rank has planned (looked at the run folder) before rank 0 changes it
        dtype = self._prepare_device()
        with self.signals.interruptible():  # reading and building only: a signal drops them at once
            self.show.on_status("loading the data")
            # windows of --seq-len tokens (default: the model's context); evaluation reads the same
            batches = Batches(
                Path(cfg.data_dir), cfg.data, plan.seq_len, cfg.batch_size, world.device, cfg.seed, cfg.loss_mask,
                plan.length_flag, teacher=getattr(self.loss_fn, "reads_teacher", False),
            )  # fmt: skip
            eval_sets, eval_counted = self._eval_sets(batches)
            self.show.on_status("building the model")
            saved = self.run_dir.restore() if plan.resume else None
            model = self._build_model(saved)
            params, flops_per_token = model.num_params(), model.flops_per_token(plan.seq_len)  # before FSDP shards it
            total = sum(q.numel() for q in model.parameters())
            trainable = sum(q.numel() for q in model.parameters() if q.requires_grad) if self.trainable else None
            if dtype != torch.float32 and not (world.size > 1 and cfg.parallel == "fsdp"):  # FSDP shards one dtype
                hold_frozen(model, dtype)  # a LoRA run's frozen base as autocast would cast it each step, once
            world.seed_dropout(cfg.seed)
            wrapped = world.wrap(model, cfg.parallel, dtype)
            if world.device.type == "cpu":
                release_freed_memory()  # the copies that building the model freed, which keep_freed_memory would keep
            optimizer = make_optimizer(model, cfg, world.device)  # FSDP has sharded the parameters in place
            scaler = torch.amp.GradScaler(world.device.type, enabled=dtype == torch.float16)
            ctx = autocast_for(world.device, dtype)
            state = self._restore(saved, batches, wrapped, optimizer, scaler) if saved else TrainerState()
        if world.main:
            self._write_config(state, fresh=not saved)
        compiled = torch.compile(wrapped) if cfg.compile else wrapped
        peak = peak_flops(world.device, dtype)
        tokens_per_iter = cfg.batch_size * cfg.gradient_accumulation_steps * plan.seq_len  # all ranks'
        self.show.on_start(
            RunStarted(
                step=state.step,
                max_iters=cfg.max_iters,
                device=world.describe(cfg.parallel),
                dtype=str(dtype).replace("torch.", ""),
                params=params,
                tokens_per_iter=tokens_per_iter,
                run_dir=str(self.run_dir),
                resume=plan.resume,
                model=plan.model.to_dict(),
                train=cfg.to_dict(),
                finetune=plan.finetune,
                trainable=trainable,
                total=total,
            )
        )
        end = min(cfg.max_iters, cfg.stop_at) if cfg.stop_at else cfg.max_iters
        if plan.complete:  # --max-time spent (and not raised since): nothing to train
            end = state.step
        clock = self._clock(state, eval_sets)
        state.max_time_spent = None
        return TrainerParts(
            batches=batches,
            eval_sets=eval_sets,
            eval_counted=eval_counted,
            model=model,
            wrapped=wrapped,
            compiled=compiled,
            optimizer=optimizer,
            scaler=scaler,
            ctx=ctx,
            state=state,
            weights_meta=self._weights_meta(),
            tokens_per_iter=tokens_per_iter,
            flops_per_token=flops_per_token,
            peak=peak * world.size if peak else peak,  # MFU of all the GPUs together
            # a chat dataset: tokens/s and MFU count the targets trained on (mask 1, not padding), not every token
            masked=batches.masks["train"] is not None or batches.packed["train"] is not None,
            start_step=state.step,
            end=end,
            signals=self.signals,
            saver=Saver(self.run_dir, background=not cfg.sync_save, writes=world.main),
            clock=clock,
        )

    def _prepare_device(self) -> torch.dtype:
        """The training precision; the device's settings for training, and the seed of the model's init."""
        device = self.world.device
        if device.type == "cuda":
            enable_tf32()
        elif device.type == "cpu":
            keep_freed_memory()  # activations come from freed memory, not fresh pages, every update
        torch.manual_seed(self.cfg.seed)
        # a CPU's auto: by the size of a micro-batch
        return resolve_dtype(self.cfg.dtype, device, self.plan.model, self.cfg.batch_size, self.plan.seq_len)

    def _eval_sets(self, batches: Batches) -> tuple[dict[str, list[tuple[torch.Tensor, torch.Tensor]]], int]:
        """Each split's fixed evaluation batches, this rank's share (the losses are summed over ranks), and how
        many count over all ranks."""
        cfg = self.cfg
        share, counted = self.world.eval_share(cfg.eval_iters)
        sets = {
            s: batches.fixed_batches(s, cfg.eval_iters, cfg.seed + 1 + i, share) for i, s in enumerate(("train", "val"))
        }
        return sets, counted

    def _build_model(self, saved: SavePoint | None) -> GPT:
        """The model on its device with its starting weights, and only the trainable parameters unfrozen."""
        if self.plan.init_model_used:  # its weights are gone: the model would start at random
            raise NanoGPTError("this plan's starting weights were used by a run already; plan it again")
        model = GPT(self.plan.model)
        if self.plan.init_weights is not None:
            load_weights(model, self.plan.init_weights)
        elif self.plan.init_model is not None:
            model.load_state_dict(self.plan.init_model.state_dict())  # copies in place: a tied head stays tied
            self.plan.init_model = None  # the planning copy, let go: kept, the run would hold the weights twice
            self.plan.init_model_used = True
        if self.trainable is not None:  # it may add modules (adapters): before the saved weights and the move
            keep = {id(p) for p in self.trainable(model)}
            for p in model.parameters():
                p.requires_grad_(id(p) in keep)
        if saved:
            saved.load_weights(model)  # on every rank, before DDP or FSDP takes the model over
        return model.to(self.world.device)

    def _restore(self, saved: SavePoint, batches: Batches, wrapped: nn.Module, optimizer, scaler) -> TrainerState:
        """A resumed run's optimizer, generators and grad scaler, as they were at its last save."""
        state, world = saved.state, self.world
        # the saved state brings its hyperparameters along: a resume that changes one keeps the new value
        fresh = [{k: g[k] for k in ("weight_decay", "betas", "lr_scale") if k in g} for g in optimizer.param_groups]
        saved.load_optimizer(optimizer, lambda part, sd: world.load_optimizer_state(wrapped, part, sd))
        for group, values in zip(optimizer.param_groups, fresh, strict=True):
            group.update(values)
        batches.generator.set_state(state.rng_batches)
        if state.scaler and scaler.is_enabled():
            scaler.load_state_dict(state.scaler)
        ranks, device = state.rng_ranks or [], batches.device
        if len(ranks) == world.size > 1:  # as many processes as were saved: each continues its own dropout
            torch.set_rng_state(ranks[world.rank]["cpu"])
            if ranks[world.rank]["cuda"] is not None and device.type == "cuda":
                torch.cuda.set_rng_state(ranks[world.rank]["cuda"], device)
        elif world.rank > 0:  # another world size: dropout cannot continue as it was anyway
            torch.manual_seed(self.cfg.seed + world.rank + state.step)
        else:
            torch.set_rng_state(state.rng_torch)
            if state.rng_cuda and torch.cuda.is_available():  # as many GPUs as this machine has of those saved
                for i, s in enumerate(state.rng_cuda[: torch.cuda.device_count()]):
                    torch.cuda.set_rng_state(s, i)
        if world.main:
            self.run_dir.truncate_metrics(state.step)
        return state

    def _write_config(self, state: TrainerState, fresh: bool) -> None:
        """Rank 0 starts the run folder (a fresh run) and writes its config, with what a resume changed."""
        plan = self.plan
        if fresh:
            self.run_dir.start(plan.force)
        changed = None
        if plan.changes:  # the run's history: what this resume changed, from which step
            changed = {
                "step": state.step,
                "changes": [c.record() for c in plan.changes],
                "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            }
        config = {"model": plan.model.to_dict(), "train": self.cfg.to_dict(), "dataset": plan.dataset}
        if plan.init_from:  # a resume given the same --init-from checks it against this
            config["init_from"] = plan.init_from
        if plan.finetune:
            config["finetune"] = plan.finetune
        if plan.hf_family:
            config["hf_family"] = plan.hf_family
        if plan.auto is not None:  # which values --preset auto chose (the report marks them)
            config["auto"] = plan.auto.record()
        elif plan.resume and "auto" in (saved := self.run_dir.read_config()):
            config["auto"] = saved["auto"]
        self.run_dir.write_config(config, changed)
        self.run_dir.keep_tokenizer(Path(self.cfg.data_dir) / self.cfg.data)

    def _weights_meta(self) -> dict[str, Any]:
        """What every weights file of the run records beside the tensors."""
        plan = self.plan
        meta = dict(tokenizer=plan.dataset["tokenizer"], dataset=plan.dataset.get("name") or self.cfg.data)
        template = checkpoint_template(plan.dataset)
        if template is not None:  # sample, serve and the exports format conversations with it
            meta["chat_template"] = template
        meta.update(plan.finetune.get("weights", {}) if plan.finetune else {})
        if plan.hf_family:  # the Hugging Face family the run started from: `export --format hf` writes it back
            meta["hf_family"] = plan.hf_family
        return meta

    def _clock(self, state: TrainerState, eval_sets: dict[str, list]) -> Clock:
        """The run's clock, from the time the saved run had spent."""
        cfg, world = self.cfg, self.world
        clock = Clock(state.elapsed_s, cfg.max_time, state.eval_s, state.step, self._eval_steps(eval_sets))
        clock.agree = world.from_main  # every rank follows rank 0's clock: one schedule, one last update
        if cfg.max_time is not None and world.device.type == "cuda":  # the clock must see the GPU's work, not its queue
            clock.sync = functools.partial(torch.cuda.synchronize, world.device)
        return clock

    def _eval_steps(self, eval_sets: dict[str, list]) -> float:
        """An evaluation's length in updates, guessed: a forward costs about a third of a forward and backward, so
        both splits' batches are 2 * eval_iters / 3 updates of one micro-batch each (this rank's share of them)."""
        return 2 * len(eval_sets["val"]) / 3 / len(self.world.micro_share(self.cfg.gradient_accumulation_steps))

    def _capture_rng(self) -> None:
        p = self.parts
        state, device = p.state, p.batches.device
        state.rng_torch = torch.get_rng_state()
        state.rng_batches = p.batches.generator.get_state()
        state.rng_cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        state.scaler = p.scaler.state_dict() if p.scaler.is_enabled() else None
        # under torchrun every rank's dropout generators (rank 0's are also the ones above); None in one process
        state.rng_ranks = self.world.gather_objects(
            {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}
        )

    def _result(self) -> TrainResult:
        p, last = self.parts, self.last
        state = p.state
        timed, train_s, elapsed = p.clock.training_time(state.step - p.start_step)
        ms_per_iter = train_s / timed * 1000 if timed else 0.0
        per_iter = p.tokens_per_iter  # tokens each update trained on
        if p.masked:
            self._take_trained()
            per_iter = self.trained_total / max(1, state.step - p.start_step)
        return TrainResult(
            run_dir=self.run_dir.path,
            step=state.step,
            tokens=state.tokens,
            train_loss=last.train_loss if last else None,
            val_loss=last.val_loss if last else None,
            eval_step=last.step if last else None,
            best_val_loss=state.best_val_loss,
            elapsed_s=elapsed,
            tokens_per_s=per_iter * timed / train_s if timed else 0.0,
            ms_per_iter=ms_per_iter,
            speed=p.clock.speed(ms_per_iter),
            mfu=(p.flops_per_token * per_iter * timed / train_s / p.peak) if p.peak and timed else None,
            stopped=self.stopped,
            trained_only=p.masked,
        )


def train(
    plan: RunPlan,
    display: Display | None = None,
    world: World | None = None,
    loss: LossFn = next_token_loss,
    trainable: Trainable | None = None,
) -> TrainResult:
    """Train (or resume) the planned run: Trainer(...).fit()."""
    return Trainer(plan, display, world, loss, trainable).fit()
