"""Tokenizer tables: prepare --compare (how many tokens each tokenizer makes of a text; library:
api.compare_tokenizers) and the summary of `tokenizer train`.

nanogpt prepare my_corpus.txt --compare
"""

from __future__ import annotations

from typing import Annotated

import typer

from nanogpt_cli.errors import NanoGPTError

Name = Annotated[
    str | None,
    typer.Option(help="Dataset name: the folder DATA_DIR/NAME that training reads.  [required unless --compare]"),
]
Compare = Annotated[
    bool,
    typer.Option(
        "--compare",
        help="Only say how many tokens each tokenizer makes of the text (char, byte, gpt2, BPEs of 1k, 4k and 16k "
        "tokens), counted on its first million characters; prepares nothing.",
    ),
]


def say_tokenizer_counts(source: str, text_column: str, encoding: str, compare: bool) -> None:
    if not compare:
        raise NanoGPTError("prepare needs --name: the dataset to write (or --compare, to count tokens only)")
    tokenizer_counts(source, text_column, encoding)


def tokenizer_counts(source: str, text_column: str, encoding: str) -> None:
    """Each tokenizer's tokens for the text, as a table, and how to make the BPEs it names."""
    from rich.table import Table

    from nanogpt_cli import api
    from nanogpt_cli.cli.ui import console

    found = api.compare_tokenizers(source, text_column=text_column, encoding=encoding)
    counted = "all of it" if found.whole else f"its first {found.sample_chars:,} characters, scaled to the whole"
    table = Table(title=f"tokens of {source} ({counted})", title_justify="left")
    for column in ("tokenizer", "vocabulary", "tokens", "bytes per token"):
        table.add_column(column, justify="left" if column == "tokenizer" else "right")
    for row in found.rows:
        table.add_row(row.name, f"{row.vocab_size:,}", f"{row.tokens:,}", f"{row.bytes_per_token:.2f}")
    console.print(table)
    console.print(
        "bpe N: nanogpt tokenizer train SOURCE --vocab-size N --name NAME, then prepare --tokenizer NAME. Fewer "
        "tokens carry more text per step, but a larger vocabulary costs a larger embedding and head: for a short "
        "--max-time a BPE of a few thousand tokens is usually best (--preset auto notes a head too large)",
        highlight=False,
    )


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
