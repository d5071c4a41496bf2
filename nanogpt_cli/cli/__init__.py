"""The `nanogpt` command line: thin typed commands over the library. Nothing imports this module.

nanogpt prepare examples/tinyshakespeare.txt --name shakespeare-char --tokenizer char
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from nanogpt_cli.config import Dtype, TrainConfig, field_help, flag
from nanogpt_cli.errors import NanoGPTError

app = typer.Typer(
    help="Prepare text, train a small GPT, sample from it and evaluate it.\n\n"
    "Example: nanogpt prepare examples/tinyshakespeare.txt --name shk --tokenizer char",
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish and PowerShell
    pretty_exceptions_enable=False,
    # click's plain help: wraps to the terminal (80 columns included) without cutting flag names or showing
    # <bool> after flags; usage errors become one line in main()
    rich_markup_mode=None,
)
eval_app = typer.Typer(
    help="Evaluate a trained model.\n\n"
    "Example: nanogpt eval perplexity --checkpoint checkpoints/shk --data shakespeare-char",
    rich_markup_mode=None,
)
app.add_typer(eval_app, name="eval")


@eval_app.callback(invoke_without_command=True)
def _eval_root(ctx: typer.Context):
    if ctx.invoked_subcommand is None:
        print(ctx.get_help())
        raise typer.Exit(0)


def fail(message: str) -> typer.Exit:
    """Print one styled error line on stderr and return the exit to raise."""
    from rich.markup import escape

    from nanogpt_cli.cli.ui import err_console

    # escaped: a message may hold brackets that are text, not styles (pip install -e ".[hf]")
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(1)


@app.callback(invoke_without_command=True)
def _root(
    ctx: typer.Context, version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False
):
    if version:
        from nanogpt_cli import __version__

        print(f"nanogpt {__version__}")
        raise typer.Exit(0)
    if ctx.invoked_subcommand is None:
        print(ctx.get_help())
        raise typer.Exit(0)


def one_line_errors(command):
    """Every command's library errors become one styled line on stderr and exit code 1."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except NanoGPTError as e:
            from nanogpt_cli.training.launch import record_error

            record_error(str(e))  # under a torch launcher: the sentence its report of the failure shows
            raise (fail(str(e)) if prints() else typer.Exit(1)) from None

    return run


def stopped(message: str) -> typer.Exit:
    """Ctrl-C: what was kept (on stderr), and the shell's exit code for it."""
    from nanogpt_cli.cli.ui import err_console

    err_console.print(message, highlight=False, soft_wrap=True)
    return typer.Exit(130)


def prints() -> bool:
    """Whether this process prints: always, except under torchrun, where rank 0 speaks for all (they meet the
    same errors, as they read the same files and agree on losses and stop signals)."""
    return os.environ.get("RANK", "0") == "0"


def config_options(command):
    """`command`'s own options plus one option per field of GPTConfig and TrainConfig, generated from each
    field's type (a Choice offers its choices), help text, panel and default, as config.py declares them. The
    options given reach `command` as one dict, `flags`; the others stay unset, so a preset or config file can
    fill them, and their help shows the value they stand for when nothing does."""
    import dataclasses
    import inspect
    import typing

    from nanogpt_cli.config import MAIN, GPTConfig, TrainConfig

    hints = typing.get_type_hints(command, include_extras=True)
    own = [
        p.replace(annotation=hints[p.name], kind=inspect.Parameter.KEYWORD_ONLY)
        for p in inspect.signature(command).parameters.values()
        if p.name != "flags"
    ]
    generated = [(cls, f) for cls in (GPTConfig, TrainConfig) for f in dataclasses.fields(cls)]
    options = {f.name: config_option(cls, f) for cls, f in generated}
    first = [options[f.name] for cls, f in generated if f.metadata.get("panel") == MAIN]  # beside the command's own

    @functools.wraps(command)
    def run(**kwargs):
        given = {name: kwargs.pop(name) for name in options}
        return command(**kwargs, flags={k: v for k, v in given.items() if v is not None})

    params = first + own + [p for p in options.values() if p not in first]
    run.__signature__ = inspect.Signature(params)
    run.__annotations__ = {p.name: p.annotation for p in params}
    return run


def config_option(cls, field):
    """The CLI option of one config field: --name (--name/--no-name for a bool), of the field's type."""
    import inspect

    from nanogpt_cli.config import field_types

    kind, _ = field_types(cls)[field.name]
    name, default = flag(field.name), field.default
    if default in (None, "") or not field.metadata.get("default_shown", True):
        shown = False
    elif kind is bool:
        shown = name if default else f"no-{name}"
    else:
        shown = str(default)
    option = typer.Option(
        *([f"--{name}/--no-{name}"] if kind is bool else []),
        help=field.metadata["help"],
        show_default=shown,
        rich_help_panel=field.metadata.get("panel", cls.PANEL) or None,
    )
    return inspect.Parameter(
        field.name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[kind | None, option]
    )


# options that several commands share
Checkpoint = Annotated[
    str,
    typer.Option(help="Run folder (its best weights), a .safetensors file, or a Hugging Face model folder or hf:NAME."),
]
Last = Annotated[bool, typer.Option("--last", help="Use a run's last weights instead of its best.")]
Device = Annotated[str, typer.Option(help=field_help(TrainConfig, "device"))]
DtypeOption = Annotated[
    Dtype, typer.Option(help="Precision the weights are cast to (auto: from the device and their size).")
]
DATA_DIR_HELP = field_help(TrainConfig, "data_dir")
Threads = Annotated[
    int | None,
    typer.Option(
        help="CPU threads (default: torch's choice, one per core); fewer help on a busy machine.", show_default=False
    ),
]


