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


def tasks_table(results, source: str):
    """The scores of a `TaskResults`: one row per task and metric, as lm-eval's own table has them (the metric
    followed by lm-eval's filter, when the task post-processes its answers)."""
    from rich.table import Table

    docs = sorted({s.samples for s in results.scores if s.samples is not None})
    counted = f", {docs[0]:,} documents each" if len(docs) == 1 else ""
    table = Table(title=f"{source} on lm-eval tasks{counted} ({results.elapsed_s:.1f} s)", title_justify="left")
    table.add_column("task", no_wrap=True)
    table.add_column("shots", justify="right")
    table.add_column("metric")  # the one column that wraps, at a filter's name
    table.add_column("value", justify="right", no_wrap=True)
    table.add_column("stderr", justify="right", no_wrap=True)
    for s in results.scores:
        metric = s.metric if s.filter == "none" else f"{s.metric} ({s.filter})"
        table.add_row(
            escape(s.task),
            "-" if s.num_fewshot is None else str(s.num_fewshot),
            escape(metric),
            f"{s.value:.4f}",
            "-" if s.stderr is None else f"± {s.stderr:.4f}",
        )
    return table


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
    colours = {"finished": "[green]finished[/]", "damaged": "[red]damaged[/]", "running": "[cyan]running[/]"}
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


def model_config(m: dict):
    """info.model as a GPTConfig, or None for a config this version cannot read."""
    from nanogpt_cli.config import GPTConfig

    try:
        return GPTConfig.from_dict(m)
    except (TypeError, ValueError):
        return None


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
        if info.seq_len is not None:
            rows.append(("training sequences", f"{info.seq_len:,} tokens (--seq-len)"))
        config = model_config(m)
        if config is not None:
            rows.append(("attention", config.attention_words()))
            if config.extras():
                rows.append(("attention, blocks", ", ".join(config.extras())))
    if info.params is not None and info.params_non_embedding is not None:
        rows += [
            ("parameters", f"{info.params:,} ({info.params_non_embedding:,} non-embedding)"),
            ("FLOPs per token", f"{info.flops_per_token:,} (training, full context)"),
        ]
    elif info.params is not None:  # a Hugging Face folder: counted from its weights' header
        rows.append(("parameters", f"{info.params:,}"))
    if info.kv_cache_bytes_per_token is not None:
        rows.append(("KV cache", f"{info.kv_cache_bytes_per_token:,.0f} bytes per token (float32)"))
    if info.decode:
        rows.append(("decode backend", info.decode))
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
