"""The training display: the start-of-run lines, the progress lines (a live status line on a terminal) and the
final table, all driven by the trainer's typed events.

    with TrainDisplay(quiet=False, verbose=False) as display: Trainer(plan, display, world).fit()
"""

from __future__ import annotations

from nanogpt_cli.cli import ui  # ui.console, looked up at each use: tests swap it for one of a known width
from nanogpt_cli.cli.ui import speed_rows, summary_table

EVAL_LINE_S = 15.0  # in a pipe, a slow evaluation's progress line comes at most this often


def _fmt_eta(seconds: float) -> str:
    """m:ss under an hour, h:mm:ss from there on."""
    seconds = int(max(0, seconds))
    if seconds < 3600:
        return f"{seconds // 60}:{seconds % 60:02d}"
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def start_lines(e) -> list[str]:
    """The start of a run in a few lines (a RunStarted): the model's size and shape, the tokens of one step, the
    schedule, where it saves. The whole config is in the run folder's config.json (and under --verbose)."""
    m, t = e.model, e.train
    lines = []
    if m:
        size = f"{e.params / 1e6:,.1f}M" if e.params >= 10_000_000 else f"{e.params:,}"
        lines.append(
            f"model: {m['n_layer']} layers, {m['n_embd']} wide, {m['n_head']} heads, context {m['block_size']:,}, "
            f"{size} non-embedding params"
        )
    tune = getattr(e, "finetune", None)
    if tune:
        lines.append(finetune_line(e))
    if t:
        accumulation = t["gradient_accumulation_steps"]
        micro = f"{accumulation} micro-batch{'es' if accumulation > 1 else ''}"
        seq_len = t.get("seq_len") or m.get("block_size") or 0
        batch = getattr(e, "batch", None)
        rows = f"{t['batch_size']} row{'s' if t['batch_size'] > 1 else ''}"
        lines.append(
            f"batch: {batch}"
            if batch
            else f"batch: {e.tokens_per_iter:,} tokens per step ({rows} x {seq_len:,} tokens x {micro})"
        )
        optimizer = f"muon (lr {t['muon_lr']:g}) + adamw" if t["optimizer"] == "muon" else str(t["optimizer"])
        if t.get("embedding_lr") is not None:
            optimizer += f" (embedding lr {t['embedding_lr']:g})"
        lines.append(
            f"schedule: {optimizer}, lr {t['learning_rate']:g} {t['lr_schedule']} to {t['min_lr']:g}, warmup "
            f"{t['warmup_iters']:,}; saved every {t['eval_interval']:,} steps"
        )
    verb = "resuming at step" if e.resume else "training from step"
    lines.append(f"{verb} {e.step:,} of {e.max_iters:,} on {e.device} ({e.dtype}) -> {e.run_dir}")
    return lines


def finetune_line(e) -> str:
    """A fine-tune's start line: its method (DPO, GRPO, distillation or supervised), LoRA's settings and what
    trains."""
    tune = e.finetune
    objective = {"dpo": "DPO", "grpo": "GRPO"}.get(tune.get("objective"), "supervised")
    if tune.get("distill"):  # distillation: from which teacher, and how
        d = tune["distill"]
        labels = "its labels" if d["shards"] else "live"
        objective = f"distilled from {d['teacher']} ({labels}, top-{d['top_k']}, alpha {d['alpha']:g})"
    lora = (tune.get("weights") or {}).get("lora") if tune.get("method") == "lora" else None
    total = getattr(e, "total", None)
    if lora is None:
        trains = f"every weight trains ({total:,} params)" if total else "every weight trains"
        return f"fine-tune: {objective}, full; {trains}"
    trainable = getattr(e, "trainable", None)
    share = f" ({trainable / total:.2%} of {total:,})" if trainable is not None and total else ""
    count = f"{trainable:,} trainable params{share}" if trainable is not None else "adapters train"
    targets = ", ".join(lora["targets"])
    return f"fine-tune: {objective}, LoRA r {lora['r']}, alpha {lora['alpha']:g} on {targets}; {count}, the base frozen"


