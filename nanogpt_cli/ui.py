"""Rich consoles, the training progress display and result tables. Rich styling only on a terminal.

    from nanogpt_cli.ui import console; console.print(table)
"""

from __future__ import annotations

from rich.console import Console

console = Console(highlight=False, soft_wrap=True)  # log lines stay whole in pipes and files
err_console = Console(stderr=True, highlight=False, soft_wrap=True)


# --- prepare ---


def prepare_progress():
    """A context manager yielding a `progress(stage, done, total)` callback that drives a rich progress bar,
    or yielding None when stdout is not a terminal (pipes, CI and tests get no bar)."""
    import contextlib

    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

    if not console.is_terminal:
        return contextlib.nullcontext(None)

    @contextlib.contextmanager
    def bar():
        with Progress(TextColumn("{task.description:<20}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(),
                      console=console, transient=True) as progress:
            tasks: dict[str, int] = {}

            def update(stage: str, done: int, total: int | None) -> None:
                if stage not in tasks:
                    tasks[stage] = progress.add_task(stage, total=total)
                progress.update(tasks[stage], completed=done, total=total)

            yield update

    return bar()


def summary_table(title: str, rows: list[tuple[str, str]]):
    """A two-column table of labelled results, the shape every command ends with."""
    from rich.table import Table

    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    for label, value in rows:
        table.add_row(label, value)
    return table


def prepare_table(result):
    """The summary of a `PrepareResult`."""
    share = result.val_tokens / max(result.tokens, 1)
    documents = f"{result.documents:,}"
    if result.documents > 1:
        documents += f" ({result.val_documents:,} in val)"
    return summary_table(f"prepared {result.path}", [
        ("source", result.source),
        ("tokenizer", f"{result.tokenizer} ({result.dtype})"),
        ("documents", documents),
        ("characters", f"{result.characters:,}"),
        ("train tokens", f"{result.train_tokens:,}"),
        ("val tokens", f"{result.val_tokens:,} ({share:.1%})"),
        ("vocabulary size", f"{result.vocab_size:,}"),
        ("bytes on disk", f"{result.bytes_on_disk:,}"),
        ("time", f"{result.seconds:.2f} s"),
        ("throughput", f"{result.tokens_per_second:,.0f} tokens/s"),
    ])


# --- train ---


def _fmt_eta(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class TrainDisplay:
    """Turns train() events into a live rich progress bar on a terminal, plain log lines elsewhere, or
    nothing with quiet (errors still go to stderr)."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.live = console.is_terminal and not quiet
        self.progress = None
        self.task = None
        self.val_loss: float | None = None
        self.start_step = 0
        self.max_iters = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.progress is not None:
            self.progress.stop()

    def __call__(self, kind: str, info: dict) -> None:
        if self.quiet:
            return
        getattr(self, f"on_{kind}")(info)

    def on_start(self, info):
        import json

        self.start_step, self.max_iters = info["step"], info["max_iters"]
        console.print(f"model: {json.dumps(info['model'])}\ntrain: {json.dumps(info['train'])}")
        verb = "resuming at step" if info["resume"] else "training from step"
        console.print(f"{verb} {info['step']:,} of {info['max_iters']:,} on {info['device']} ({info['dtype']}): "
                      f"{info['params']:,} non-embedding parameters, {info['tokens_per_iter']:,} tokens/iter "
                      f"-> {info['run_dir']}")
        if self.live:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), console=console)
            self.progress.start()
            self.task = self.progress.add_task("train", total=info["max_iters"], completed=info["step"], stats="")

    def on_step(self, info):
        done = info["step"] - self.start_step
        eta = (self.max_iters - info["step"]) * info["ms_per_iter"] / 1000
        parts = [f"loss {info['loss']:.4f}"]
        if self.val_loss is not None:
            parts.append(f"val {self.val_loss:.4f}")
        parts += [f"lr {info['lr']:.2e}", f"{info['tokens_per_s']:,.0f} tok/s", f"{info['ms_per_iter']:.1f} ms/it"]
        if info.get("mfu") is not None:
            parts.append(f"MFU {info['mfu']:.1%}")
        parts.append(f"ETA {_fmt_eta(eta)}")
        stats = " | ".join(parts)
        if self.progress is not None:
            self.progress.update(self.task, completed=info["step"], stats=stats)
        elif done > 0:
            console.print(f"step {info['step']:>6,}/{self.max_iters:,} | {stats}")

    def on_eval(self, info):
        self.val_loss = info["val_loss"]
        line = (f"step {info['step']:>6,}: train loss {info['train_loss']:.4f}, val loss {info['val_loss']:.4f}"
                f" (best {info['best_val_loss']:.4f}), checkpoint saved")
        (self.progress.console if self.progress is not None else console).print(line)

    def on_save(self, info):
        console.print(f"step {info['step']:>6,}: checkpoint saved")


def train_table(result):
    """The summary of a `TrainResult`."""
    rows = [("steps", f"{result.step:,}"), ("tokens seen", f"{result.tokens:,}")]
    if result.train_loss is not None:
        at = f" (step {result.eval_step:,})" if result.eval_step != result.step else ""
        rows += [(f"train loss{at}", f"{result.train_loss:.4f}"), (f"val loss{at}", f"{result.val_loss:.4f}"),
                 ("best val loss", f"{result.best_val_loss:.4f}")]
    rows += [("time", f"{result.elapsed_s:.1f} s"),
             ("speed", f"{result.ms_per_iter:.1f} ms/iter, {result.tokens_per_s:,.0f} tokens/s")]
    if result.mfu is not None:
        rows.append(("MFU", f"{result.mfu:.1%}"))
    return summary_table(f"run {result.run_dir}", rows)


# --- eval ---


def eval_table(result):
    """The summary of an `EvalResult`."""
    return summary_table(f"perplexity of {result.source}", [
        ("loss (nats/token)", f"{result.loss:.4f}"),
        ("perplexity", f"{result.perplexity:.3f}"),
        ("bits per byte", f"{result.bits_per_byte:.4f}"),
        ("tokens scored", f"{result.tokens:,}"),
        ("bytes", f"{result.bytes:,}"),
        ("stride", f"{result.stride:,}"),
        ("time", f"{result.seconds:.2f} s"),
        ("throughput", f"{result.tokens_per_s:,.0f} tokens/s"),
    ])
