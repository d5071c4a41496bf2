"""prepare and tokenizer: datasets and vocabularies (library: data/).

nanogpt prepare examples/tinyshakespeare.txt --name shakespeare-char --tokenizer char
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from nanogpt_cli import api
from nanogpt_cli.cli.common import DATA_DIR_HELP, note, one_line_errors, stopped
from nanogpt_cli.cli.distill import teacher_options
from nanogpt_cli.cli.tokens import Compare, Name, say_tokenizer_counts, tokenizer_table
from nanogpt_cli.errors import NanoGPTError

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
        help="text; chat: a .jsonl of conversations (messages, prompt/completion or Alpaca rows) rendered with "
        "a chat template, with a loss mask on the assistant's tokens; preference: prompt/chosen/rejected rows "
        "(strings or messages) for finetune --method dpo; prompts: prompt rows with an answer for --method grpo.",
    ),
]
ChatTemplateFile = Annotated[
    Path | None,
    typer.Option(
        help="A Jinja chat template file for --format chat, preference or prompts (the default needs no new tokens)."
    ),
]
Strict = Annotated[
    bool,
    typer.Option(
        "--strict", help="With --format chat, preference or prompts, stop at the first bad row instead of skipping it."
    ),
]
TokenizersDir = Annotated[Path, typer.Option(help="Folder of trained tokenizers (the NAMEs --tokenizer takes).")]
TokenizerName = Annotated[
    str,
    typer.Option(
        help="gpt2, char, byte, a tiktoken encoding such as cl100k_base, hf:NAME or a tokenizer.json (or its "
        "folder), or a tokenizer trained by "
        "`nanogpt tokenizer train` (NAME or folder)."
    ),
]


@one_line_errors
@teacher_options
def prepare(
    source: Source,
    name: Name = None,
    tokenizer: TokenizerName = "gpt2",
    val_fraction: Annotated[
        float, typer.Option(help="Share held out for validation: the tail of one text, or every (1/f)-th document.")
    ] = 0.1,
    data_dir: Annotated[Path, typer.Option(help=DATA_DIR_HELP)] = Path("data"),
    tokenizers_dir: TokenizersDir = Path("tokenizers"),
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
    compare: Compare = False,
):
    """Tokenize text into DATA_DIR/NAME: train-00000.bin, ..., val-00000.bin, ... and meta.json.

    Example: nanogpt prepare shakespeare --name shakespeare-char --tokenizer char
    """
    from nanogpt_cli.cli.ui import console, prepare_progress, prepare_table

    if compare or name is None:  # counting only, or no dataset named
        return say_tokenizer_counts(source, text_column, encoding, compare)
    replacing = (data_dir / name / "meta.json").is_file() and not resume  # --resume continues, not replaces
    where = dict(tokenizer=tokenizer, data_dir=data_dir, tokenizers_dir=tokenizers_dir, format=format)
    if format != "text":
        rows = dict(chat_template=chat_template, val_fraction=val_fraction, strict=strict)
        result = api.prepare(
            source, name, **where, **rows, **({"shard_tokens": shard_tokens} if format == "chat" else {})
        )
        return say_rows(result, format)
    try:
        with prepare_progress() as progress:
            result = api.prepare(
                source,
                name,
                **where,
                val_fraction=val_fraction,
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
    except KeyboardInterrupt as stop:  # the partial prepare is kept (api.PrepareStopped says where)
        kept = getattr(stop, "kept", None)
        raise stopped(f"interrupted; {kept}" if kept else "interrupted") from None
    console.print(prepare_table(result))
    if replacing:  # said after the table, where it is seen: runs trained on the old data see the new
        console.print(
            f"replaced the dataset that was in {result.path}; runs trained on it continue on the new data when resumed"
        )


def say_rows(result, fmt: str) -> None:
    """prepare --format chat, preference or prompts: the rows skipped, and what was written."""
    from nanogpt_cli.cli.ui import console

    for line, why in result.bad[:20]:
        console.print(f"skipped line {line}: {why}", highlight=False, soft_wrap=True)
    if result.bad:
        console.print(f"skipped {len(result.bad):,} bad rows (--strict stops at the first)", highlight=False)
    if fmt == "chat":
        said = (
            f"{result.conversations:,} conversations, {result.train_tokens:,} train and {result.val_tokens:,} val "
            f"tokens, {result.trained_tokens:,} of them in the loss mask"
        )
    else:
        what = "pairs" if fmt == "preference" else "prompts"
        said = f"{result.rows:,} {what}, {result.train_rows:,} train and {result.val_rows:,} val"
    console.print(f"{result.path}: {said}", highlight=False, soft_wrap=True)


tokenizer_app = typer.Typer(
    help="Train your own BPE tokenizer and look at what a tokenizer does.\n\n"
    "Example: nanogpt tokenizer train examples/tinyshakespeare.txt --vocab-size 2048 "
    "--name shk2k",
    rich_markup_mode=None,
)


@tokenizer_app.command("train", short_help="Train a byte-level BPE tokenizer on text.")
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
    tokenizers_dir: TokenizersDir = Path("tokenizers"),
    text_column: TextColumn = "text",
    subset: Subset = None,
    split: Split = "train",
    streaming: Streaming = False,
    force: Annotated[bool, typer.Option("--force", help="Replace TOKENIZERS_DIR/NAME if it exists.")] = False,
):
    """Train a byte-level BPE tokenizer (Hugging Face tokenizers' trainer; tiktoken encodes with it).

    Example: nanogpt tokenizer train examples/tinyshakespeare.txt --vocab-size 2048 --name shk2k
    """
    from nanogpt_cli import api
    from nanogpt_cli.cli.ui import console, prepare_progress

    with prepare_progress() as progress:
        result = api.train_tokenizer(
            source,
            name,
            vocab_size=vocab_size,
            pattern=pattern,
            special_tokens=special,
            max_chars=max_chars,
            tokenizers_dir=tokenizers_dir,
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


@tokenizer_app.command("info", short_help="Describe a tokenizer: vocabulary, pattern, special tokens.")
@one_line_errors
def tokenizer_info(
    name: Annotated[str, typer.Argument(help="A trained tokenizer's NAME or folder, or gpt2, byte, cl100k_base.")],
    tokenizers_dir: TokenizersDir = Path("tokenizers"),
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
    if getattr(tok, "kind", None) == "hf":  # a Hugging Face tokenizer.json: what it starts and ends a text with
        info.update(
            path=str(tok.folder), bos_id=tok.bos_id, stop_ids=list(tok.stop_ids), chat_template=bool(tok.chat_template)
        )
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
    if "stop_ids" in info:
        rows += [
            ("folder", info["path"]),
            ("start of text", "none" if tok.bos_id is None else f"id {tok.bos_id}"),
            ("end of a reply", ", ".join(f"{tok.token_text(i)} = {i}" for i in tok.stop_ids) or "none"),
            ("chat template", "yes" if tok.chat_template else "none"),
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


@tokenizer_app.command("encode", short_help="Show the ids a tokenizer gives a text.")
@one_line_errors
def tokenizer_encode(
    name: Annotated[str, typer.Argument(help="A trained tokenizer's NAME or folder, or gpt2, byte, cl100k_base.")],
    text: Annotated[str, typer.Argument(help="The text to encode.")],
    tokenizers_dir: TokenizersDir = Path("tokenizers"),
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of the pieces.")] = False,
):
    """Show the ids a tokenizer gives a text, and the piece of text each one stands for.

    Example: nanogpt tokenizer encode shk2k "ROMEO: What light"
    """

    tok = _load_tokenizer(name, tokenizers_dir)
    ids = tok.encode_special(text) if hasattr(tok, "encode_special") else tok.encode(text)
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