class TrainDisplay:
    """Shows the trainer's events (events.Display): a live rich progress bar on a terminal, plain log lines
    elsewhere, or nothing with quiet (errors still go to stderr). verbose: the whole config at the start too."""

    def __init__(self, quiet: bool = False, verbose: bool = False):
        self.quiet, self.verbose = quiet, verbose
        self.live = ui.console.is_terminal and not quiet
        self.progress = None
        self.task = None
        self.val: str | None = None  # the last evaluation's first value, for the progress lines ("val 1.2345")
        self.start_step = 0
        self.max_iters = 0
        self.step_width = 6
        self.max_time: float | None = None
        self.stats = ""  # the live bar's text of the last progress line, which an evaluation's progress borrows
        self.eval_said = 0.0  # in a pipe: the seconds into the evaluation of its last progress line

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        """The live bar ends (the summary prints below it); again, nothing."""
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def on_start(self, e) -> None:
        if self.quiet:
            return
        import json

        self.start_step, self.max_iters = e.step, e.max_iters
        self.step_width = len(f"{e.max_iters:,}")  # step numbers line up in every line of the run
        self.max_time = e.train.get("max_time")
        if self.verbose:
            ui.console.print(f"model: {json.dumps(e.model)}\ntrain: {json.dumps(e.train)}")
        ui.console.print("\n".join(start_lines(e)))
        if self.live:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(bar_width=10),
                MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"),
                TextColumn("elapsed"),
                TimeElapsedColumn(),
                console=ui.console,
            )
            self.progress.start()
            self.task = self.progress.add_task("train", total=e.max_iters, completed=e.step, stats="")

    def on_status(self, text: str) -> None:
        """What happens before the first step (loading, building, compiling, first evaluation): on a terminal
        always; in pipes and logs only once the run's start line is out (an error before it stays one line)."""
        if not self.quiet and (self.live or self.max_iters):
            ui.console.print(f"{text} ...", style="dim" if self.live else None)

    def on_hint(self, text: str) -> None:
        """Advice about the run while it goes (a busy machine), said once by the trainer."""
        if not self.quiet:
            (self.progress.console if self.progress is not None else ui.err_console).print(
                f"note: {text}", markup=False, highlight=False
            )

    def on_step(self, e) -> None:
        if self.quiet:
            return
        eta = (self.max_iters - e.step) * e.ms_per_iter / 1000
        if self.max_time is not None:  # --max-time ends the run first when its time runs out sooner
            eta = max(0.0, min(eta, self.max_time - e.elapsed_s))
        # (priority, text) in display order; where the line is too long the highest numbers go first, so that
        # loss, the time left, val and tok/s stay in 80 columns
        parts = [(0, f"loss {e.loss:.4f}")]
        if self.val is not None:
            parts.append((2, self.val))
        extra = getattr(e, "extra", {}).items()  # an objective's own values, the first as kept as the speed
        parts += [(3 if i == 0 else 4, f"{name} {value:.4g}") for i, (name, value) in enumerate(extra)]
        parts += [(3, f"{e.tokens_per_s:,.0f} tok/s"), (6, f"{e.ms_per_iter:.1f} ms/it"), (7, f"lr {e.lr:.2e}")]
        if e.mfu is not None:
            parts.append((8, f"MFU {e.mfu:.1%}"))
        if e.scale is not None:
            parts.append(
                (
                    1 if e.skipped else 9,
                    f"fp16 scale {e.scale:g}" + (f", skipped {e.skipped} (overflow)" if e.skipped else ""),
                )
            )
        parts.append((1, f"ETA {_fmt_eta(eta)}"))
        if self.progress is not None:
            # the bar's own columns: "train", a bar of at least 10, "1234/5000", "elapsed 0:00:00", and spaces
            room = ui.console.width - (6 + 11 + (2 * len(f"{self.max_iters}") + 2) + 16)
            self.stats = fit_fields(parts, room)
            self.progress.update(self.task, completed=e.step, stats=self.stats)
        elif e.step > self.start_step:
            head = f"step {e.step:>{self.step_width},}/{self.max_iters:,} | "
            parts.append((5, f"elapsed {_fmt_eta(e.elapsed_s)}"))
            ui.console.print(head + fit_fields(parts, ui.console.width - len(head)))

    def on_eval_progress(self, e) -> None:
        """A slow evaluation: batches scored and the time left in the live bar; in a pipe, a line every
        EVAL_LINE_S seconds."""
        if self.quiet:
            return
        left = f"{_fmt_eta(e.elapsed_s / e.done * (e.total - e.done))} left" if e.done < e.total else "done"
        text = f"evaluating: {e.done}/{e.total} batches, {left}"
        if self.progress is not None:
            self.progress.update(self.task, stats=text)
        elif e.elapsed_s - self.eval_said >= EVAL_LINE_S and e.done < e.total:  # the last: its eval line
            self.eval_said = e.elapsed_s
            ui.console.print(f"step {e.step:>{self.step_width},}: {text} ({_fmt_eta(e.elapsed_s)} so far)")

    def on_eval(self, e) -> None:
        if self.quiet:
            return
        self.val = f"val {e.val_loss:.4f}"
        self.eval_said = 0.0
        line = (
            f"step {e.step:>{self.step_width},}: train loss {e.train_loss:.4f}, val loss {e.val_loss:.4f}"
            f" (best {e.best_val_loss:.4f})" + (", checkpoint saved" if e.saved else "")
        )
        if self.progress is not None:  # the bar is at the step evaluated (and saved), with its last line's text
            self.progress.update(self.task, completed=e.step, stats=self.stats)
        (self.progress.console if self.progress is not None else ui.console).print(line)

    def on_scored(self, e) -> None:
        """A DPO or GRPO evaluation (events.Scored): its named values, the best of the first so far."""
        if self.quiet:
            return
        shown = [f"{name} {show_value(name, v)}" for name, v in e.values.items()]
        first = next(iter(e.values), None)
        if first is not None:
            self.val = shown[0]
        best = f" (best {show_value(first, e.best)})" if e.best is not None and first is not None else ""
        line = f"step {e.step:>{self.step_width},}: {', '.join(shown)}{best}" + (
            ", checkpoint saved" if e.saved else ""
        )
        if self.progress is not None:
            self.progress.update(self.task, completed=e.step)
        (self.progress.console if self.progress is not None else ui.console).print(line, highlight=False)

    def on_save(self, step: int) -> None:
        """A save outside the evaluations (Ctrl-C, SIGTERM, --stop-at): the bar stops at the step saved."""
        if self.quiet:
            return
        if self.progress is not None:
            self.progress.update(self.task, completed=step)
            self.progress.stop()  # its last frame stays on the screen, at this step
            self.progress = None
        ui.console.print(f"step {step:>{self.step_width},}: checkpoint saved")


