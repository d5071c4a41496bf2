"""Rich consoles, the training progress display and result tables. Rich styling only on a terminal.

from nanogpt_cli.cli.ui import console; console.print(table)
"""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

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
        return contextlib.nullcontext(_stage_lines())

    @contextlib.contextmanager
    def bar():
        columns = (
            TextColumn("{task.description}"),
            BarColumn(bar_width=20),
            TaskProgressColumn(),
            TextColumn("{task.fields[documents]:,} docs, {task.fields[tokens]:,} tokens, {task.fields[rate]}"),
            TextColumn("eta"),
            TimeRemainingColumn(),
        )
        with Progress(*columns, console=console, transient=True) as progress:
            tasks: dict[str, tuple[int, float]] = {}

            def update(p) -> None:
                if p.stage not in tasks:
                    tasks[p.stage] = (
                        progress.add_task(p.stage, total=p.total, documents=0, tokens=0, rate=""),
                        time.monotonic(),
                    )
                task_id, start = tasks[p.stage]
                speed = p.done / max(time.monotonic() - start, 1e-9)
                rate = f"{speed / 1e6:,.1f} MB/s" if p.unit == "bytes" else f"{speed:,.0f} docs/s"
                progress.update(
                    task_id, completed=p.done, total=p.total, documents=p.documents, tokens=p.tokens, rate=rate
                )

            yield update

    return bar()


def _stage_lines():
    """Progress for pipes and logs: one line on stderr as each stage completes, with its time (stdout keeps
    only the summary)."""
    import time

    started: dict[str, float] = {}
    finished: set[str] = set()

    def update(p) -> None:  # a data.PrepareProgress
        started.setdefault(p.stage, time.perf_counter())
        if p.total is not None and p.done >= p.total and p.stage not in finished:
            finished.add(p.stage)
            counts = f", {p.documents:,} documents, {p.tokens:,} tokens" if p.tokens else ""
            err_console.print(f"{p.stage}: done in {time.perf_counter() - started[p.stage]:.1f} s{counts}")

    return update


