"""What the trainer tells a display: typed events, the Display protocol they go through, and the result of a
run. The CLI's display (cli/train_ui.TrainDisplay) and the trackers implement Display; the trainer
prints nothing.

    result = Trainer(plan, display=NoDisplay()).fit(); print(result.val_loss)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


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
    # a fine-tune: how it started (config.json's "finetune": method "full" or "lora", LoRA's settings under
    # weights.lora, a DPO or GRPO objective and its settings); None for pre-training
    finetune: dict[str, Any] | None = None
    trainable: int | None = None  # the parameters the optimizer updates, embeddings included (None: all of them)
    total: int | None = None  # every parameter of the model, embeddings included
    batch: str | None = None  # what one step reads, where it is not windows of tokens (DPO's pairs, GRPO's prompts)


@dataclass
class StepLogged:
    """One progress line: also a line of the run's metrics (kind "train")."""

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
    # False for the line at --stop-at's step, which the metrics file and the trackers leave out, so a stopped and
    # resumed run records the same lines as an uninterrupted one
    recorded: bool = True
    extra: dict[str, float] = field(default_factory=dict)  # an objective's own values: DPO's margin, GRPO's reward

    def record(self) -> dict[str, Any]:
        record = dict(
            kind="train",
            step=self.step,
            loss=self.loss,
            lr=self.lr,
            tokens=self.tokens,
            elapsed_s=round(self.elapsed_s, 3),
            tokens_per_s=round(self.tokens_per_s, 1),
        )
        if self.scale is not None:
            record.update(skipped=self.skipped, scale=self.scale)
        return record


@dataclass
class Evaluated:
    """One evaluation: also a line of the run's metrics (kind "eval"; all fields but best_val_loss). Lines of runs
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
        return dict(
            kind="eval",
            step=self.step,
            train_loss=self.train_loss,
            val_loss=self.val_loss,
            lr=self.lr,
            tokens=self.tokens,
            elapsed_s=self.elapsed_s,
        )


@dataclass
class Scored:
    """One evaluation of a DPO or GRPO run, whose scores are not a train and a val loss: named values in display
    order ("val loss", "val accuracy", "val reward"), the best of the first so far, and whether a save followed."""

    step: int
    values: dict[str, float]
    best: float | None = None
    saved: bool = True


@dataclass
class EvalProgress:
    """An evaluation under way that has taken a few seconds already (trainer.EVAL_QUIET_S): batches scored of
    this rank's batches of both splits."""

    step: int
    done: int
    total: int
    elapsed_s: float


class Display(Protocol):
    def on_start(self, event: RunStarted) -> None: ...
    def on_step(self, event: StepLogged) -> None: ...
    def on_eval(self, event: Evaluated) -> None: ...
    def on_scored(self, event: Scored) -> None: ...  # DPO's and GRPO's evaluations
    def on_eval_progress(self, event: EvalProgress) -> None: ...  # a slow evaluation, after each batch
    def on_save(self, step: int) -> None: ...
    def on_status(self, text: str) -> None: ...  # what happens before the first step (no long silences)
    def on_hint(self, text: str) -> None: ...  # advice while the run goes (a busy machine), at most once each


class NoDisplay:
    def on_start(self, event: RunStarted) -> None:
        pass

    def on_step(self, event: StepLogged) -> None:
        pass

    def on_eval(self, event: Evaluated) -> None:
        pass

    def on_scored(self, event: Scored) -> None:
        pass

    def on_eval_progress(self, event: EvalProgress) -> None:
        pass

    def on_save(self, step: int) -> None:
        pass

    def on_status(self, text: str) -> None:
        pass

    def on_hint(self, text: str) -> None:
        pass


@dataclass
class RunSpeed:
    """Where an invocation's time went. The steady-state step time leaves out the first `skipped` updates;
    the average is over every update but the first; evaluations and saves are counted apart from both."""

    steady_ms_per_iter: float  # the median update after the first `skipped`
    mean_ms_per_iter: float
    skipped: int
    eval_s: float
    save_s: float


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
    speed: RunSpeed | None = None
    trained_only: bool = False  # a chat dataset: tokens_per_s and mfu count the trained tokens (mask 1) only