def show_value(name: str, value: float) -> str:
    """A score as the lines show it: a share (accuracy) in percent, anything else to 4 decimals."""
    return f"{value:.1%}" if "accuracy" in name else f"{value:.4f}"


def fit_fields(parts: list[tuple[int, str]], width: int) -> str:
    """Join (priority, text) fields with " | ", dropping the least important (highest number) until the line
    fits in width characters; the first field always stays."""
    parts = list(parts)
    while len(parts) > 1 and len(" | ".join(t for _, t in parts)) > width:
        parts.remove(max(parts[1:], key=lambda p: p[0]))
    return " | ".join(t for _, t in parts)


def train_table(result):
    """The summary of a `TrainResult`."""
    rows = [("steps", f"{result.step:,}"), ("tokens seen", f"{result.tokens:,}")]
    if result.train_loss is not None:
        at = f" (step {result.eval_step:,})" if result.eval_step != result.step else ""
        rows += [
            (f"train loss{at}", f"{result.train_loss:.4f}"),
            (f"val loss{at}", f"{result.val_loss:.4f}"),
            ("best val loss", f"{result.best_val_loss:.4f}"),
        ]
    rows += [
        ("time", f"{result.elapsed_s:.1f} s"),
        (
            "speed",
            f"{result.ms_per_iter:.1f} ms/iter, {result.tokens_per_s:,.0f} "
            + ("trained tokens/s" if result.trained_only else "tokens/s"),
        ),
    ]
    if result.speed is not None:
        rows += speed_rows(result.speed)
    if result.mfu is not None:
        rows.append(("MFU", f"{result.mfu:.1%}"))
    return summary_table(f"run {result.run_dir}", rows)


def policy_table(result, objective: str):
    """The summary of a DPO or GRPO run (training.dpo.DPOResult, training.grpo.GRPOResult)."""
    rows = [("steps", f"{result.step:,}")]
    if objective == "dpo" and result.val_loss is not None:
        rows += [("val loss", f"{result.val_loss:.4f}"), ("val preference accuracy", f"{result.val_accuracy:.1%}")]
        if result.best_val_loss is not None:
            rows.append(("best val loss", f"{result.best_val_loss:.4f}"))
    if objective == "grpo" and result.val_reward is not None:
        rows.append(("val reward", f"{result.val_reward:.4f}"))
        if result.best_val_reward is not None:
            rows.append(("best val reward", f"{result.best_val_reward:.4f}"))
    rows += [
        ("time", f"{result.elapsed_s:.1f} s"),
        ("speed", f"{result.ms_per_iter:.1f} ms/iter, {result.tokens_per_s:,.0f} tokens/s"),
    ]
    return summary_table(f"{objective} run {result.run_dir}", rows)


def probe_line(e) -> str:
    """One shape auto's probe timed (a training.auto.Probed)."""
    return (
        f"probe: {e.n_layer} layers x {e.n_embd}, context {e.block_size}: {e.tokens_per_s:,.0f} tokens/s "
        f"({e.seconds:.1f} s)"
    )


def auto_table(choice):
    """What --preset auto chose and why (a training.auto.AutoChoice): one row per value; given ones say so."""
    from rich.table import Table

    from nanogpt_cli.config import flag, show_value

    table = Table(title="--preset auto", title_justify="left")
    table.add_column("setting", style="bold")
    table.add_column("value", justify="right")
    table.add_column("why")
    for row in choice.rows:
        table.add_row(f"--{flag(row.name)}", show_value(row.value), row.why, style="dim" if row.given else None)
    return table
