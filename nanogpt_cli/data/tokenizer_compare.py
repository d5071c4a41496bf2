"""How many tokens each tokenizer makes of a corpus, to choose one before preparing it: char, byte, gpt2 and BPEs
trained to a few sizes, counted on a sample of the text and scaled to the whole.

    counts = compare_tokenizers("my_corpus.txt"); [(c.name, c.tokens) for c in counts.rows]

Cheap on purpose: at most `sample_chars` characters are read; each BPE is trained on the sample's first half and
counted on its second (text it has not seen, as the rest of the corpus is to it).
"""

from __future__ import annotations

from dataclasses import dataclass

from nanogpt_cli.errors import NanoGPTError

BPE_SIZES = (1024, 4096, 16384)
SAMPLE_CHARS = 1_000_000


@dataclass
class TokenizerCount:
    name: str  # as --tokenizer takes it; "bpe N": what `tokenizer train --vocab-size N` makes
    vocab_size: int
    tokens: int  # over the whole corpus, estimated from the sample where only a sample was read
    bytes_per_token: float


@dataclass
class TokenizerComparison:
    rows: list[TokenizerCount]
    sample_chars: int  # characters counted
    whole: bool  # the sample is the whole corpus (else the counts are scaled by its bytes)
    scale: float  # the corpus's bytes over the sample's


def compare_tokenizers(
    source: str,
    sizes: tuple[int, ...] = BPE_SIZES,
    sample_chars: int = SAMPLE_CHARS,
    text_column: str = "text",
    encoding: str = "utf-8",
) -> TokenizerComparison:
    """The token count of each tokenizer on `source` (any local source `prepare` reads)."""
    from nanogpt_cli.data.sources import open_source
    from nanogpt_cli.tokenizer import build_tokenizer, train_bpe

    with open_source(source, text_column, encoding=encoding) as src:
        parts, read, docs = [], 0, 0
        pieces = src.pieces(lambda n: None)
        try:
            for text, ends in pieces:
                text = text[: sample_chars - read]
                parts.append(text)
                read += len(text)
                docs += bool(ends)
                if read >= sample_chars:
                    break
        finally:
            pieces.close()
        total, unit = src.total, src.unit
    sample = "".join(parts)
    if not sample:
        raise NanoGPTError(f"{source} has no text to count")
    sample_bytes = len(sample.encode("utf-8"))
    whole = read < sample_chars
    scale = 1.0 if whole or unit != "bytes" or not total else total / sample_bytes

    def row(name: str, vocab: int, tokens: float, on_bytes: int) -> TokenizerCount:
        return TokenizerCount(name, vocab, round(tokens * scale), on_bytes / max(tokens, 1))

    rows = [
        row("char", len(set(sample)) + 1, len(sample), sample_bytes),
        row("byte", 257, sample_bytes, sample_bytes),
        row("gpt2", 50257, len(build_tokenizer("gpt2").encode(sample)), sample_bytes),
    ]
    half = len(sample) // 2
    seen, unseen = sample[:half], sample[half:]
    unseen_bytes = len(unseen.encode("utf-8"))
    for size in sizes:
        bpe = train_bpe([seen], size, f"bpe-{size}")
        per_byte = len(bpe.encode(unseen)) / max(unseen_bytes, 1)
        rows.append(
            row(
                f"bpe {size:,} (tokenizer train --vocab-size {size})",
                bpe.vocab_size,
                per_byte * sample_bytes,
                sample_bytes,
            )
        )
    return TokenizerComparison(rows, len(sample), whole, scale)
