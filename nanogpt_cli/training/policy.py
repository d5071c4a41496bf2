"""What DPO and GRPO share: a fine-tuning run whose loss scores whole completions, not windows of a token stream.

    run = PolicyRun(job, settings={"beta": 0.1}, objective="dpo"); model = run.setup(); ...; run.save(metric)

It builds the model as the trainer does (the start weights, LoRA's adapters through the plan's `trainable`
hook, a resumed run's weights and optimizer), writes the run folder in the same layout (so sample, eval, export
and --resume read it as any run), and scores token sequences: sequence_logprobs gives each completion token's
log-probability under a model, the quantity both objectives are written in.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from nanogpt_cli.data.chat import checkpoint_template
from nanogpt_cli.device import resolve_device
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.lora import adapters
from nanogpt_cli.model import GPT
from nanogpt_cli.runs.checkpoint import TrainerState, load_weights
from nanogpt_cli.training.clock import thread_tuner
from nanogpt_cli.training.events import Display, NoDisplay, RunStarted, Scored, StepLogged
from nanogpt_cli.training.optim import lr_at, make_optimizer, set_lr
from nanogpt_cli.training.signals import Interrupted, StopSignals

Log = Callable[[dict[str, Any]], None]  # a metrics record: what the display shows and the run's metrics file keeps


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module):
    """The model computes its base's outputs while inside: every LoRA adapter's scale is 0, so a layer adds
    exactly 0 to the frozen projection (x + 0 == x in floating point). This is LoRA's reference model: no copy."""
    layers = list(adapters(model).values())
    scales = [layer.scaling for layer in layers]
    for layer in layers:
        layer.scaling = 0.0
    try:
        yield model
    finally:
        for layer, s in zip(layers, scales):
            layer.scaling = s


def pad_batch(seqs: Sequence[Sequence[int]], masks: Sequence[Sequence[int]], block_size: int, device):
    """Right-padded inputs, targets and target mask for sequences of token ids: x (B, T), y (B, T), m (B, T) with
    m 1 where y is a completion token. A sequence longer than the context keeps its last block_size + 1 tokens."""
    seqs = [list(s)[-(block_size + 1) :] for s in seqs]
    masks = [list(m)[-(block_size + 1) :] for m in masks]
    T = max(len(s) for s in seqs) - 1
    x = torch.zeros(len(seqs), T, dtype=torch.long)
    y = torch.zeros(len(seqs), T, dtype=torch.long)
    m = torch.zeros(len(seqs), T)
    for i, (s, k) in enumerate(zip(seqs, masks)):
        n = len(s) - 1
        x[i, :n], y[i, :n] = torch.tensor(s[:-1]), torch.tensor(s[1:])
        m[i, :n] = torch.tensor(k[1:], dtype=torch.float32)
    return x.to(device), y.to(device), m.to(device)


