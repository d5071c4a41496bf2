"""runs, info and plot: the runs table, one run or file described, loss curves (library: inspect/catalog.py, plot.py).

nanogpt runs; nanogpt info checkpoints/shk; nanogpt plot checkpoints/shk --out loss.png
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from nanogpt_cli import api
from nanogpt_cli.cli.common import one_line_errors, say_kernels


@one_line_errors
def runs(
    folder: Annotated[Path, typer.Argument(help="A folder of run folders (or one run).")] = Path("checkpoints"),
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object per run instead of a table.")] = False,
):
    """List the runs in a folder: dataset, size, progress, best val loss, last update, status.

    Example: nanogpt runs checkpoints
    """
    from nanogpt_cli.cli.ui import console, runs_table

    found = api.list_runs(folder)
    if json_out:
        for run in found:
            print(json.dumps(run.to_dict()))
    elif not found:
        console.print(f"no runs in {folder}")
    else:
        console.print(runs_table(found, folder))
        for run in found:
            if run.problem or run.description:
                console.print(f"{run.name}: {run.problem or run.description}", markup=False)


@one_line_errors
def info(
    path: Annotated[
        Path | None,
        typer.Argument(
            help="A run folder or a run's name in checkpoints/, a .safetensors file or .gguf export.",
            show_default=False,
        ),
    ] = None,
    system: Annotated[
        bool,
        typer.Option(
            "--system",
            help="Describe this machine instead: torch, threads, CPU features, our decode kernels (built here if "
            "they were not) and where they are kept, and the devices.",
        ),
    ] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
):
    """Describe a run or weights file: config, parameters, FLOPs per token, tokenizer, losses, files; or, with
    --system, this machine.

    Example: nanogpt info checkpoints/shk; nanogpt info --system
    """
    from nanogpt_cli import api
    from nanogpt_cli.cli.ui import console, info_table
    from nanogpt_cli.errors import NanoGPTError

    if system:
        if path is not None:
            raise NanoGPTError("give a run or file, or --system, not both")
        found = api.system_info()
        say_kernels()  # a build this made (or a failed one), as every command says it
        if json_out:
            print(json.dumps(found))
        else:
            console.print(system_table(found))
        return
    if path is None:
        raise NanoGPTError("give a run folder, a run's name, a .safetensors or .gguf file, or --system")
    result = api.info(path)
    if json_out:
        print(json.dumps(result.to_dict()))
    else:
        console.print(info_table(result))


@one_line_errors
def plot(
    runs: Annotated[list[Path], typer.Argument(help="Run folders (or run names in checkpoints/) to draw.")],
    out: Annotated[
        Path | None, typer.Option(help="Write a .png/.svg/.pdf here instead of drawing in the terminal.")
    ] = None,
):
    """Draw train and val loss against tokens seen, for one or several runs.

    Example: nanogpt plot checkpoints/shk checkpoints/shk-wsd --out loss.png
    """
    from nanogpt_cli.cli.ui import console

    if out is not None:
        console.print(f"wrote {api.plot(runs, out)}")
    else:
        print(api.plot(runs, width=min(console.width, 100), height=20, color=console.is_terminal))


def system_table(found: dict):
    """`nanogpt info --system` of inspect.catalog.system_info(): one row per fact."""
    from rich.table import Table

    threads = f"{found['threads']} of {found['cpus']} CPUs"
    if found["omp_num_threads"] is not None:
        threads += f" (OMP_NUM_THREADS={found['omp_num_threads']})"
    rows = [
        ("python", found["python"]),
        ("torch", found["torch"]),
        ("threads", threads),
        ("cpu", found["cpu"]),
        ("cpu features", ", ".join(found["cpu_features"]) or "none of those our kernels use"),
        ("decode kernels", found["kernels"]),
        ("kernels kept in", found["kernels_library"] or found["kernels_cache"]),
        ("devices", ", ".join(found["devices"])),
    ]
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for key, value in rows:
        table.add_row(key, str(value))
    return table


@one_line_errors
def report(
    runs: Annotated[list[Path], typer.Argument(help="Run folders: one prints its report card, several compare them.")],
):
    """Print a run's report card (report.md, written at the end of each run), or compare runs side by side.

    Example: nanogpt report checkpoints/a checkpoints/b
    """
    from nanogpt_cli.cli.ui import console

    if len(runs) == 1:
        text = api.report(runs[0])
        if console.is_terminal:
            from rich.markdown import Markdown

            console.print(Markdown(text))
        else:
            print(text)
        return
    from rich.table import Table

    compared = api.compare(runs)
    table = Table(title="runs compared", title_justify="left")
    table.add_column("", style="bold")
    for name in compared.names:
        table.add_column(name, justify="right")
    for label, values in compared.rows:
        table.add_row(label, *values)
    console.print(table)
