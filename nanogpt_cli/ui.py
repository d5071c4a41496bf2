"""Rich consoles, the training progress display and result tables. Rich styling only on a terminal.

    from nanogpt_cli.ui import console; console.print(table)
"""

from __future__ import annotations

from rich.console import Console

console = Console(highlight=False, soft_wrap=True)  # log lines stay whole in pipes and files
err_console = Console(stderr=True, highlight=False, soft_wrap=True)


# --- prepare ---


def prepare_progress():
    """A context manager yielding a progress callback (it takes a `data.PrepareProgress`) that drives a rich
    progress bar: documents, tokens, MB/s and the time left when the total is known. Yields None when stdout
    is not a terminal (pipes, CI and tests get no bar)."""
    import contextlib
    import time

    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

    if not console.is_terminal:
        return contextlib.nullcontext(None)

    @contextlib.contextmanager
    def bar():
        columns = (TextColumn("{task.description}"), BarColumn(bar_width=20), TaskProgressColumn(),
                   TextColumn("{task.fields[documents]:,} docs, {task.fields[tokens]:,} tokens, {task.fields[rate]}"),
                   TextColumn("eta"), TimeRemainingColumn())
        with Progress(*columns, console=console, transient=True) as progress:
            tasks: dict[str, tuple[int, float]] = {}

            def update(p) -> None:
                if p.stage not in tasks:
                    tasks[p.stage] = progress.add_task(p.stage, total=p.total, documents=0, tokens=0, rate=""), \
                        time.monotonic()
                task_id, start = tasks[p.stage]
                speed = p.done / max(time.monotonic() - start, 1e-9)
                rate = f"{speed / 1e6:,.1f} MB/s" if p.unit == "bytes" else f"{speed:,.0f} docs/s"
                progress.update(task_id, completed=p.done, total=p.total, documents=p.documents, tokens=p.tokens,
                                rate=rate)

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
    throughput = f"{result.tokens_per_s:,.0f} tokens/s"
    if result.source_bytes is not None:
        throughput += f", {result.source_bytes / 1e6 / max(result.elapsed_s, 1e-9):,.1f} MB/s"
    rows = [
        ("source", result.source),
        ("tokenizer", f"{result.tokenizer} ({result.dtype})"),
        ("documents", documents),
        ("characters", f"{result.characters:,}"),
        ("train tokens", f"{result.train_tokens:,}"),
        ("val tokens", f"{result.val_tokens:,} ({share:.1%})"),
        ("shards", f"{result.shards['train']:,} train, {result.shards['val']:,} val"),
        ("vocabulary size", f"{result.vocab_size:,}"),
        ("bytes on disk", f"{result.bytes_on_disk:,}"),
        ("time", f"{result.elapsed_s:.2f} s ({result.num_proc} process{'es' if result.num_proc > 1 else ''})"),
        ("throughput", throughput),
    ]
    if result.resumed_documents:
        rows.insert(-2, ("resumed", f"after {result.resumed_documents:,} documents"))
    return summary_table(f"prepared {result.path}", rows)


# --- train ---


def _fmt_eta(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class TrainDisplay:
    """Shows the trainer's events (train.Display): a live rich progress bar on a terminal, plain log lines
    elsewhere, or nothing with quiet (errors still go to stderr)."""

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

    def on_start(self, e) -> None:
        if self.quiet:
            return
        import json

        self.start_step, self.max_iters = e.step, e.max_iters
        console.print(f"model: {json.dumps(e.model)}\ntrain: {json.dumps(e.train)}")
        verb = "resuming at step" if e.resume else "training from step"
        console.print(f"{verb} {e.step:,} of {e.max_iters:,} on {e.device} ({e.dtype}): "
                      f"{e.params:,} non-embedding parameters, {e.tokens_per_iter:,} tokens/iter -> {e.run_dir}")
        if self.live:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), console=console)
            self.progress.start()
            self.task = self.progress.add_task("train", total=e.max_iters, completed=e.step, stats="")

    def on_step(self, e) -> None:
        if self.quiet:
            return
        eta = (self.max_iters - e.step) * e.ms_per_iter / 1000
        parts = [f"loss {e.loss:.4f}"]
        if self.val_loss is not None:
            parts.append(f"val {self.val_loss:.4f}")
        parts += [f"lr {e.lr:.2e}", f"{e.tokens_per_s:,.0f} tok/s", f"{e.ms_per_iter:.1f} ms/it"]
        if e.mfu is not None:
            parts.append(f"MFU {e.mfu:.1%}")
        parts.append(f"ETA {_fmt_eta(eta)}")
        stats = " | ".join(parts)
        if self.progress is not None:
            self.progress.update(self.task, completed=e.step, stats=stats)
        elif e.step > self.start_step:
            console.print(f"step {e.step:>6,}/{self.max_iters:,} | {stats}")

    def on_eval(self, e) -> None:
        if self.quiet:
            return
        self.val_loss = e.val_loss
        line = (f"step {e.step:>6,}: train loss {e.train_loss:.4f}, val loss {e.val_loss:.4f}"
                f" (best {e.best_val_loss:.4f}), checkpoint saved")
        (self.progress.console if self.progress is not None else console).print(line)

    def on_save(self, step: int) -> None:
        if not self.quiet:
            console.print(f"step {step:>6,}: checkpoint saved")


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
        ("time", f"{result.elapsed_s:.2f} s"),
        ("throughput", f"{result.tokens_per_s:,.0f} tokens/s"),
    ])
