"""Experiment trackers fed by the trainer's typed events: TensorBoard and Weights & Biases (the `track` extra).

    tracker = open_tracker("tensorboard"); train(plan, Tee(TrainDisplay(), tracker)); tracker.close()

The run folder's metrics file stays the source of truth; a tracker is a copy for its viewer. TensorBoard
logs go to RUN/tensorboard (view with `tensorboard --logdir RUN`); wandb runs offline unless WANDB_MODE says
otherwise, into RUN/wandb (upload later with `wandb sync`), so it needs no network and no account.
"""

from __future__ import annotations

import os
from pathlib import Path

from nanogpt_cli.errors import NanoGPTError, require

TRACKERS = ("tensorboard", "wandb")


class Tee:
    """Hands every trainer event (events.Display) to several displays in turn."""

    def __init__(self, *displays):
        self.displays = [d for d in displays if d is not None]

    def __getattr__(self, name):
        if not name.startswith("on_"):
            raise AttributeError(name)

        def forward(*args):
            for d in self.displays:
                method = getattr(d, name, None)
                if method is not None:
                    method(*args)

        return forward


class TensorBoardTracker:
    def __init__(self):
        board = require("torch.utils.tensorboard", "track", "--tracker tensorboard", package="tensorboard")
        self._writer_class = board.SummaryWriter
        self.writer = None

    def on_start(self, e) -> None:
        import json

        self.writer = self._writer_class(log_dir=str(Path(e.run_dir) / "tensorboard"))
        self.writer.add_text(
            "config", f"```\n{json.dumps({'model': e.model, 'train': e.train}, indent=2)}\n```", global_step=e.step
        )

    def on_step(self, e) -> None:
        if not e.recorded:
            return
        self.writer.add_scalar("train/loss", e.loss, e.step)
        self.writer.add_scalar("train/lr", e.lr, e.step)
        self.writer.add_scalar("train/tokens_per_s", e.tokens_per_s, e.step)
        if e.scale is not None:
            self.writer.add_scalar("train/fp16_scale", e.scale, e.step)

    def on_eval(self, e) -> None:
        self.writer.add_scalar("eval/train_loss", e.train_loss, e.step)
        self.writer.add_scalar("eval/val_loss", e.val_loss, e.step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandbTracker:
    def __init__(self):
        self.wandb = require("wandb", "track", "--tracker wandb")
        self.run = None

    def on_start(self, e) -> None:
        run_dir = Path(e.run_dir)
        mode = os.environ.get("WANDB_MODE", "offline")  # no network unless asked for
        self.run = self.wandb.init(
            project=os.environ.get("WANDB_PROJECT", "nanogpt"),
            name=run_dir.name,
            dir=str(run_dir),
            mode=mode,
            config={"model": e.model, "train": e.train},
            settings=self.wandb.Settings(silent=True, console="off"),
        )

    def on_step(self, e) -> None:
        if not e.recorded:
            return
        record = {"train/loss": e.loss, "train/lr": e.lr, "train/tokens_per_s": e.tokens_per_s, "tokens": e.tokens}
        if e.scale is not None:
            record["train/fp16_scale"] = e.scale
        self.run.log(record, step=e.step)

    def on_eval(self, e) -> None:
        self.run.log({"eval/train_loss": e.train_loss, "eval/val_loss": e.val_loss, "tokens": e.tokens}, step=e.step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


def open_tracker(name: str):
    """The tracker named by --tracker; its package is imported now, so a missing extra fails before training."""
    if name == "tensorboard":
        return TensorBoardTracker()
    if name == "wandb":
        return WandbTracker()
    raise NanoGPTError(f"--tracker must be one of {', '.join(TRACKERS)}, got {name!r}")