# options that train and finetune share, declared once
RunConfig = Annotated[Path | None, typer.Option("--config", help="TOML file of config keys; flags override it.")]
RunOut = Annotated[Path | None, typer.Option("--out", help="Run folder (default checkpoints/DATA-TIMESTAMP).")]
Resume = Annotated[bool, typer.Option("--resume", help="Continue the run in --out where it stopped.")]
Force = Annotated[bool, typer.Option("--force", help="Start over in an --out that holds a run (deletes it).")]
Last = Annotated[bool, typer.Option("--last", help="With --init-from RUN: its last weights, not its best.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="Print only the final summary.")]
Plot = Annotated[
    bool, typer.Option("--plot/--no-plot", help="Draw loss.png in the run folder at the end (with matplotlib).")
]
Tracker = Annotated[
    str | None,
    typer.Option(
        "--tracker",
        help="Also log to tensorboard or wandb (offline unless WANDB_MODE=online); needs the track extra.",
        show_default=False,
    ),
]


def note(message: str) -> None:
    from nanogpt_cli.cli.ui import err_console

    err_console.print(f"note: {message}", highlight=False, soft_wrap=True, markup=False)


# --- commands: thin typed functions over the library, each wrapped by one_line_errors ---


# what prepare and tokenizer train both read
Source = Annotated[
    str,
    typer.Argument(
        help="A .txt/.md file, a folder or glob of them, a .jsonl/.json/.parquet/.csv file, hf:OWNER/NAME, or "
        "shakespeare (downloaded once)."
    ),
]
TextColumn = Annotated[str, typer.Option(help="Column with the text in .jsonl/.json/.parquet/.csv and hub datasets.")]
Subset = Annotated[str | None, typer.Option(help="Hub dataset subset (configuration) name.")]
Split = Annotated[str, typer.Option(help="Hub dataset split to read.")]
Streaming = Annotated[bool, typer.Option(help="Stream a hub dataset instead of downloading it first.")]
DataFormat = Annotated[
    str,
    typer.Option(
        "--format",
        help="text, or chat: a .jsonl of conversations (messages, prompt/completion or Alpaca rows) rendered with "
        "a chat template, with a loss mask on the assistant's tokens.",
    ),
]
ChatTemplateFile = Annotated[
    Path | None, typer.Option(help="A Jinja chat template file for --format chat (the default needs no new tokens).")
]
Strict = Annotated[
    bool, typer.Option("--strict", help="With --format chat, stop at the first bad row instead of skipping it.")
]
TokenizerName = Annotated[
    str,
    typer.Option(
        help="gpt2, char, byte, a tiktoken encoding such as cl100k_base, or a tokenizer trained by "
        "`nanogpt tokenizer train` (NAME or folder)."
    ),
]


@app.command()
@one_line_errors
def prepare(
    source: Source,
    name: Annotated[str, typer.Option(help="Dataset name: the folder DATA_DIR/NAME that training reads.")],
    tokenizer: TokenizerName = "gpt2",
    val_fraction: Annotated[
        float, typer.Option(help="Share held out for validation: the tail of one text, or every (1/f)-th document.")
    ] = 0.1,
    data_dir: Annotated[Path, typer.Option(help=DATA_DIR_HELP)] = Path("data"),
    tokenizers_dir: Annotated[Path, typer.Option(help="Folder of trained tokenizers (for --tokenizer NAME).")] = Path(
        "tokenizers"
    ),
    text_column: TextColumn = "text",
    subset: Subset = None,
    split: Split = "train",
    streaming: Streaming = False,
    max_docs: Annotated[int | None, typer.Option(help="Keep only the first N documents.")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="Stop after N tokens (train and val together).")] = None,
    val_tokens: Annotated[
        int | None, typer.Option(help="Validate on the first N tokens of the stream instead of --val-fraction.")
    ] = None,
    shard_tokens: Annotated[int, typer.Option(help="Tokens per shard file.")] = 100_000_000,
    num_proc: Annotated[int, typer.Option(help="Tokenizer worker processes (the output does not depend on it).")] = 1,
    resume: Annotated[
        bool,
        typer.Option("--resume", help="Continue an interrupted prepare of --name (or start one if there is none)."),
    ] = False,
    encoding: Annotated[
        str, typer.Option(help="Text encoding of .txt/.md/.jsonl/.json/.csv files, e.g. cp1252 or latin-1.")
    ] = "utf-8",
    format: DataFormat = "text",
    chat_template: ChatTemplateFile = None,
    strict: Strict = False,
):
    """Tokenize text into DATA_DIR/NAME: train-00000.bin, ..., val-00000.bin, ... and meta.json.

    Example: nanogpt prepare shakespeare --name shakespeare-char --tokenizer char
    """
    from nanogpt_cli.cli.ui import console, prepare_progress, prepare_table
    from nanogpt_cli.data import interrupted_prepare
    from nanogpt_cli.data import prepare as prepare_data
    from nanogpt_cli.files import check_creatable

    check_creatable(data_dir, "--data-dir")
    tokenizer = trained_or_named(tokenizer, tokenizers_dir)
    replacing = (data_dir / name / "meta.json").is_file() and not resume  # --resume continues, not replaces
    if format != "text":
        return prepare_chat(
            source, name, tokenizer, data_dir, chat_template, val_fraction, strict, shard_tokens, format
        )
    try:
        with prepare_progress() as progress:
            result = prepare_data(
                source,
                name,
                tokenizer=tokenizer,
                val_fraction=val_fraction,
                data_dir=data_dir,
                text_column=text_column,
                subset=subset,
                split=split,
                streaming=streaming,
                max_docs=max_docs,
                num_proc=num_proc,
                shard_tokens=shard_tokens,
                max_tokens=max_tokens,
                val_tokens=val_tokens,
                resume=resume,
                encoding=encoding,
                progress=progress,
            )
    except KeyboardInterrupt:  # the partial prepare is kept: say where and how to continue it
        kept = interrupted_prepare(data_dir, name)
        raise stopped(f"interrupted; {kept}" if kept else "interrupted") from None
    console.print(prepare_table(result))
    if replacing:  # said after the table, where it is seen: runs trained on the old data see the new
        console.print(
            f"replaced the dataset that was in {result.path}; runs trained on it continue on the new data when resumed"
        )


def trained_or_named(tokenizer: str, tokenizers_dir: Path) -> str:
    """--tokenizer as prepare takes it: a trained tokenizer's NAME becomes its folder, other names stay."""
    from nanogpt_cli.tokenizer import available_tokenizers, tokenizer_folder

    trained = tokenizer_folder(tokenizer, tokenizers_dir) if tokenizer not in available_tokenizers() else None
    return str(trained) if trained is not None else tokenizer


def prepare_chat(source, name, tokenizer, data_dir, chat_template, val_fraction, strict, shard_tokens, fmt) -> None:
    """prepare --format chat: conversations rendered with a template, a loss mask beside each token shard."""
    if fmt != "chat":
        raise NanoGPTError(f"unknown --format {fmt!r}; use text or chat")
    from nanogpt_cli.cli.ui import console
    from nanogpt_cli.data.chat import prepare_chat as prepare_chat_data

    result = prepare_chat_data(
        source,
        name,
        tokenizer=tokenizer,
        data_dir=str(data_dir),
        val_fraction=val_fraction,
        chat_template=str(chat_template) if chat_template else None,
        strict=strict,
        shard_tokens=shard_tokens,
    )
    for line, why in result.bad[:20]:
        console.print(f"skipped line {line}: {why}", highlight=False, soft_wrap=True)
    if result.bad:
        console.print(f"skipped {len(result.bad):,} bad rows (--strict stops at the first)", highlight=False)
    console.print(
        f"{result.path}: {result.conversations:,} conversations, {result.train_tokens:,} train and "
        f"{result.val_tokens:,} val tokens, {result.trained_tokens:,} of them in the loss mask",
        highlight=False,
        soft_wrap=True,
    )


tokenizer_app = typer.Typer(
    help="Train your own BPE tokenizer and look at what a tokenizer does.\n\n"
    "Example: nanogpt tokenizer train examples/tinyshakespeare.txt --vocab-size 2048 "
    "--name shk2k",
    rich_markup_mode=None,
)
app.add_typer(tokenizer_app, name="tokenizer")
TOKENIZERS_DIR_HELP = "Folder of trained tokenizers."


@tokenizer_app.callback(invoke_without_command=True)
def _tokenizer_root(ctx: typer.Context):
    if ctx.invoked_subcommand is None:
        print(ctx.get_help())
        raise typer.Exit(0)


def tokenizer_table(result):
    """What tokenizer train made, as a table."""
    from nanogpt_cli.cli.ui import summary_table

    tok = result.tokenizer
    return summary_table(
        f"trained {result.path}",
        [
            ("source", result.source),
            (
                "characters",
                f"{result.characters:,} ({result.documents:,} document{'s' if result.documents != 1 else ''})",
            ),
            (
                "vocabulary size",
                f"{tok.vocab_size:,} (256 bytes, {len(tok.ranks) - 256:,} merges, {len(tok.special_tokens)} special)",
            ),
            ("pattern", tok.pattern_name),
            ("time", f"{result.elapsed_s:.2f} s ({result.chars_per_s / 1e6:,.2f} M characters/s)"),
        ],
    )


@tokenizer_app.command("train")
@one_line_errors
def tokenizer_train(
    source: Source,
    name: Annotated[
        str, typer.Option(help="Tokenizer name: the folder TOKENIZERS_DIR/NAME that --tokenizer NAME reads.")
    ],
    vocab_size: Annotated[
        int, typer.Option(help="Tokens in the vocabulary: 256 bytes + merges + special tokens.")
    ] = 8192,
    pattern: Annotated[
        str, typer.Option(help="Pre-tokenization regex: gpt2, gpt4 (cl100k), gpt4o (o200k) or nanochat.")
    ] = "gpt4",
    special: Annotated[
        list[str] | None,
        typer.Option(
            help="A special token (repeatable; default <|endoftext|>, which always comes first).",
            metavar="<text>",
            show_default=False,
        ),
    ] = None,
    max_chars: Annotated[int | None, typer.Option(help="Train on the first N characters only.")] = None,
    tokenizers_dir: Annotated[Path, typer.Option(help=TOKENIZERS_DIR_HELP)] = Path("tokenizers"),
    text_column: TextColumn = "text",
    subset: Subset = None,
    split: Split = "train",
    streaming: Streaming = False,
    force: Annotated[bool, typer.Option("--force", help="Replace TOKENIZERS_DIR/NAME if it exists.")] = False,
):
    """Train a byte-level BPE tokenizer (Hugging Face tokenizers' trainer; tiktoken encodes with it).

    Example: nanogpt tokenizer train examples/tinyshakespeare.txt --vocab-size 2048 --name shk2k
    """
    from nanogpt_cli.cli.ui import console, prepare_progress
    from nanogpt_cli.data.tokenizer_train import train_tokenizer
    from nanogpt_cli.tokenizer import EOT

    specials = [EOT] + [s for s in (special or []) if s != EOT]
    with prepare_progress() as progress:
        result = train_tokenizer(
            source,
            name,
            vocab_size,
            pattern,
            specials,
            max_chars,
            tokenizers_dir,
            text_column=text_column,
            subset=subset,
            split=split,
            streaming=streaming,
            force=force,
            progress=progress,
        )
    tok = result.tokenizer
    console.print(tokenizer_table(result))
    if tok.vocab_size < result.requested_vocab_size:
        note(
            f"the text ran out of pairs to merge: the vocabulary has {tok.vocab_size:,} tokens, not the "
            f"{result.requested_vocab_size:,} of --vocab-size; train on more text for more"
        )
    console.print(
        f"use it with: nanogpt prepare SOURCE --name DATASET --tokenizer {name}"
        + (f" --tokenizers-dir {tokenizers_dir}" if tokenizers_dir != Path("tokenizers") else ""),
        markup=False,
    )


def _load_tokenizer(name: str, tokenizers_dir: Path):
    from nanogpt_cli.tokenizer import build_tokenizer

    if name == "char":
        raise NanoGPTError(
            "the char tokenizer's vocabulary comes from the text it is prepared from; name a "
            "dataset's tokenizer through its checkpoint instead"
        )
    return build_tokenizer(name, tokenizers_dir=tokenizers_dir)


@tokenizer_app.command("info")
@one_line_errors
def tokenizer_info(
    name: Annotated[str, typer.Argument(help="A trained tokenizer's NAME or folder, or gpt2, byte, cl100k_base.")],
    tokenizers_dir: Annotated[Path, typer.Option(help=TOKENIZERS_DIR_HELP)] = Path("tokenizers"),
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")] = False,
):
    """Describe a tokenizer: vocabulary size, pattern, special tokens, longest tokens.

    Example: nanogpt tokenizer info shk2k
    """
    from nanogpt_cli.cli.ui import console, summary_table
    from nanogpt_cli.tokenizer import BPETokenizer, tokenizer_folder

    tok = _load_tokenizer(name, tokenizers_dir)
    folder = tokenizer_folder(name, tokenizers_dir) if isinstance(tok, BPETokenizer) else None
    info = {"name": tok.name, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id}
    if isinstance(tok, BPETokenizer):
        trained = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8")).get("trained", {})
        longest = sorted(tok.ranks, key=len, reverse=True)[:3]
        info.update(
            path=str(folder),
            pattern=tok.pattern_name or tok.pattern,
            merges=len(tok.ranks) - 256,
            special_tokens=tok.special_tokens,
            trained=trained,
            longest=[t.decode("utf-8", errors="replace") for t in longest],
        )
    if json_out:
        print(json.dumps(info, ensure_ascii=False))
        return
    rows = [
        ("vocabulary size", f"{tok.vocab_size:,}"),
        ("end of text", "none" if tok.eot_id is None else f"id {tok.eot_id}"),
    ]
    if isinstance(tok, BPETokenizer):
        rows += [
            ("folder", info["path"]),
            ("pattern", str(info["pattern"])),
            ("merges", f"{info['merges']:,}"),
            ("special tokens", ", ".join(f"{t} = {i}" for t, i in tok.special_tokens.items())),
            ("longest tokens", "  ".join(repr(t) for t in info["longest"])),
        ]
        if trained:
            rows.append(("trained on", f"{trained.get('source')} ({trained.get('characters', 0):,} characters)"))
    console.print(summary_table(f"tokenizer {tok.name}", rows))


@tokenizer_app.command("encode")
@one_line_errors
def tokenizer_encode(
    name: Annotated[str, typer.Argument(help="A trained tokenizer's NAME or folder, or gpt2, byte, cl100k_base.")],
    text: Annotated[str, typer.Argument(help="The text to encode.")],
    tokenizers_dir: Annotated[Path, typer.Option(help=TOKENIZERS_DIR_HELP)] = Path("tokenizers"),
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of the pieces.")] = False,
):
    """Show the ids a tokenizer gives a text, and the piece of text each one stands for.

    Example: nanogpt tokenizer encode shk2k "ROMEO: What light"
    """
    from nanogpt_cli.tokenizer import BPETokenizer

    tok = _load_tokenizer(name, tokenizers_dir)
    ids = tok.encode_special(text) if isinstance(tok, BPETokenizer) else tok.encode(text)
    pieces = [tok.decode_bytes([i]).decode("utf-8", errors="backslashreplace") for i in ids]
    if json_out:
        print(
            json.dumps(
                {"ids": ids, "pieces": pieces, "tokens": len(ids), "bytes": len(text.encode("utf-8"))},
                ensure_ascii=False,
            )
        )
        return
    print(" ".join(str(i) for i in ids))
    print("|".join(pieces))
    print(
        f"{len(ids):,} tokens for {len(text.encode('utf-8')):,} bytes "
        f"({len(text.encode('utf-8')) / max(len(ids), 1):.2f} bytes per token)"
    )


@app.command()
@config_options
@one_line_errors
def train(
    preset: Annotated[
        str | None,
        typer.Option(
            help="Named config: tiny, cpu-char, cpu-speedrun, cpu-fast, shakespeare-char, gpt2-124m, gpt2-350m."
        ),
    ] = None,
    config: RunConfig = None,
    out: RunOut = None,
    resume: Resume = False,
    force: Force = False,
    init_from: Annotated[
        str | None,
        typer.Option(
            help="Start from these weights (run folder, .safetensors, "
            "Hugging Face folder or hf:NAME) with a fresh optimizer."
        ),
    ] = None,
    quiet: Quiet = False,
    plot: Plot = True,
    last: Last = False,
    threads: Threads = None,
    tracker: Tracker = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Print the whole config at the start.")] = False,
    nproc: Annotated[
        int | None,
        typer.Option(
            help="Train in N processes on this machine (one per GPU, or gloo on the CPU), launched by torch's "
            "elastic launcher.",
            show_default=False,
        ),
    ] = None,
    nnodes: Annotated[int, typer.Option(help="With --nproc: machines taking part, each running this command.")] = 1,
    rdzv_endpoint: Annotated[
        str | None,
        typer.Option(help="With --nnodes: HOST:PORT where the machines meet (the same on each).", show_default=False),
    ] = None,
    flags: dict | None = None,  # the config options given (config_options)
):
    """Train a GPT on a prepared dataset, with checkpoints you can resume.

    Example: nanogpt train --data shakespeare-char --preset cpu-char --out checkpoints/shk
    """
    given = dict(flags or {})
    flags = dict(flags or {}, **({"preset": preset} if preset is not None else {}))
    from nanogpt_cli.config import load_toml
    from nanogpt_cli.device import set_threads
    from nanogpt_cli.training.plan import plan_run
    from nanogpt_cli.training.trackers import open_tracker

    set_threads(threads)

    if nproc is not None and tracker:  # the processes open it; an unknown one or a missing extra is refused here
        open_tracker(tracker).close()
    sink = open_tracker(tracker) if tracker and prints() and nproc is None else None  # refused first, too
    if last and init_from is None:
        raise NanoGPTError("--last picks the weights of --init-from RUN; give --init-from or drop --last")
    if nproc is None and (nnodes != 1 or rdzv_endpoint):
        raise NanoGPTError("--nnodes and --rdzv-endpoint go with --nproc N: the processes on each machine")
    how = None
    if nproc is not None:
        from nanogpt_cli.training.launch import Launch

        how = Launch(nproc, nnodes, rdzv_endpoint)
        if os.environ.get("WORLD_SIZE"):
            raise NanoGPTError("--nproc launches the processes itself; under torchrun drop it")
    from nanogpt_cli.training.finetune import is_finetune_run, plan_finetune

    if resume and out is not None and is_finetune_run(out):  # a LoRA run resumes on its base, with its adapters
        if how is not None:
            raise NanoGPTError(
                f"{out} is a LoRA run, which --nproc does not launch; resume it in one process, or with "
                "torchrun --nproc-per-node N -m nanogpt_cli finetune --out RUN --resume"
            )
        job = plan_finetune(flags, load_toml(config) if config else {}, out=out, resume=True, force=force)
        return run_planned(job.plan, quiet, sink, job.trainable, verbose, plot)
    plan = plan_run(
        flags,
        load_toml(config) if config else {},
        out=out,
        resume=resume,
        force=force,
        init_from=init_from,
        init_last=last,
        world_size=how.world_size if how else None,
    )
    if init_from is not None and plan.dataset.get("masks"):  # the same run as `finetune` without --lora
        from nanogpt_cli.training.finetune import record_full_finetune

        record_full_finetune(plan, init_from)
        plan.notes.append("fine-tuning on a chat dataset: `nanogpt finetune` does the same, and LoRA with --lora")
    if how is not None:  # everything was checked here, before any process starts
        options = dict(preset=preset, config=config, init_from=init_from, threads=threads, tracker=tracker)
        switches = dict(resume=resume, force=force, quiet=quiet, last=last, verbose=verbose, no_plot=not plot)
        return launch_training(plan, how, given, {**options, **switches})
    run_planned(plan, quiet, sink, verbose=verbose, plot=plot)


def run_planned(plan, quiet: bool, sink, trainable=None, verbose: bool = False, plot: bool = True) -> None:
    """Train a planned run with the progress display (and a tracker's sink), then report it: train and finetune."""
    from nanogpt_cli.cli.ui import TrainDisplay
    from nanogpt_cli.training.distributed import open_world
    from nanogpt_cli.training.trackers import Tee
    from nanogpt_cli.training.trainer import Trainer

    if prints():
        for message in plan.notes:
            note(message)
        for change in plan.changes:  # "--learning-rate 0.001 -> 0.0003 from step 723"
            print(change, flush=True)
    if plan.complete:
        if prints():
            say_complete(plan)
        return
    # under torchrun the process group is left only after rank 0 has printed, so no rank ends (and has
    # torchrun stop the others) before
    with open_world(plan.train) as world:
        try:
            with TrainDisplay(quiet or not prints(), verbose) as display:
                result = Trainer(plan, Tee(display, sink) if sink else display, world, trainable=trainable).fit()
        finally:
            if sink is not None:
                sink.close()
        if prints():
            report_training(plan, result, plot)
    if result.stopped in ("SIGINT", "SIGTERM"):
        from nanogpt_cli.training.launch import record_error

        record_error(stopped_line(plan, result))  # every rank: torchrun's report of the stop ends with this line
        raise typer.Exit(130 if result.stopped == "SIGINT" else 143)  # the shell's 128 + signal number


@app.command()
@config_options
@one_line_errors
def finetune(
    init_from: Annotated[
        str | None,
        typer.Option(
            help="The weights to start from: a run folder, a .safetensors file, a Hugging Face folder or hf:NAME "
            "(not needed with --resume).",
            show_default=False,
        ),
    ] = None,
    lora: Annotated[
        bool, typer.Option("--lora", help="Train LoRA adapters on the frozen weights (any --lora-* flag implies it).")
    ] = False,
    lora_r: Annotated[int | None, typer.Option(help="LoRA rank.  [default: 8]", show_default=False)] = None,
    lora_alpha: Annotated[
        float | None, typer.Option(help="LoRA scale: the update is times alpha / r.  [default: 16]", show_default=False)
    ] = None,
    lora_dropout: Annotated[
        float | None, typer.Option(help="Dropout on the adapters' input.  [default: 0]", show_default=False)
    ] = None,
    lora_targets: Annotated[
        str | None,
        typer.Option(
            help="Projections to adapt, comma-separated: attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj, or attn, "
            "mlp, all.  [default: attn.c_attn]",
            show_default=False,
        ),
    ] = None,
    preset: Annotated[
        str | None, typer.Option(help="Named training config (the architecture stays the checkpoint's).")
    ] = None,
    config: RunConfig = None,
    out: RunOut = None,
    resume: Resume = False,
    force: Force = False,
    last: Last = False,
    quiet: Quiet = False,
    threads: Threads = None,
    tracker: Tracker = None,
    plot: Plot = True,
    flags: dict | None = None,  # the config options given (config_options)
):
    """Fine-tune trained weights on a dataset: all of them, or LoRA adapters (--lora). On a chat dataset only the
    assistant's tokens are trained on, and the run keeps the dataset's chat template.

    Example: nanogpt finetune --init-from checkpoints/base --data chats --lora --max-iters 300 --out checkpoints/chat
    """
    from nanogpt_cli.config import load_toml
    from nanogpt_cli.device import set_threads
    from nanogpt_cli.lora import DEFAULT_TARGETS, LoRAConfig
    from nanogpt_cli.training.finetune import plan_finetune
    from nanogpt_cli.training.trackers import open_tracker

    flags = dict(flags or {}, **({"preset": preset} if preset is not None else {}))
    set_threads(threads)
    sink = open_tracker(tracker) if tracker and prints() else None
    given = {"r": lora_r, "alpha": lora_alpha, "dropout": lora_dropout, "targets": lora_targets}
    given = {k: v for k, v in given.items() if v is not None}
    lora_cfg = None  # on --resume without --lora-* values: the run's own
    if given or (lora and not resume):
        targets = given.pop("targets", None)
        lora_cfg = LoRAConfig(**given, targets=(targets,) if targets is not None else DEFAULT_TARGETS)
    job = plan_finetune(
        flags,
        load_toml(config) if config else {},
        out=out,
        resume=resume,
        force=force,
        init_from=init_from,
        init_last=last,
        lora=lora_cfg,
        lora_flags=set(given) | ({"targets"} if lora_targets is not None else set()),
    )
    run_planned(job.plan, quiet, sink, job.trainable, plot=plot)


def stopped_line(plan, result) -> str:
    """How a run stopped by a signal ended, and the command that resumes it (with the launch flags of --nproc)."""
    from nanogpt_cli.training.launch import launch_flags

    resume_with = f"nanogpt train {launch_flags()}--out {plan.run_dir} --resume"
    return f"stopped by {result.stopped} after step {result.step:,}; resume with: {resume_with}"


def launch_training(plan, how, given: dict, options: dict) -> None:
    """train --nproc: the planned run (its refusals already said) in how.world_size processes, each running this
    command without the launch flags (given: the config options given; options: train's own) and with the run
    folder planned here."""
    from nanogpt_cli.training.distributed import rank_device
    from nanogpt_cli.training.launch import launch, train_args

    if plan.complete:
        return say_complete(plan)
    rank_device(plan.train.device, how.nproc - 1)  # --device cuda:N, or more processes than GPUs: one line here
    code = launch(train_args(given, options, plan.run_dir.path), how)
    if code:
        raise typer.Exit(code)


def say_complete(plan) -> None:
    """A run that has nothing left to train: why, and what to raise."""
    from nanogpt_cli.cli.ui import console

    if plan.time_over:
        console.print(
            f"{plan.run_dir} is already complete: its --max-time {plan.time_spent:g} s was spent at "
            f"step {plan.step:,}; raise --max-time to train it further"
        )
    else:
        console.print(
            f"{plan.run_dir} is already complete: step {plan.step:,} of --max-iters "
            f"{plan.train.max_iters:,}; raise --max-iters to train it further"
        )


def report_training(plan, result, plot: bool = True) -> None:
    """The summary table, the loss curves' picture (with the plot extra) and how the run ended."""
    from nanogpt_cli.cli.ui import console, train_table

    console.print(train_table(result))
    if plot:  # the plot extra: a picture of the curves (importing matplotlib and drawing take ~1 s: --no-plot)
        from nanogpt_cli.inspect.plot import write_png

        try:
            write_png([plan.run_dir.path], plan.run_dir.loss_plot_path)
        except NanoGPTError as e:  # said once, here at the end, where it is seen
            note(f"{plan.run_dir.loss_plot_path.name} not drawn: {e}")
    from nanogpt_cli.training.launch import launch_flags

    resume_with = f"nanogpt train {launch_flags()}--out {plan.run_dir} --resume"
    if result.stopped in ("SIGINT", "SIGTERM"):
        fail(stopped_line(plan, result))
    if result.stopped == "stop_at":
        console.print(f"stopped at step {result.step:,} (--stop-at); resume with: {resume_with}")
    if result.stopped == "max_time":
        console.print(f"ended at step {result.step:,}: --max-time {plan.train.max_time:g} s was spent")


def print_samples(sampler, text: str, settings, num_samples: int, stream: bool, json_out: bool = False) -> None:
    """Continue one prompt: the samples printed after it, streamed when asked (or one JSON object each)."""
    from nanogpt_cli.cli.ui import err_console

    ids, cut = sampler.encode_prompt(text)
    if cut:
        err_console.print(
            f"note: the prompt is {len(ids) + cut:,} tokens; its first {cut:,} are cut to fit "
            f"the context of {sampler.block_size:,}",
            soft_wrap=True,
        )
    if json_out:  # one object per sample, for scripts
        for i, r in enumerate(sampler.generate_many([text] * num_samples, settings)):
            record = {"sample": i + 1, "prompt": text, "text": r.text, "tokens": r.tokens}
            record.update(stop_reason=r.stop_reason, tokens_per_s=round(r.tokens_per_s, 1))
            print(json.dumps(record, ensure_ascii=False), flush=True)
        return
    for i, pieces in enumerate(sampler.samples(text, settings, num_samples)):
        if num_samples > 1:  # on stderr: stdout holds the samples' text only
            sys.stdout.flush()
            err_console.rule(f"sample {i + 1} of {num_samples}")
        sys.stdout.write(text)
        for piece in pieces:
            sys.stdout.write(piece)
            if stream:
                sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()


# the sampling options that sample and chat share
Temperature = Annotated[float, typer.Option(help="0 is greedy; lower is more conservative.")]
TopK = Annotated[int, typer.Option(help="Keep only the K most likely tokens (0: off).")]
TopP = Annotated[float, typer.Option(help="Keep the fewest tokens whose probability reaches P (1: off).")]
MinP = Annotated[float, typer.Option(help="Drop tokens below P x the top token's probability (0: off).")]
RepetitionPenalty = Annotated[float, typer.Option(help="Above 1 discourages tokens already present.")]
Seed = Annotated[int, typer.Option(help="Random seed: the same seed gives the same text.")]
Stop = Annotated[list[str] | None, typer.Option(help="End a sample at this text (repeatable).", metavar="<text>")]


@app.command()
@one_line_errors
def sample(
    checkpoint: Checkpoint,
    prompt: Annotated[str | None, typer.Option(help="Text to continue (empty: start a new text).")] = None,
    prompt_file: Annotated[Path | None, typer.Option(help="Read the prompt from this file.")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate per sample.")] = 256,
    temperature: Temperature = 0.8,
    top_k: TopK = 200,
    top_p: TopP = 1.0,
    min_p: MinP = 0.0,
    repetition_penalty: RepetitionPenalty = 1.0,
    num_samples: Annotated[int, typer.Option(help="How many samples (decoded together as one batch).")] = 1,
    seed: Seed = 1337,
    stop: Stop = None,
    ignore_eot: Annotated[bool, typer.Option("--ignore-eot", help="Keep going past the end-of-text token.")] = False,
    stream: Annotated[bool, typer.Option("--stream/--no-stream", help="Print text as it is generated.")] = True,
    json_out: Annotated[
        bool,
        typer.Option("--json", help="One JSON object per sample: text, tokens, stop_reason, tokens_per_s."),
    ] = False,
    last: Last = False,
    interactive: Annotated[
        bool, typer.Option("--interactive", "-i", help="Ask for prompts in a loop (--prompt is the first).")
    ] = False,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Recompute the whole context every token.")] = False,
    device: Device = "auto",
    dtype: DtypeOption = Dtype.auto,
    threads: Threads = None,
):
    """Generate text from a trained model, streamed as it is written.

    Example: nanogpt sample --checkpoint checkpoints/shk --prompt "ROMEO:" --max-new-tokens 200
    """
    from nanogpt_cli.inference.sample import Sampler, SampleSettings

    if prompt is not None and prompt_file is not None:
        raise NanoGPTError("give --prompt or --prompt-file, not both")
    if prompt_file is not None:
        from nanogpt_cli.files import read_text_file

        prompt = read_text_file(prompt_file, "--prompt-file")
    from nanogpt_cli.device import set_threads

    set_threads(threads)
    settings = SampleSettings(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k or None,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        seed=seed,
        stop=stop or [],
        ignore_eot=ignore_eot,
        use_cache=not no_cache,
    )
    sampler = Sampler.load(checkpoint, last=last, device=device, dtype=dtype)
    run = functools.partial(
        print_samples, sampler, settings=settings, num_samples=num_samples, stream=stream, json_out=json_out
    )
    if not interactive:
        return run(prompt or "")
    interactive_loop(run, prompt)


def interactive_loop(run, first: str | None) -> None:
    """sample -i: a prompt at a time until Ctrl-D (or Ctrl-C at the prompt); Ctrl-C while a sample is written
    stops that sample. The shell's prompt comes back on a line of its own."""
    from nanogpt_cli.cli.ui import err_console

    err_console.print("type a prompt and press Enter; Ctrl-D (or Ctrl-C) leaves", highlight=False)
    while True:
        if first is not None:  # --prompt (or --prompt-file) with --interactive is the first prompt
            text, first = first, None
            print(f"prompt> {text}")
        else:
            try:
                text = input("prompt> ")
            except (EOFError, KeyboardInterrupt):
                print(flush=True)  # the shell's prompt on a new line, not after ours
                return
        try:
            run(text)
        except NanoGPTError as e:  # a bad prompt should not end the session
            fail(str(e))
        except KeyboardInterrupt:  # stops this sample, not the session
            print(flush=True)


@app.command()
@one_line_errors
def chat(
    source: Annotated[str, typer.Argument(help="Run folder, .safetensors file, Hugging Face folder or hf:NAME.")],
    system: Annotated[
        str | None, typer.Option(help="A system prompt at the start of the conversation.", show_default=False)
    ] = None,
    max_new_tokens: Annotated[
        int | None, typer.Option(help="Most tokens per reply (default: up to the end of the context).")
    ] = None,
    temperature: Temperature = 0.8,
    top_k: TopK = 200,
    top_p: TopP = 1.0,
    min_p: MinP = 0.0,
    repetition_penalty: RepetitionPenalty = 1.0,
    seed: Seed = 1337,
    stop: Stop = None,
    last: Last = False,
    device: Device = "auto",
    dtype: DtypeOption = Dtype.auto,
    threads: Threads = None,
):
    """Talk to a model in the terminal, formatted with its chat template; /reset, /exit, Ctrl-C stops a reply.

    Example: nanogpt chat checkpoints/count --temperature 0
    """
    from nanogpt_cli.device import set_threads
    from nanogpt_cli.inference.chat import ChatSession
    from nanogpt_cli.inference.sample import SampleSettings

    if max_new_tokens is not None and max_new_tokens < 1:
        raise NanoGPTError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    settings = SampleSettings(
        temperature=temperature,
        top_k=top_k or None,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        seed=seed,
        stop=stop or [],
    )
    set_threads(threads)
    session = ChatSession.load(source, settings, system, max_new_tokens, last=last, device=device, dtype=dtype)
    if session.template.plain:
        note(f"{source} has no chat template (a base model): it gets a plain User:/Assistant: transcript")
    converse(session)


def converse(session) -> None:
    """The terminal loop: a prompt on a terminal (none when stdin is a pipe), each reply streamed on its own line,
    /reset and /exit; Ctrl-C during a reply stops it, Ctrl-C or Ctrl-D at the prompt leaves."""
    tty = sys.stdin.isatty()
    if tty:
        import readline  # noqa: F401  (line editing and history for input())

        print(f"chatting with {session.block_size:,} tokens of context; /reset clears it, /exit or Ctrl-D leaves")
    while True:
        try:
            text = input(">>> " if tty else "")
        except (EOFError, KeyboardInterrupt):
            if tty:
                print()  # the shell's prompt on a line of its own
            return
        command = text.strip()
        if command in ("/exit", "/quit", "/bye"):
            return
        if command == "/reset":
            session.reset()
            note("the conversation is cleared")
            continue
        if command.startswith("/") and command[1:2].isalpha() and " " not in command:
            note(f"unknown command {command}; /reset clears the conversation, /exit leaves")
            continue
        if not command:
            continue
        try:
            reply = session.ask(text)
        except NanoGPTError as e:  # a message too long for the context: the session goes on
            fail(str(e))
            continue
        if reply.first_cut:
            note(
                f"the conversation outgrew the model's context of {session.block_size:,} tokens: "
                "from now on its oldest turns are left out"
            )
        try:
            for piece in reply:
                sys.stdout.write(piece)
                sys.stdout.flush()
            print()
        except KeyboardInterrupt:
            reply.close()
            print()
            note("stopped; the reply so far stays in the conversation")


@app.command()
@one_line_errors
def serve(
    source: Annotated[str, typer.Argument(help="Run folder, .safetensors file, Hugging Face folder or hf:NAME.")],
    host: Annotated[
        str, typer.Option(help="Address to listen on; anything but loopback wants --api-key.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: a free one, printed).")] = 8000,
    max_batch: Annotated[int, typer.Option(help="Rows decoded together (requests and their choices).")] = 8,
    model_name: Annotated[
        str | None, typer.Option(help="The name /v1/models reports (default: the run's).", show_default=False)
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(help="Require 'Authorization: Bearer KEY'.", envvar="NANOGPT_API_KEY", show_default=False),
    ] = None,
    max_tokens: Annotated[int, typer.Option(help="Most tokens one request may ask for, per choice.")] = 4096,
    max_n: Annotated[int, typer.Option(help="Most choices (n) per request.")] = 8,
    max_queue: Annotated[int, typer.Option(help="Most rows waiting for a free row; beyond it, 503.")] = 64,
    max_body: Annotated[int, typer.Option(help="Most bytes in a request body; beyond it, 413.")] = 1_000_000,
    no_ui: Annotated[bool, typer.Option("--no-ui", help="Do not serve the chat page at /.")] = False,
    last: Last = False,
    device: Device = "auto",
    dtype: DtypeOption = Dtype.auto,
    threads: Threads = None,
):
    """Serve a model over the OpenAI API (completions, chat, streaming) with a chat page at /.

    Example: nanogpt serve checkpoints/shk --port 8000
    """
    from nanogpt_cli.device import set_threads
    from nanogpt_cli.serve import ServeOptions, default_model_name, is_loopback
    from nanogpt_cli.serve import serve as run_server

    options = ServeOptions(
        source=source,
        host=host,
        port=port,
        max_batch=max_batch,
        model_name=model_name,
        api_key=api_key,
        device=device,
        dtype=dtype,
        last=last,
        ui=not no_ui,
        max_body=max_body,
        max_tokens=max_tokens,
        max_n=max_n,
        max_queue=max_queue,
    )
    set_threads(threads)
    if not is_loopback(host) and options.api_key is None:
        note(
            f"--host {host} is reachable from other machines and no --api-key is set: anyone who can reach it "
            "can use the model"
        )
    name = options.model_name or default_model_name(source)
    run_server(options, on_ready=lambda url: print(f"serving {name} at {url} (Ctrl-C to stop)", flush=True))


@eval_app.command()
@one_line_errors
def perplexity(
    checkpoint: Checkpoint,
    data: Annotated[str | None, typer.Option(help="A prepared dataset to score.")] = None,
    data_dir: Annotated[Path, typer.Option(help=DATA_DIR_HELP)] = Path("data"),
    split: Annotated[str, typer.Option(help="train or val.")] = "val",
    input: Annotated[
        list[Path] | None, typer.Option(help="Text file(s) to score instead (repeatable).", metavar="<path>")
    ] = None,
    stride: Annotated[int | None, typer.Option(help="Tokens between window starts (default half the context).")] = None,
    batch_size: Annotated[int, typer.Option(help="Windows per forward pass.")] = 32,
    last: Last = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")] = False,
    device: Device = "auto",
    dtype: DtypeOption = Dtype.float32,
    threads: Threads = None,
):
    """Score every token of a dataset split or text files once: loss, perplexity, bits per byte.

    Example: nanogpt eval perplexity --checkpoint checkpoints/shk --data shakespeare-char --split val
    """
    from nanogpt_cli.cli.ui import console, eval_table
    from nanogpt_cli.inference.evaluate import perplexity_of_files, perplexity_of_split
    from nanogpt_cli.interop.loading import load_for_inference

    if (data is None) == (not input):
        raise NanoGPTError("give either --data NAME (with --split) or --input FILE")
    if split not in ("train", "val"):
        raise NanoGPTError(f"--split must be train or val, got {split!r}")
    if batch_size < 1:
        raise NanoGPTError(f"--batch-size must be at least 1, got {batch_size}")
    from nanogpt_cli.device import set_threads

    set_threads(threads)
    loaded = load_for_inference(checkpoint, last=last, device=device, dtype=dtype)
    from nanogpt_cli.cli.ui import eval_progress

    with eval_progress() as progress:  # a bar on a terminal: tokens scored, rate, time left
        if data is not None:
            result = perplexity_of_split(
                loaded.model, loaded.tokenizer, data_dir, data, split, stride, batch_size, progress
            )
        else:
            result = perplexity_of_files(loaded.model, loaded.tokenizer, input, stride, batch_size, progress)
    if json_out:
        print(json.dumps(result.to_dict()))
    else:
        console.print(eval_table(result))


@app.command()
@one_line_errors
def export(
    run: Annotated[
        str,
        typer.Argument(help="Run folder (its best weights), a .safetensors file, a Hugging Face folder or hf:NAME."),
    ],
    out: Annotated[Path, typer.Option(help="Folder to write (hf, peft) or FILE.gguf (gguf).")],
    format: Annotated[
        str,
        typer.Option(
            "--format", help="hf (transformers folder), gguf (llama.cpp file) or peft (a LoRA run's adapter folder)."
        ),
    ] = "hf",
    last: Last = False,
    force: Annotated[bool, typer.Option("--force", help="Replace --out if it exists.")] = False,
    quant: Annotated[
        str | None,
        typer.Option(
            help="gguf: the type of the weight matrices: f32 (default), f16, bf16, q8_0, q5_1, q5_0, q4_1 or q4_0."
        ),
    ] = None,
    merge: Annotated[
        bool, typer.Option("--merge", help="A LoRA run: fold its adapters into its base weights (hf, gguf).")
    ] = False,
    base: Annotated[
        Path | None,
        typer.Option(help="peft: the Hugging Face export of the LoRA run's base, which the adapter is for."),
    ] = None,
):
    """Write a run as a Hugging Face folder or a GGUF file that other tools load.

    Example: nanogpt export checkpoints/shk --format hf --out exports/shk
    """
    from nanogpt_cli.cli.ui import console
    from nanogpt_cli.interop.export import export as export_run

    result = export_run(run, format, out, last=last, force=force, quant=quant, merge=merge, base=base)
    if result.format == "peft":
        console.print(
            f"wrote {result.path} (PEFT LoRA adapter for the {result.architecture} in {base}); load it with "
            f"PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({str(base)!r}), {str(result.path)!r})",
            soft_wrap=True,
            highlight=False,
        )
    elif result.format == "hf":
        console.print(
            f"wrote {result.path} ({result.architecture}, {result.tokenizer} tokenizer); load it with "
            f"AutoModelForCausalLM.from_pretrained({str(result.path)!r})",
            soft_wrap=True,
            highlight=False,
        )
    else:
        size = f"{result.bytes / 1e6:,.2f} MB"
        if result.quant != "f32":
            ratio = result.f32_bytes / max(result.bytes, 1)
            size += f", {ratio:.1f}x smaller than float32 ({result.f32_bytes / 1e6:,.2f} MB)"
        console.print(
            f"wrote {result.path} (GGUF, {result.architecture}, {result.tokenizer} tokenizer, {result.quant}: {size})",
            soft_wrap=True,
            highlight=False,
        )


@app.command()
@one_line_errors
def runs(
    folder: Annotated[Path, typer.Argument(help="A folder of run folders (or one run).")] = Path("checkpoints"),
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object per run instead of a table.")] = False,
):
    """List the runs in a folder: dataset, size, progress, best val loss, last update, status.

    Example: nanogpt runs checkpoints
    """
    from nanogpt_cli.cli.ui import console, runs_table
    from nanogpt_cli.inspect.catalog import list_runs

    found = list_runs(folder)
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


@app.command()
@one_line_errors
def info(
    path: Annotated[Path, typer.Argument(help="A run folder, a .safetensors weights file or a .gguf export.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
):
    """Describe a run or weights file: config, parameters, FLOPs per token, tokenizer, losses, files.

    Example: nanogpt info checkpoints/shk
    """
    from nanogpt_cli.cli.ui import console, info_table
    from nanogpt_cli.inspect.catalog import inspect_path

    result = inspect_path(path)
    if json_out:
        print(json.dumps(result.to_dict()))
    else:
        console.print(info_table(result))


@app.command()
@one_line_errors
def plot(
    runs: Annotated[list[Path], typer.Argument(help="Run folders to draw (one or more).")],
    out: Annotated[
        Path | None, typer.Option(help="Write a .png/.svg/.pdf here instead of drawing in the terminal.")
    ] = None,
):
    """Draw train and val loss against tokens seen, for one or several runs.

    Example: nanogpt plot checkpoints/shk checkpoints/shk-wsd --out loss.png
    """
    from nanogpt_cli.cli.ui import console
    from nanogpt_cli.inspect.plot import terminal_plot, write_png

    if out is not None:
        from nanogpt_cli.files import check_creatable

        check_creatable(out.parent if str(out.parent) else Path("."), "the folder of --out")
        console.print(f"wrote {write_png(runs, out)}")
    else:
        print(terminal_plot(runs, width=min(console.width, 100), height=20, color=console.is_terminal))


# --- inspect: attention maps, head roles and position schemes (library: nanogpt_cli/inspect/) ---

inspect_app = typer.Typer(
    help="Look inside a trained model: attention maps, what each head does, positions.\n\n"
    "Example: nanogpt inspect heads checkpoints/shk",
    rich_markup_mode=None,
)
app.add_typer(inspect_app, name="inspect")
InspectSource = Annotated[
    str,
    typer.Argument(
        help="Run folder (its best weights), a .safetensors file, or a Hugging Face model folder or hf:NAME."
    ),
]
Size = Annotated[
    str | None,
    typer.Option(help="Picture size in pixels, WIDTHxHEIGHT (default: fits the labels).", show_default=False),
]


@inspect_app.callback(invoke_without_command=True)
def _inspect_root(ctx: typer.Context):
    if ctx.invoked_subcommand is None:
        print(ctx.get_help())
        raise typer.Exit(0)


def _inspect_load(source: str, last: bool, device: str, dtype: Dtype, threads: int | None):
    from nanogpt_cli.device import set_threads
    from nanogpt_cli.inspect import display_name
    from nanogpt_cli.interop.loading import load_for_inference

    set_threads(threads)
    loaded = load_for_inference(source, last=last, device=device, dtype=dtype)
    return loaded, display_name(source, loaded.meta)


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


@inspect_app.command("attention")
@one_line_errors
def inspect_attention(
    source: InspectSource,
    prompt: Annotated[str | None, typer.Option(help="Text whose attention to draw.")] = None,
    prompt_file: Annotated[Path | None, typer.Option(help="Read the prompt from this file.")] = None,
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
    last: Last = False,
    device: Device = "auto",
    dtype: DtypeOption = Dtype.float32,
    threads: Threads = None,
):
    """Draw every layer's and head's attention over a prompt's tokens as a grid of heatmaps.

    Example: nanogpt inspect attention checkpoints/shk --prompt "ROMEO: But soft" --out attention.png
    """
    from nanogpt_cli.cli.ui import console, err_console
    from nanogpt_cli.inspect.attention import attention_maps, check_selection
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
    loaded, name = _inspect_load(source, last, device, dtype, threads)
    check_selection(loaded.model.config.n_layer, loaded.model.config.n_head, layer, head)
    maps = attention_maps(loaded, text, source=source, name=name)
    if maps.cut:
        note(
            f"the prompt is {len(maps.ids) + maps.cut:,} tokens; its first {maps.cut:,} are cut to fit the context "
            f"of {loaded.block_size:,}"
        )
    if out is not None:
        written = draw_attention(maps, out, layer=layer, head=head, size=pixels, max_tokens=max_tokens)
        (err_console if json_out else console).print(f"wrote {written}", highlight=False, soft_wrap=True)
    if json_out:
        print(json.dumps(maps.to_dict()))


@inspect_app.command("heads")
@one_line_errors
def inspect_heads(
    source: InspectSource,
    plot: Annotated[
        Path | None,
        typer.Option(help="Also draw the scores as layers x heads grids (.png, .svg, .pdf).", show_default=False),
    ] = None,
    prompt: Annotated[
        str | None,
        typer.Option(help="Measure previous-token, first-token and distance on this text instead of random tokens."),
    ] = None,
    prompt_file: Annotated[Path | None, typer.Option(help="Read that text from this file.")] = None,
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
    last: Last = False,
    device: Device = "auto",
    dtype: DtypeOption = Dtype.float32,
    threads: Threads = None,
):
    """Score every head on standard probes and name what it does: previous-token, induction, sink, local, mixed.

    Example: nanogpt inspect heads checkpoints/shk --plot heads.png
    """
    from nanogpt_cli.cli.ui import console, err_console
    from nanogpt_cli.inspect import heads_table, score_heads
    from nanogpt_cli.inspect.draw import draw_heads, parse_size

    text = _inspect_prompt(prompt, prompt_file)
    pixels = parse_size(size) if size is not None else None
    if plot is not None:
        _inspect_target(plot)
    loaded, name = _inspect_load(source, last, device, dtype, threads)
    report = score_heads(loaded, source=source, name=name, length=length, seed=seed, prompt=text)
    if json_out:
        print(json.dumps(report.to_dict()))
    else:
        console.print(heads_table(report))
    if plot is not None:
        written = draw_heads(report, plot, size=pixels)
        (err_console if json_out else console).print(f"wrote {written}", highlight=False, soft_wrap=True)


@inspect_app.command("positions")
@one_line_errors
def inspect_positions(
    source: InspectSource,
    out: Annotated[Path, typer.Option(help="Picture to write (.png, .svg or .pdf).")] = Path("positions.png"),
    size: Size = None,
    last: Last = False,
):
    """Draw the model's position scheme: the sinusoidal or learned table, or RoPE's rotation frequencies.

    Example: nanogpt inspect positions checkpoints/shk --out positions.png
    """
    from nanogpt_cli.cli.ui import console
    from nanogpt_cli.inspect import position_views
    from nanogpt_cli.inspect.draw import draw_positions, parse_size

    pixels = parse_size(size) if size is not None else None
    _inspect_target(out)
    loaded, name = _inspect_load(source, last, "cpu", "float32", None)
    views = position_views(loaded.model)
    console.print(views.summary, highlight=False, soft_wrap=True)
    console.print(f"wrote {draw_positions(views, name, out, size=pixels)}", highlight=False, soft_wrap=True)


def main():
    """The console script. Typer runs in click's non-standalone mode so that a usage error (unknown option, bad
    value, missing argument) becomes the same one line and exit code 1 as every other error, not a panel and 2."""
    try:
        code = app(standalone_mode=False)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except typer.Abort:
        print("aborted", file=sys.stderr)
        raise SystemExit(1) from None
    except Exception as e:
        if not (callable(getattr(e, "format_message", None)) and hasattr(e, "exit_code")):
            raise  # not a usage error: a bug, shown as a traceback
        ctx = getattr(e, "ctx", None)
        hint = f"; see {ctx.command_path} --help" if ctx is not None else ""
        message = " ".join(e.format_message().split()).rstrip(".")
        fail(f"{message[:1].lower()}{message[1:]}{hint}")
        raise SystemExit(1) from None
    raise SystemExit(code if isinstance(code, int) else 0)