def eval_progress():
    """A context manager yielding a `progress(label, done, total)` callback for `eval perplexity` on a terminal:
    tokens scored, rate and time left; None elsewhere."""
    import contextlib

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    if not console.is_terminal:
        return contextlib.nullcontext(None)

    @contextlib.contextmanager
    def bar():
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(bar_width=20),
            MofNCompleteColumn(),
            TextColumn("tokens {task.fields[rate]}"),
            TimeRemainingColumn(),
            console=err_console,
            transient=True,
        ) as progress:
            tasks: dict[str, int] = {}

            def update(label: str, done: int, total: int | None) -> None:
                if label not in tasks:
                    tasks[label] = progress.add_task(label, total=total, rate="")
                task = progress.tasks[tasks[label]]
                speed = task.speed
                progress.update(tasks[label], completed=done, total=total, rate=f"{speed:,.0f}/s" if speed else "")

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
    if result.documents > 1 and result.val_split == "documents":  # a tail of the tokens is no whole document
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
        (
            "validation",
            "whole documents"
            if result.val_split == "documents"
            else f"the first {result.val_tokens:,} tokens (--val-tokens)"
            if result.val_split == "head"
            else "the tail of the text"
            if result.documents == 1
            else "the tail of the tokens (too few documents to hold out whole ones)",
        ),
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
    if t:
        accumulation = t["gradient_accumulation_steps"]
        micro = f"{accumulation} micro-batch{'es' if accumulation > 1 else ''}"
        lines.append(
            f"batch: {e.tokens_per_iter:,} tokens per step ({t['batch_size']} rows x {m.get('block_size', '?'):,} "
            f"tokens x {micro})"
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


class TrainDisplay:
    """Shows the trainer's events (events.Display): a live rich progress bar on a terminal, plain log lines
    elsewhere, or nothing with quiet (errors still go to stderr). verbose: the whole config at the start too."""

    def __init__(self, quiet: bool = False, verbose: bool = False):
        self.quiet, self.verbose = quiet, verbose
        self.live = console.is_terminal and not quiet
        self.progress = None
        self.task = None
        self.val_loss: float | None = None
        self.start_step = 0
        self.max_iters = 0
        self.step_width = 6
        self.max_time: float | None = None

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
        self.step_width = len(f"{e.max_iters:,}")  # step numbers line up in every line of the run
        self.max_time = e.train.get("max_time")
        if self.verbose:
            console.print(f"model: {json.dumps(e.model)}\ntrain: {json.dumps(e.train)}")
        console.print("\n".join(start_lines(e)))
        if self.live:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(bar_width=10),
                MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"),
                TextColumn("elapsed"),
                TimeElapsedColumn(),
                console=console,
            )
            self.progress.start()
            self.task = self.progress.add_task("train", total=e.max_iters, completed=e.step, stats="")

    def on_status(self, text: str) -> None:
        """What happens before the first step (loading, building, compiling, first evaluation): on a terminal
        always; in pipes and logs only once the run's start line is out (an error before it stays one line)."""
        if not self.quiet and (self.live or self.max_iters):
            console.print(f"{text} ...", style="dim" if self.live else None)

    def on_hint(self, text: str) -> None:
        """Advice about the run while it goes (a busy machine), said once by the trainer."""
        if not self.quiet:
            (self.progress.console if self.progress is not None else err_console).print(
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
        if self.val_loss is not None:
            parts.append((2, f"val {self.val_loss:.4f}"))
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
            room = console.width - (6 + 11 + (2 * len(f"{self.max_iters}") + 2) + 16)
            self.progress.update(self.task, completed=e.step, stats=fit_fields(parts, room))
        elif e.step > self.start_step:
            head = f"step {e.step:>{self.step_width},}/{self.max_iters:,} | "
            parts.append((5, f"elapsed {_fmt_eta(e.elapsed_s)}"))
            console.print(head + fit_fields(parts, console.width - len(head)))

    def on_eval(self, e) -> None:
        if self.quiet:
            return
        self.val_loss = e.val_loss
        line = (
            f"step {e.step:>{self.step_width},}: train loss {e.train_loss:.4f}, val loss {e.val_loss:.4f}"
            f" (best {e.best_val_loss:.4f})" + (", checkpoint saved" if e.saved else "")
        )
        if self.progress is not None:
            self.progress.update(self.task, completed=e.step)  # the bar is at the step evaluated (and saved)
        (self.progress.console if self.progress is not None else console).print(line)

    def on_save(self, step: int) -> None:
        """A save outside the evaluations (Ctrl-C, SIGTERM, --stop-at): the bar stops at the step saved."""
        if self.quiet:
            return
        if self.progress is not None:
            self.progress.update(self.task, completed=step)
            self.progress.stop()  # its last frame stays on the screen, at this step
            self.progress = None
        console.print(f"step {step:>{self.step_width},}: checkpoint saved")


def fit_fields(parts: list[tuple[int, str]], width: int) -> str:
    """Join (priority, text) fields with " | ", dropping the least important (highest number) until the line
    fits in width characters; the first field always stays."""
    parts = list(parts)
    while len(parts) > 1 and len(" | ".join(t for _, t in parts)) > width:
        parts.remove(max(parts[1:], key=lambda p: p[0]))
    return " | ".join(t for _, t in parts)


def speed_rows(speed) -> list[tuple[str, str]]:
    """A RunSpeed (or its dict from the run's trainer state) as summary rows: steady state beside the average, and the
    time that went to evaluating and saving."""
    s = speed if isinstance(speed, dict) else speed.__dict__
    return [
        (
            "steady step",
            f"{s['steady_ms_per_iter']:.1f} ms/iter (median after the first {s['skipped']}; "
            f"average {s['mean_ms_per_iter']:.1f})",
        ),
        ("evaluating, saving", f"{s['eval_s']:.2f} s, {s['save_s']:.2f} s"),
    ]


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


# --- eval ---


def eval_table(result):
    """The summary of an `EvalResult`."""
    return summary_table(
        f"perplexity of {result.source}",
        [
            ("loss (nats/token)", f"{result.loss:.4f}"),
            ("perplexity", f"{result.perplexity:.3f}"),
            ("bits per byte", f"{result.bits_per_byte:.4f}"),
            ("tokens scored", f"{result.tokens:,}"),
            ("bytes", f"{result.bytes:,}"),
            ("stride", f"{result.stride:,}"),
            ("time", f"{result.elapsed_s:.2f} s"),
            ("throughput", f"{result.tokens_per_s:,.0f} tokens/s"),
        ],
    )


# --- runs and info ---


def _loss(value) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) else "-"


def _count(value) -> str:
    if not isinstance(value, int):
        return "-"
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.1f}{unit}"
    return str(value)


def shorten(text: str, width: int) -> str:
    """text cut in the middle to width characters ("shakespeare-c…-20261201-120000"): runs named by date differ at
    the end, runs of one family at the start."""
    if len(text) <= width:
        return text
    if width <= 1:
        return text[:width]
    tail = (width - 1) // 2
    return text[: width - 1 - tail] + "…" + (text[-tail:] if tail else "")


RUN_COLUMNS = ("run", "dataset", "params", "steps", "best val", "tokens", "updated", "status")
DROPPED_FIRST = ("tokens", "updated", "params", "dataset")  # when the names would not fit: these go, in order
MIN_NAME = 16  # the run column never narrower than this, unless the name is shorter