def sequence_logprobs(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """log p(y_t | x_<=t) for every position, in float32 (nats). (B, T)"""
    logits, _ = model(x)  # (B, T, V)
    return torch.gather(F.log_softmax(logits.float(), dim=-1), 2, y.unsqueeze(-1)).squeeze(-1)  # (B, T)


@dataclass
class Settings:
    """A DPO or GRPO run's own values, as config.json records them under finetune.settings."""

    values: dict[str, Any]

    @classmethod
    def resolve(cls, defaults: dict[str, Any], given: dict[str, Any], saved: dict[str, Any] | None) -> Settings:
        """Fresh: defaults < given. Resume: the saved values; one given again must agree (it is never replaced)."""
        unknown = set(given) - set(defaults)
        if unknown:
            raise NanoGPTError(f"unknown setting {sorted(unknown)[0]!r}; these exist: {', '.join(defaults)}")
        if saved is None:
            return cls({**defaults, **given})
        differ = [f"--{k.replace('_', '-')} (saved {saved.get(k)!r}, given {v!r})" for k, v in given.items()]
        differ = [d for d, (k, v) in zip(differ, given.items()) if saved.get(k, defaults[k]) != v]
        if differ:
            raise NanoGPTError(f"--resume continues the run as it was set; these differ from it: {', '.join(differ)}")
        return cls({**defaults, **saved})


class PolicyRun:
    """A DPO or GRPO run's model, optimizer, state and saves (see the module's docstring)."""

    def __init__(
        self,
        job,
        objective: str,
        defaults: dict[str, Any],
        given: dict[str, Any],
        log: Log | None = None,
        display: Display | None = None,
    ):
        self.job, self.plan, self.cfg = job, job.plan, job.plan.train
        self.objective = objective
        self.run_dir = self.plan.run_dir
        saved = self.plan.finetune.get("settings") if self.plan.resume else None
        if self.plan.resume and self.plan.finetune.get("objective") != objective:
            raise NanoGPTError(
                f"{self.run_dir} was fine-tuned with --method {self.plan.finetune.get('objective', 'sft')}; "
                f"resume it with that --method"
            )
        self.settings = Settings.resolve(defaults, given, saved).values
        dtype = getattr(self.cfg.dtype, "value", self.cfg.dtype)
        if dtype not in ("auto", "float32"):
            raise NanoGPTError(f"--method {objective} trains in float32; drop --dtype {dtype}")
        if self.cfg.gradient_accumulation_steps != 1:  # one micro-batch of --batch-size pairs or prompts an update
            raise NanoGPTError(
                f"--method {objective} takes one micro-batch per update; drop --gradient-accumulation-steps "
                f"{self.cfg.gradient_accumulation_steps} and set --batch-size instead"
            )
        if self.cfg.compile:
            raise NanoGPTError(f"--method {objective} runs the model uncompiled; drop --compile")
        self.plan.finetune = {**self.plan.finetune, "objective": objective, "settings": self.settings}
        self.log = log or (lambda record: None)
        self.show = display or NoDisplay()
        self.device = resolve_device(self.cfg.device)
        self.state = TrainerState()
        # Ctrl-C and SIGTERM (entered by fit): the step ends, the run saves and stops; a rollout or an evaluation
        # in progress is dropped at once
        self.signals = StopSignals()
        self.saved_at: int | None = None
        self.start_step = 0
        self.timed = _Window()  # the updates since the last progress line, evaluations and saves left out
        self.train_s = 0.0  # the time of every update of this invocation
        self.trained_tokens = 0
        self.invoked = time.perf_counter()
        # --max-time: the last update's length and the last evaluation's (with its save), kept free at the end
        self.step_s = self.eval_s = 0.0
        self.step_mark = self.invoked

    @property
    def lora(self) -> bool:
        return self.job.lora is not None

    def setup(self) -> GPT:
        """The model with its start (or resumed) weights, the optimizer, and the run folder's config written."""
        plan, cfg = self.plan, self.cfg
        torch.manual_seed(cfg.seed)
        self.show.on_status("building the model")
        with self.signals.interruptible():  # reading and building only: a signal drops them at once
            model = GPT(plan.model)
            if plan.init_weights is not None:
                load_weights(model, plan.init_weights)
            elif plan.init_model is not None:
                model.load_state_dict(plan.init_model.state_dict())
            if self.job.trainable is not None:
                keep = {id(p) for p in self.job.trainable(model)}
                for p in model.parameters():
                    p.requires_grad_(id(p) in keep)
            saved = self.run_dir.restore() if plan.resume else None
            if saved is not None:
                saved.load_weights(model)
            self.model = model.to(self.device)
            self.optimizer = make_optimizer(self.model, cfg, self.device)
            if saved is not None:
                saved.load_optimizer(self.optimizer)
        if saved is not None:
            self.state = saved.state
            self.state.max_time_spent = None  # a resume with a larger --max-time trains on; the clock says again
            if self.state.rng_torch is not None:
                torch.set_rng_state(self.state.rng_torch)
            # the threads it last trained with, kept: CPU sums differ by thread count (a given count wins, said)
            tuner = thread_tuner(self.device, 1, plan.threads) if plan.threads is not None else None
            if tuner is not None and tuner.note:
                self.show.on_hint(tuner.note)
            self.run_dir.truncate_metrics(self.state.step)
        else:
            self.run_dir.start(plan.force)
        self.write_config_again()
        self.start_step = self.state.step
        self.started = self.step_mark = time.perf_counter()
        return self.model

    def begin(self, batch: str) -> None:
        """The run's start lines (batch: what one step reads, in words), then its clock starts."""
        model = self.model
        total = sum(p.numel() for p in model.parameters())
        self.show.on_start(
            RunStarted(
                step=self.state.step,
                max_iters=self.cfg.max_iters,
                device=str(self.device),
                dtype="float32",
                params=model.num_params(),
                tokens_per_iter=0,
                run_dir=str(self.run_dir),
                resume=self.plan.resume,
                model=self.plan.model.to_dict(),
                train=self.cfg.to_dict(),
                finetune=self.plan.finetune,
                trainable=sum(p.numel() for p in model.parameters() if p.requires_grad) if self.lora else None,
                total=total,
                batch=batch,
            )
        )
        self.timed.restart(self.state.step)

    def write_config_again(self) -> None:
        """config.json with what the run has recorded so far (the base's hash, the reference's)."""
        plan = self.plan
        config = {"model": plan.model.to_dict(), "train": self.cfg.to_dict(), "dataset": plan.dataset}
        self.run_dir.write_config({**config, "finetune": plan.finetune})

    def elapsed(self) -> float:
        """Wall time of every invocation so far."""
        return self.state.elapsed_s + time.perf_counter() - self.started

    def share(self) -> float | None:
        """--max-time: the share of it spent, out of the time left once the final evaluation is set aside."""
        if self.cfg.max_time is None:
            return None
        return self.elapsed() / max(self.cfg.max_time - self.eval_s, 1e-9)

    def out_of_time(self) -> bool:
        """--max-time: whether one more update and the final evaluation (the last ones' lengths) would not fit; the
        loop then evaluates, saves and ends, and the run records the time as spent."""
        if self.cfg.max_time is None or self.elapsed() + self.step_s + self.eval_s < self.cfg.max_time:
            return False
        self.state.max_time_spent = self.cfg.max_time
        return True

    def step_lr(self) -> float:
        lr = lr_at(self.state.step, self.cfg, self.share())
        set_lr(self.optimizer, lr, self.state.step, self.cfg)
        return lr

    def update(self, loss: torch.Tensor) -> None:
        """One optimizer update from a loss that has its graph."""
        if not torch.isfinite(loss):
            raise NanoGPTError(
                f"the loss became non-finite at step {self.state.step}; try a lower --learning-rate or --beta"
            )
        loss.backward()
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1

    def record(self, kind: str, values: dict[str, Any]) -> None:
        record = {"kind": kind, "step": self.state.step, "tokens": self.state.tokens, **values}  # loss.png's x
        self.run_dir.append_metrics(record)
        self.log(record)

    def stepped(self, tokens: int) -> None:
        """An update is done: its tokens (the completions' and prompts' the loss read) count to the speed."""
        self.timed.tokens += tokens
        self.trained_tokens += tokens
        now = time.perf_counter()
        self.step_s, self.step_mark = now - self.step_mark, now

    def log_step(self, values: dict[str, float], shown: Sequence[str]) -> None:
        """A metrics line (kind "train") and a progress line: loss, lr, speed and the values named in shown."""
        self.record("train", values)
        now, steps = time.perf_counter(), max(1, self.state.step - self.timed.step)
        seconds = now - self.timed.started
        self.train_s += seconds
        self.show.on_step(
            StepLogged(
                step=self.state.step,
                loss=values["loss"],
                lr=values["lr"],
                tokens=self.state.tokens,
                elapsed_s=self.state.elapsed_s + now - self.started,
                ms_per_iter=seconds / steps * 1000,
                tokens_per_s=self.timed.tokens / seconds if seconds > 0 else 0.0,
                mfu=None,
                extra={k.replace("_", " "): values[k] for k in shown},
            )
        )
        self.timed.restart(self.state.step)

    def log_eval(self, values: dict[str, float], best: float | None, saved: bool) -> None:
        """A metrics line (kind "eval") and the display's evaluation line; the clock of updates resumes after."""
        self.record("eval", values)
        shown = {k.replace("_", " "): v for k, v in values.items()}
        self.show.on_scored(Scored(step=self.state.step, values=shown, best=best, saved=saved))

    @contextlib.contextmanager
    def untimed(self):
        """Time that is not the updates' (an evaluation and its save): left out of the speed, and kept free for the
        final one under --max-time."""
        started = time.perf_counter()
        with self.timed.pause():
            yield
        self.step_mark = time.perf_counter()
        self.eval_s = self.step_mark - started

    def scored(self, evaluate: Callable[[GPT], Any]) -> Any:
        """evaluate(model), which only reads the weights, dropped at once by a signal: its result, or None then
        (the model back in training mode)."""
        try:
            with self.signals.interruptible():
                return evaluate(self.model)
        except Interrupted:
            self.model.train()
            return None

    def ended(self, end: int) -> str | None:
        """How the loop that stopped at `end` ended: a signal ("SIGINT", "SIGTERM": the steps trained are saved
        first), the clock ("max_time"), --stop-at ("stop_at"), or None (--max-iters reached)."""
        if self.signals.received:
            self.save_on_stop()
            return self.signals.received
        if self.state.max_time_spent is not None:
            return "max_time"
        return "stop_at" if self.state.step == end < self.cfg.max_iters else None

    def save_on_stop(self) -> None:
        """After a signal: the updates since the last save, saved (none trained: the folder holds them)."""
        if self.state.step > self.start_step and self.saved_at != self.state.step:
            self.show.on_status(f"{self.signals.received}: saving step {self.state.step:,}")
            self.save(None)
            self.show.on_save(self.state.step)

    def speed(self) -> tuple[float, float, float]:
        """This invocation's wall time (s), ms per update and tokens per second of the updates."""
        steps = self.state.step - self.start_step
        ms = self.train_s / steps * 1000 if steps else 0.0
        return time.perf_counter() - self.invoked, ms, self.trained_tokens / self.train_s if self.train_s else 0.0

    def save(self, val_loss: float | None) -> None:
        """Save the run (the weights, optimizer and state, the best weights by val_loss: lower is better; None:
        not evaluated, as when a signal stops the run between evaluations)."""
        state = self.state
        self.saved_at = state.step
        is_best = val_loss is not None and (state.best_val_loss is None or val_loss < state.best_val_loss)
        if is_best:
            state.best_val_loss = val_loss
        state.elapsed_s += time.perf_counter() - self.started
        self.started = time.perf_counter()
        state.rng_torch = torch.get_rng_state()
        state.threads = torch.get_num_threads() if self.device.type == "cpu" else None  # what a resume keeps
        self.run_dir.save(self.model, self.optimizer, state, self.weights_meta(val_loss), is_best)

    def weights_meta(self, val_loss: float) -> dict[str, Any]:
        dataset = self.plan.dataset
        meta = dict(tokenizer=dataset["tokenizer"], dataset=self.cfg.data, val_loss=val_loss)
        template = checkpoint_template(dataset)
        if template is not None:
            meta["chat_template"] = template
        meta.update(self.plan.finetune.get("weights", {}))
        return meta


class _Window:
    """The updates since the last progress line: from which step, since when, with how many tokens."""

    def __init__(self):
        self.restart(0)

    def restart(self, step: int) -> None:
        self.step, self.started, self.tokens = step, time.perf_counter(), 0

    @contextlib.contextmanager
    def pause(self):
        paused = time.perf_counter()
        try:
            yield
        finally:
            self.started += time.perf_counter() - paused


def check_format(dataset: dict[str, Any], method: str, wanted: str) -> None:
    if dataset.get("format") != wanted:
        raise NanoGPTError(
            f"--method {method} trains on a dataset prepared with --format {wanted}; this one is "
            f"{dataset.get('format', 'text')!r}"
        )
