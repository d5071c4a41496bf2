"""inspect: attention maps, head roles and position schemes, as pictures and tables (library: inspect/).

nanogpt inspect heads checkpoints/shk
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from nanogpt_cli.cli.common import SCORE_DTYPE, PromptFile, load_options, note, one_line_errors
from nanogpt_cli.config import DECODING_FIELDS, RUNNING_FIELDS, LoadSpec
from nanogpt_cli.errors import NanoGPTError

inspect_app = typer.Typer(
    help="Look inside a trained model: attention maps, what each head does, positions.\n\n"
    "Example: nanogpt inspect heads checkpoints/shk",
    rich_markup_mode=None,
)
# what the pictures are of: the float weights' attention through the model's own forward, never a decode step
FLOAT_WEIGHTS = "the maps are of the weights as trained, through the model's own forward"
MEASURES = dict.fromkeys(("quantize", "group_size", *DECODING_FIELDS), FLOAT_WEIGHTS)
# the position scheme is the config's and the position table's: read on the CPU in float32, on any machine
TABLES = "the position scheme is drawn from the config and the table, read on the CPU in float32"
DRAWS = dict.fromkeys(RUNNING_FIELDS, TABLES)
Size = Annotated[
    str | None,
    typer.Option(help="Picture size in pixels, WIDTHxHEIGHT (default: fits the labels).", show_default=False),
]


def _inspect_target(out: Path) -> Path:
    """Refuse a picture that cannot be written, or drawn, before the model is loaded."""
    from nanogpt_cli.files import check_creatable
    from nanogpt_cli.inspect.draw import pyplot

    pyplot()
    check_creatable(out.parent if str(out.parent) else Path("."), "the folder of the picture")
    return out


def _inspect_prompt(prompt: str | None, prompt_file: Path | None) -> str | None:
    if prompt is not None and prompt_file is not None:
        raise NanoGPTError("give --prompt or --prompt-file, not both")
    if prompt_file is None:
        return prompt
    from nanogpt_cli.files import read_text_file

    return read_text_file(prompt_file, "--prompt-file")


@inspect_app.command("attention", short_help="Draw the attention of every head over a prompt.")
@one_line_errors
@load_options(leaves=MEASURES, dtype=SCORE_DTYPE)
def inspect_attention(
    prompt: Annotated[str | None, typer.Option(help="Text whose attention to draw.")] = None,
    prompt_file: PromptFile = None,
    out: Annotated[
        Path | None,
        typer.Option(
            help="Picture to write (.png, .svg or .pdf); default attention.png, none with --json.", show_default=False
        ),
    ] = None,
    layer: Annotated[int | None, typer.Option(help="Only this layer (from 0).")] = None,
    head: Annotated[
        int | None, typer.Option(help="Only this head (from 0); with --layer, one head drawn large.")
    ] = None,
    max_tokens: Annotated[int, typer.Option(help="Draw the last N tokens of a longer prompt.")] = 64,
    size: Size = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the attention weights as JSON.")] = False,
    *,
    spec: LoadSpec,  # the model and how it loads (load_options)
):
    """Draw every layer's and head's attention over a prompt's tokens as a grid of heatmaps.

    Example: nanogpt inspect attention checkpoints/shk --prompt "ROMEO: But soft" --out attention.png
    """
    from nanogpt_cli import api
    from nanogpt_cli.cli.ui import console, err_console
    from nanogpt_cli.inspect.draw import draw_attention, parse_size

    text = _inspect_prompt(prompt, prompt_file)
    if text is None:
        raise NanoGPTError("give the text to look at with --prompt or --prompt-file")
    if max_tokens < 2:
        raise NanoGPTError(f"--max-tokens must be at least 2, got {max_tokens}")
    pixels = parse_size(size) if size is not None else None
    if out is None and not json_out:
        out = Path("attention.png")
    if out is not None:
        _inspect_target(out)
    model = api.load(spec)
    maps = model.attention(text, layer=layer, head=head)
    if maps.cut:
        note(
            f"the prompt is {len(maps.ids) + maps.cut:,} tokens; its first {maps.cut:,} are cut to fit the context "
            f"of {model.block_size:,}"
        )
    if out is not None:
        written = draw_attention(maps, out, layer=layer, head=head, size=pixels, max_tokens=max_tokens)
        (err_console if json_out else console).print(f"wrote {written}", highlight=False, soft_wrap=True)
    if json_out:
        print(json.dumps(maps.to_dict()))


@inspect_app.command("heads", short_help="Score every head on probes and name what it does.")
@one_line_errors
@load_options(leaves=MEASURES, dtype=SCORE_DTYPE)
def inspect_heads(
    out: Annotated[
        Path | None,
        typer.Option(help="Also draw the scores as layers x heads grids in this picture (.png, .svg or .pdf)."),
    ] = None,
    plot: Annotated[Path | None, typer.Option("--plot", hidden=True, help="Deprecated: --out.")] = None,
    prompt: Annotated[
        str | None,
        typer.Option(help="Measure previous-token, first-token and distance on this text instead of random tokens."),
    ] = None,
    prompt_file: PromptFile = None,
    length: Annotated[
        int | None,
        typer.Option(
            help="Tokens in the random sequence that is repeated (default 64, or half the context if shorter).",
            show_default=False,
        ),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the random sequences.")] = 0,
    size: Size = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the scores as JSON instead of a table.")] = False,
    *,
    spec: LoadSpec,  # the model and how it loads (load_options)
):
    """Score every head on standard probes and name what it does: previous-token, induction, sink, local, mixed.

    Example: nanogpt inspect heads checkpoints/shk --out heads.png
    """
    from nanogpt_cli import api
    from nanogpt_cli.cli.ui import console, err_console
    from nanogpt_cli.inspect import heads_table
    from nanogpt_cli.inspect.draw import draw_heads, parse_size

    if plot is not None:  # the picture's old name, kept working (hidden) so scripts that use it do not break
        if out is not None:
            raise NanoGPTError("--plot is the deprecated name of --out; give --out only")
        note("--plot is deprecated: give the picture with --out, as the other inspect commands take it")
        out = plot
    text = _inspect_prompt(prompt, prompt_file)
    pixels = parse_size(size) if size is not None else None
    if out is not None:
        _inspect_target(out)
    report = api.load(spec).heads(length=length, seed=seed, prompt=text)
    if json_out:
        print(json.dumps(report.to_dict()))
    else:
        console.print(heads_table(report))
    if out is not None:
        written = draw_heads(report, out, size=pixels)
        (err_console if json_out else console).print(f"wrote {written}", highlight=False, soft_wrap=True)


@inspect_app.command("positions", short_help="Draw the model's position scheme.")
@one_line_errors
@load_options(leaves=DRAWS)
def inspect_positions(
    out: Annotated[Path, typer.Option(help="Picture to write (.png, .svg or .pdf).")] = Path("positions.png"),
    size: Size = None,
    *,
    spec: LoadSpec,  # the model (load_options)
):
    """Draw the model's position scheme: the sinusoidal or learned table, or RoPE's rotation frequencies.

    Example: nanogpt inspect positions checkpoints/shk --out positions.png
    """
    from nanogpt_cli import api
    from nanogpt_cli.cli.ui import console
    from nanogpt_cli.inspect.draw import draw_positions, parse_size

    pixels = parse_size(size) if size is not None else None
    _inspect_target(out)
    model = api.load(spec, device="cpu", dtype="float32")
    views = model.positions()
    console.print(views.summary, highlight=False, soft_wrap=True)
    console.print(f"wrote {draw_positions(views, model.name, out, size=pixels)}", highlight=False, soft_wrap=True)