def runs_table(runs, root, width: int | None = None):
    """The rows of `nanogpt runs` (runs.RunSummary), one per run, fitted to width (the console's): columns are
    dropped (tokens, updated, params, dataset) before a name is shortened, and a name is shortened in the middle,
    never wrapped."""
    from rich import box
    from rich.table import Table

    width = width or console.width
    rows = []
    for r in runs:
        steps = f"{r.step:,}" if r.step is not None else "-"
        if r.max_iters is not None:
            steps += f"/{r.max_iters:,}"
        rows.append(
            dict(
                zip(
                    RUN_COLUMNS,
                    (
                        r.name,
                        r.dataset or "-",
                        _count(r.params),
                        steps,
                        _loss(r.best_val_loss),
                        _count(r.tokens),
                        r.updated[5:16].replace("T", " "),
                        r.status,
                    ),
                )
            )
        )
    natural = {c: max([len(c)] + [len(row[c]) for row in rows]) for c in RUN_COLUMNS}
    shown = list(RUN_COLUMNS)

    def needed(columns) -> int:  # each column is padded by a space on either side; a space between columns
        return sum(natural[c] + 3 for c in columns) - 1

    for column in DROPPED_FIRST:
        if needed(shown) - natural["run"] + min(natural["run"], MIN_NAME) <= width:
            break
        shown.remove(column)
    room = width - needed([c for c in shown if c != "run"]) - 3
    name_width = max(min(natural["run"], room), min(natural["run"], 8))
    if "dataset" in shown and needed(shown) > width:  # the dataset's name gives way too, to at least 8
        natural["dataset"] = max(8, natural["dataset"] - (needed(shown) - natural["run"] + name_width - width))
    table = Table(title=f"runs in {root} (times UTC)", title_justify="left", box=box.SIMPLE_HEAD, show_edge=False)
    for name in shown:
        justify = "left" if name in ("run", "dataset", "updated", "status") else "right"
        table.add_column(name, justify=justify, no_wrap=True)
    colours = {"finished": "[green]finished[/]", "damaged": "[red]damaged[/]"}
    for row in rows:
        cells = []
        for name in shown:
            value = row[name]
            if name == "run":
                value = shorten(value, name_width)
            elif name == "dataset":
                value = shorten(value, natural["dataset"])
            cells.append(escape(value) if name != "status" else colours.get(value, value))
        table.add_row(*cells)
    return table


def info_table(info):
    """`nanogpt info` of a runs.Info: the summary, then the files with sizes and whether each loads."""
    from rich.console import Group
    from rich.table import Table

    rows = [("kind", info.kind)]
    if info.status:
        rows.append(("status", info.status))
    if info.model:
        m = info.model
        rows.append(
            (
                "model",
                f"{m['n_layer']} layers x {m['n_embd']} wide, {m['n_head']} heads, context "
                f"{m['block_size']:,}, {m['pos_encoding']}, {m['norm']}, {m['mlp']}",
            )
        )
    if info.params is not None and info.params_non_embedding is not None:
        rows += [
            ("parameters", f"{info.params:,} ({info.params_non_embedding:,} non-embedding)"),
            ("FLOPs per token", f"{info.flops_per_token:,} (training, full context)"),
        ]
    elif info.params is not None:  # a Hugging Face folder: counted from its weights' header
        rows.append(("parameters", f"{info.params:,}"))
    if info.finetune:
        rows.append(("fine-tune", info.finetune))
    rows += [("tokenizer", info.tokenizer or "-"), ("dataset", info.dataset or "-")]
    if info.step is not None:
        rows.append(("step", f"{info.step:,}" + (f" of {info.max_iters:,}" if info.max_iters else "")))
    if info.tokens is not None:
        rows.append(("tokens seen", f"{info.tokens:,}"))
    if info.train_loss is not None:
        rows.append(("last train loss", _loss(info.train_loss)))
    if info.val_loss is not None:
        rows.append(("last val loss", _loss(info.val_loss)))
    if info.best_val_loss is not None:
        rows.append(("best val loss", _loss(info.best_val_loss)))
    from nanogpt_cli.config import show_value as _value

    for entry in info.history:  # the values resumes changed, each from its step on
        changed = ", ".join(
            f"{c.get('flag')} {_value(c.get('saved'))} -> {_value(c.get('given'))}" for c in entry.get("changes", [])
        )
        rows.append((f"from step {entry.get('step', 0):,}", changed))
    if info.speed:
        rows += speed_rows(info.speed)
    files = Table(title="files", title_justify="left")
    files.add_column("file")
    files.add_column("bytes", justify="right")
    files.add_column("loads")
    files.add_column("", overflow="fold")
    for f in info.files:
        files.add_row(f.name, f"{f.bytes:,}", "yes" if f.loads else "[red]no[/]", f.note)
    if info.description:  # a Hugging Face folder: what it is, on a line of its own
        from rich.text import Text

        return Group(Text(info.description), summary_table(info.path, rows), files)
    return Group(summary_table(info.path, rows), files)
