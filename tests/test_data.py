"""prepare(): sources, the train/val split, dtypes, atomic replacement, the Tiny Shakespeare download."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from nanogpt_cli import data
from nanogpt_cli.data import (
    load_meta,
    open_split,
    pipeline,
    prepare,
    shards,
    sources,
    token_dtype,
    tokenizing,
)
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.tokenizer import tokenizer_from_description
from conftest import make_text, tiny_plan


def read_split(data_dir: Path, name: str, split: str) -> list[int]:
    return np.concatenate(list(open_split(data_dir, name, split))).tolist()


def tokenizer_of(data_dir: Path, name: str):
    return tokenizer_from_description(load_meta(data_dir, name)["tokenizer"])


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def test_token_dtype():
    assert token_dtype(256) == token_dtype(50257) == token_dtype(65536) == "uint16"
    assert token_dtype(65537) == token_dtype(200019) == "uint32"


def test_one_text_is_split_head_and_tail_and_matches_tiktoken(text_file, sample_text, data_dir, tiktoken_gpt2):
    result = prepare(str(text_file), "play", tokenizer="gpt2", data_dir=data_dir)
    expected = tiktoken_gpt2.encode_ordinary(sample_text)
    train, val = read_split(data_dir, "play", "train"), read_split(data_dir, "play", "val")
    assert train + val == expected  # one document: no separator anywhere, the tail is val
    assert len(val) == round(0.1 * len(expected))
    meta = load_meta(data_dir, "play")
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 50257 and meta["tokenizer"]["name"] == "gpt2"
    assert (meta["train_tokens"], meta["val_tokens"]) == (len(train), len(val))
    assert (meta["documents"], meta["characters"]) == (1, len(sample_text))
    assert meta["source_sha256"] == hashlib.sha256(text_file.read_bytes()).hexdigest()
    assert meta["version"] and meta["created"]
    assert (data_dir / "play" / "train-00000.bin").stat().st_size == 2 * len(train)
    assert result.train_tokens == len(train) and result.bytes_on_disk == sum(
        p.stat().st_size for p in (data_dir / "play").iterdir()
    )
    assert sorted(p.name for p in data_dir.iterdir()) == ["play"]


def test_reading_in_small_pieces_gives_the_same_tokens(monkeypatch, tmp_path, data_dir, tiktoken_gpt2):
    # the file is read and tokenized in pieces; cutting only at safe line breaks keeps BPE's result exact
    text = make_text(lines=400, seed=1) + "tail   \n\n  with spaces  \r\n"
    path = tmp_path / "long.txt"
    path.write_text(text, encoding="utf-8", newline="")
    monkeypatch.setattr(sources, "READ_BYTES", 64)
    monkeypatch.setattr(tokenizing, "BATCH_CHARS", 300)
    prepare(str(path), "pieces", tokenizer="gpt2", data_dir=data_dir, num_proc=2)
    assert read_split(data_dir, "pieces", "train") + read_split(
        data_dir, "pieces", "val"
    ) == tiktoken_gpt2.encode_ordinary(text)


def test_char_vocabulary_and_round_trip(text_file, sample_text, data_dir):
    result = prepare(str(text_file), "chars", tokenizer="char", val_fraction=0.25, data_dir=data_dir)
    tok = tokenizer_of(data_dir, "chars")
    assert tok.chars == "".join(sorted(set(sample_text)))
    assert result.vocab_size == len(set(sample_text)) and result.tokens == len(sample_text)
    assert tok.decode(read_split(data_dir, "chars", "train") + read_split(data_dir, "chars", "val")) == sample_text
    assert result.val_tokens == round(0.25 * len(sample_text))


def test_uint32_when_the_vocabulary_needs_it(tmp_path, data_dir):
    # more than 65,536 distinct characters: a char vocabulary that does not fit in uint16
    text = "".join(chr(c) for c in range(0x21, 0x21 + 70_000) if not 0xD800 <= c <= 0xDFFF)
    path = tmp_path / "unicode.txt"
    path.write_text(text, encoding="utf-8")
    result = prepare(str(path), "wide", tokenizer="char", data_dir=data_dir)
    assert result.dtype == "uint32" and result.vocab_size == len(text) > 65536
    val = open_split(data_dir, "wide", "val").shard(0)  # the tail holds the highest code points, so the highest ids
    assert val.dtype == np.uint32 and val.max() == len(text) - 1 > 65535
    tok = tokenizer_of(data_dir, "wide")
    assert tok.decode(read_split(data_dir, "wide", "train") + val.tolist()) == text


def test_jsonl_documents_are_split_by_document(tmp_path, data_dir):
    docs = [f"document {i}: " + make_text(lines=3, seed=i) for i in range(20)]
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": d, "id": i} for i, d in enumerate(docs)])
    result = prepare(str(path), "docs", tokenizer="gpt2", data_dir=data_dir)
    tok = tokenizer_of(data_dir, "docs")
    eot = tok.eot_id
    # every 10th document validates (9 and 19); documents are separated by <|endoftext|>
    val_docs, train_docs = [docs[9], docs[19]], [d for i, d in enumerate(docs) if i not in (9, 19)]
    train, val = read_split(data_dir, "docs", "train"), read_split(data_dir, "docs", "val")
    assert train == [t for j, d in enumerate(train_docs) for t in ([eot] if j else []) + tok.encode(d)]
    assert val == [t for d in val_docs for t in [eot] + tok.encode(d)]
    assert (result.documents, result.val_documents) == (20, 2)
    assert load_meta(data_dir, "docs")["val_split"] == "documents"


def test_progress_of_a_jsonl_file_is_in_bytes_as_for_text_files(tmp_path):
    """A .jsonl counts the UTF-8 bytes of its rows' text as it reads them (not characters: three bytes each
    here), and the rest of the file (its JSON) at the end, like a text file its bytes: its bar moves with the file
    and its MB/s are megabytes."""
    docs = ["東京の夜 " * 50 + str(i) for i in range(30)]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
    ticks = []
    with sources.open_source(str(path)) as src:
        assert src.unit == "bytes" and src.total == path.stat().st_size
        assert [text for text, _ in src.pieces(ticks.append)] == docs
    assert sum(ticks[:-1]) == sum(len(d.encode("utf-8")) for d in docs) and sum(ticks) == path.stat().st_size


def test_few_documents_still_give_validation_one(tmp_path, data_dir):
    path = write_jsonl(
        tmp_path / "few.jsonl", [{"text": "alpha beta"}, {"text": "gamma delta"}, {"text": "epsilon zeta eta"}]
    )
    result = prepare(str(path), "few", tokenizer="byte", data_dir=data_dir)
    # the last document would be 44 % of the bytes: the tail of the stream (10 %) validates instead
    assert result.val_documents == 1 and result.val_split == "tail"
    assert bytes(read_split(data_dir, "few", "val")) == b" eta"
    assert bytes(read_split(data_dir, "few", "train")) == b"alpha beta\n\ngamma delta\n\nepsilon zeta"


def test_parquet_with_another_text_column_skips_missing_rows(tmp_path, data_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"body": ["one", None, "two", "three", ""], "n": [1, 2, 3, 4, 5]}), path)
    result = prepare(str(path), "pq", tokenizer="char", val_fraction=0.5, data_dir=data_dir, text_column="body")
    tok = tokenizer_of(data_dir, "pq")
    assert result.documents == 3  # None and "" are not documents
    assert tok.decode(read_split(data_dir, "pq", "train")) == "one\n\nthree"
    assert tok.decode(read_split(data_dir, "pq", "val")) == "\n\ntwo"


def test_csv_source(tmp_path, data_dir):
    path = tmp_path / "rows.csv"
    path.write_text('text,label\n"first, row",1\nsecond row,0\nthird row,1\n', encoding="utf-8")
    result = prepare(str(path), "csv", tokenizer="byte", data_dir=data_dir)
    assert result.documents == 3 and result.characters == len("first, rowsecond rowthird row")


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_structured_files_in_another_encoding(suffix, tmp_path, data_dir):
    rows = ["caf\xe9 cr\xe8me \u20ac2", "\u201cquoted\u201d \u2014 na\xefve", "stra\xdfe"]
    path = tmp_path / f"rows{suffix}"
    lines = ["text"] + rows if suffix == ".csv" else [json.dumps({"text": r}, ensure_ascii=False) for r in rows]
    path.write_bytes("".join(line + "\n" for line in lines).encode("cp1252"))
    result = prepare(str(path), "rows", tokenizer="byte", data_dir=data_dir, encoding="cp1252")
    stream = bytes(read_split(data_dir, "rows", "train") + read_split(data_dir, "rows", "val"))
    assert result.documents == 3 and stream.decode("utf-8") == "\n\n".join(rows)  # the byte tokenizer sees UTF-8
    assert load_meta(data_dir, "rows")["encoding"] == "cp1252"


def test_folder_and_glob_sources(tmp_path, data_dir):
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    for i, rel in enumerate(["a.txt", "b.md", "sub/c.txt"]):
        (folder / rel).write_text(make_text(lines=12, seed=i), encoding="utf-8")
    (folder / "notes.log").write_text("not picked up from a folder")
    (folder / ".hidden.txt").write_text("hidden files are skipped")
    from_folder = prepare(str(folder), "folder", tokenizer="gpt2", val_fraction=0.3, data_dir=data_dir)
    assert from_folder.documents == 3 and from_folder.val_documents == 1
    from_glob = prepare(str(folder / "**" / "*.txt"), "glob", tokenizer="gpt2", val_fraction=0.5, data_dir=data_dir)
    assert from_glob.documents == 2


def test_max_docs_and_num_proc(tmp_path, data_dir):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": make_text(lines=4, seed=i)} for i in range(30)])
    one = prepare(str(path), "first", tokenizer="gpt2", data_dir=data_dir, max_docs=10)
    assert one.documents == 10
    two = prepare(str(path), "threads", tokenizer="gpt2", data_dir=data_dir, max_docs=10, num_proc=2)
    assert read_split(data_dir, "first", "train") == read_split(data_dir, "threads", "train")
    assert two.val_tokens == one.val_tokens


def test_byte_tokenizer_reads_any_bytes(tmp_path, data_dir):
    raw = bytes(range(256)) * 8
    path = tmp_path / "blob.bin"
    path.write_bytes(raw)
    prepare(str(path), "raw", tokenizer="byte", data_dir=data_dir)
    assert bytes(read_split(data_dir, "raw", "train") + read_split(data_dir, "raw", "val")) == raw


def test_a_new_prepare_replaces_the_old_one(tmp_path, data_dir):
    first, second = tmp_path / "first.txt", tmp_path / "second.txt"
    first.write_text(make_text(seed=1))
    second.write_text(make_text(seed=2))
    prepare(str(first), "same", tokenizer="char", data_dir=data_dir)
    prepare(str(second), "same", tokenizer="char", data_dir=data_dir)
    tok = tokenizer_of(data_dir, "same")
    assert tok.decode(read_split(data_dir, "same", "train") + read_split(data_dir, "same", "val")) == make_text(seed=2)
    assert sorted(p.name for p in data_dir.iterdir()) == ["same"]


@pytest.mark.parametrize("failure", ["bad jsonl line", "bad file in a folder", "interrupted"])
def test_a_failed_prepare_keeps_the_old_data(failure, tmp_path, text_file, data_dir):
    prepare(str(text_file), "keep", tokenizer="gpt2", data_dir=data_dir)
    before = snapshot(data_dir / "keep")
    progress = None
    if failure == "bad jsonl line":
        source = tmp_path / "docs.jsonl"
        source.write_text('{"text": "fine"}\n' * 3000 + '{"text": broken\n', encoding="utf-8")
        error = pytest.raises(NanoGPTError, match="could not read")
    elif failure == "bad file in a folder":
        source = tmp_path / "texts"
        source.mkdir()
        (source / "a.txt").write_text(make_text())
        (source / "b.txt").write_bytes(b"valid start \xff\xfe then not UTF-8")
        error = pytest.raises(NanoGPTError, match=r"b.txt is not UTF-8 text")
    else:
        source = text_file

        def progress(p):
            raise KeyboardInterrupt  # before any shard is complete: nothing is kept to resume from

        error = pytest.raises(KeyboardInterrupt)
    with error:
        prepare(str(source), "keep", tokenizer="gpt2", data_dir=data_dir, progress=progress)
    assert snapshot(data_dir / "keep") == before
    assert sorted(p.name for p in data_dir.iterdir()) == ["keep"]  # no temporary folder left behind


def test_a_failed_first_prepare_writes_nothing(tmp_path, data_dir):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    with pytest.raises(NanoGPTError):
        prepare(str(bad), "x", tokenizer="char", data_dir=data_dir)
    assert not data_dir.exists()


def test_a_folder_that_is_not_a_dataset_is_not_replaced(text_file, data_dir):
    (data_dir / "mine").mkdir(parents=True)
    (data_dir / "mine" / "precious.txt").write_text("keep me")
    with pytest.raises(NanoGPTError, match="is not a prepared dataset"):
        prepare(str(text_file), "mine", tokenizer="byte", data_dir=data_dir)
    assert (data_dir / "mine" / "precious.txt").read_text() == "keep me"


def test_load_meta_names_what_exists(text_file, data_dir):
    with pytest.raises(NanoGPTError, match=r"no dataset 'shk' in .*; run `nanogpt prepare SOURCE --name shk"):
        load_meta(data_dir, "shk")
    prepare(str(text_file), "b", tokenizer="byte", data_dir=data_dir)
    prepare(str(text_file), "a", tokenizer="byte", data_dir=data_dir)
    with pytest.raises(NanoGPTError, match=r"no dataset 'shk' in .*; these exist: a, b$"):
        load_meta(data_dir, "shk")
    assert not open_split(data_dir, "a", "val").shard(0).flags.writeable
    with pytest.raises(NanoGPTError, match="unknown split 'test'"):
        open_split(data_dir, "a", "test")


@pytest.fixture
def shakespeare_url(monkeypatch, tmp_path):
    """Tiny Shakespeare's URL pointed at a local file: download, checksum and cache run without a network."""
    origin = tmp_path / "origin" / "input.txt"
    origin.parent.mkdir()
    origin.write_text(make_text(seed=3), encoding="utf-8")
    monkeypatch.setattr(sources, "SHAKESPEARE_URL", origin.as_uri())
    monkeypatch.setattr(sources, "SHAKESPEARE_SHA256", hashlib.sha256(origin.read_bytes()).hexdigest())
    monkeypatch.setenv("NANOGPT_CACHE", str(tmp_path / "cache"))
    return origin


def test_shakespeare_is_downloaded_checked_and_cached(shakespeare_url, tmp_path, data_dir):
    result = prepare("shakespeare", "shk", tokenizer="char", data_dir=data_dir)
    cached = tmp_path / "cache" / "tinyshakespeare.txt"
    assert cached.read_bytes() == shakespeare_url.read_bytes()
    assert result.characters == len(make_text(seed=3))
    assert load_meta(data_dir, "shk")["source_url"] == shakespeare_url.as_uri()
    shakespeare_url.unlink()  # from now on only the cache has it
    assert prepare("shakespeare", "again", tokenizer="char", data_dir=data_dir).characters == result.characters


def test_shakespeare_checksum_mismatch(shakespeare_url, monkeypatch, tmp_path, data_dir):
    monkeypatch.setattr(sources, "SHAKESPEARE_SHA256", "0" * 64)
    with pytest.raises(NanoGPTError, match=r"has sha256 [0-9a-f]{64}, not 0{64}; it was not kept"):
        prepare("shakespeare", "shk", tokenizer="char", data_dir=data_dir)
    assert not (tmp_path / "cache" / "tinyshakespeare.txt").exists()
    assert not data_dir.exists()


# --- shards, workers, budgets, resume ---


def docs_jsonl(path: Path, n: int, seed: int = 0) -> Path:
    return write_jsonl(path, [{"text": f"doc {i}: " + make_text(lines=3, seed=seed + i)} for i in range(n)])


def dataset_files(folder: Path) -> dict[str, bytes]:
    """The shard files and meta.json less its creation time: what must match between two prepares."""
    files = {p.name: p.read_bytes() for p in sorted(folder.glob("*.bin"))}
    meta = json.loads((folder / "meta.json").read_text())
    meta.pop("created")
    return {**files, "meta.json": json.dumps(meta, sort_keys=True).encode()}


@pytest.mark.parametrize("kind", ["documents", "one text", "last document"])
def test_shards_are_the_unsharded_stream_cut_in_pieces(kind, tmp_path, data_dir):
    if kind == "documents":
        source = docs_jsonl(tmp_path / "docs.jsonl", 40)
    elif kind == "one text":  # the tail of train moves to val, across shard files
        source = tmp_path / "play.txt"
        source.write_text(make_text(lines=300), encoding="utf-8")
    else:  # fewer than 1/f documents: the last one moves from train to val
        source = docs_jsonl(tmp_path / "few.jsonl", 9)
    whole = prepare(str(source), "whole", tokenizer="gpt2", data_dir=data_dir)
    cut = prepare(str(source), "cut", tokenizer="gpt2", data_dir=data_dir, shard_tokens=97)
    assert whole.shards == {"train": 1, "val": 1} and cut.shards["train"] > 2
    meta = load_meta(data_dir, "cut")
    for split in ("train", "val"):
        assert read_split(data_dir, "cut", split) == read_split(data_dir, "whole", split)
        shards = meta["shards"][split]
        assert all(s["tokens"] == 97 for s in shards[:-1]) and 0 < shards[-1]["tokens"] <= 97
        for s in shards:
            assert hashlib.sha256((data_dir / "cut" / s["file"]).read_bytes()).hexdigest() == s["sha256"]
        assert sorted(p.name for p in (data_dir / "cut").glob(f"{split}-*.bin")) == [s["file"] for s in shards]
    assert (cut.val_documents, cut.documents) == (whole.val_documents, whole.documents)
    assert sorted(p.name for p in data_dir.iterdir()) == ["cut", "whole"]


def test_one_or_two_worker_processes_write_the_same_bytes(monkeypatch, tmp_path, data_dir):
    source = docs_jsonl(tmp_path / "docs.jsonl", 120)
    monkeypatch.setattr(tokenizing, "BATCH_DOCS", 8)  # many batches, so the workers' results must be put in order
    prepare(str(source), "one", tokenizer="gpt2", data_dir=data_dir, shard_tokens=500)
    prepare(str(source), "two", tokenizer="gpt2", data_dir=data_dir, shard_tokens=500, num_proc=2)
    assert dataset_files(data_dir / "one") == dataset_files(data_dir / "two")


def test_max_tokens_and_val_tokens_take_the_head_of_the_stream(tmp_path, data_dir, tiktoken_gpt2):
    docs = [f"doc {i}: " + make_text(lines=3, seed=i) for i in range(30)]
    source = write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in docs])
    stream = [t for i, d in enumerate(docs) for t in ([50256] if i else []) + tiktoken_gpt2.encode_ordinary(d)]
    result = prepare(
        str(source), "head", tokenizer="gpt2", data_dir=data_dir, max_tokens=1000, val_tokens=300, shard_tokens=128
    )
    assert read_split(data_dir, "head", "val") == stream[:300]
    assert read_split(data_dir, "head", "train") == stream[300:1000]
    assert (result.val_tokens, result.train_tokens) == (300, 700)
    meta = load_meta(data_dir, "head")
    assert meta["val_split"] == "head" and meta["max_tokens"] == 1000
    with pytest.raises(NanoGPTError, match=r"--val-tokens \(1,000\) must be below --max-tokens \(1,000\)"):
        prepare(str(source), "x", tokenizer="gpt2", data_dir=data_dir, max_tokens=1000, val_tokens=1000)


def interrupt_after_checkpoints(monkeypatch, n: int) -> None:
    """Ctrl-C right after the n-th checkpoint (a shard was completed and the position saved)."""
    calls = []
    checkpoint = shards.SplitStream.checkpoint

    def then_interrupt(self):
        checkpoint(self)
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt

    monkeypatch.setattr(shards.SplitStream, "checkpoint", then_interrupt)


def test_an_interrupted_prepare_is_kept_named_and_resumed(monkeypatch, tmp_path, data_dir):
    source = docs_jsonl(tmp_path / "docs.jsonl", 60)
    monkeypatch.setattr(tokenizing, "BATCH_DOCS", 4)
    prepare(str(source), "whole", tokenizer="char", data_dir=data_dir, shard_tokens=2000)
    with monkeypatch.context() as m:
        interrupt_after_checkpoints(m, 3)
        with pytest.raises(KeyboardInterrupt):
            prepare(str(source), "cut", tokenizer="char", data_dir=data_dir, shard_tokens=2000)
    partial = data_dir / ".cut.partial"
    assert (partial / "progress.json").is_file() and not (data_dir / "cut").exists()
    assert data.interrupted_prepare(data_dir, "cut").startswith(f"{partial} keeps ")
    with pytest.raises(
        NanoGPTError,
        match=r"\.cut\.partial holds an interrupted prepare of 'cut' \([\d,]+ documents, "
        r"[\d,]+ tokens, 3 complete shards\); add --resume to continue it",
    ):
        prepare(str(source), "cut", tokenizer="char", data_dir=data_dir, shard_tokens=2000)
    with pytest.raises(NanoGPTError, match="was started with --shard-tokens 2000, not 1000"):
        prepare(str(source), "cut", tokenizer="char", data_dir=data_dir, shard_tokens=1000, resume=True)
    result = prepare(str(source), "cut", tokenizer="char", data_dir=data_dir, shard_tokens=2000, resume=True)
    assert 0 < result.resumed_documents < result.documents == 60
    assert dataset_files(data_dir / "cut") == dataset_files(data_dir / "whole")
    assert sorted(p.name for p in data_dir.iterdir()) == ["cut", "whole"]


@pytest.mark.parametrize("streaming", [True, False])
def test_a_hub_source_resumes_streamed_or_not(streaming, monkeypatch, tmp_path, data_dir):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    # a local folder that load_dataset reads as it reads a hub repo: hf:OWNER/NAME relative to the working dir
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")  # the Arrow copy, if any
    (tmp_path / "corpus" / "web").mkdir(parents=True)
    for part in range(2):
        texts = [f"doc {part}.{i}: " + make_text(lines=2, seed=10 * part + i) for i in range(40)]
        pq.write_table(pa.table({"text": texts}), tmp_path / "corpus" / "web" / f"part-{part}.parquet")
    monkeypatch.setattr(tokenizing, "BATCH_DOCS", 4)
    options = dict(tokenizer="byte", data_dir=data_dir, shard_tokens=1500, streaming=streaming)
    prepare("hf:corpus/web", "whole", **options)
    with monkeypatch.context() as m:
        interrupt_after_checkpoints(m, 3)
        with pytest.raises(KeyboardInterrupt):
            prepare("hf:corpus/web", "cut", **options)
    seen = []
    result = prepare("hf:corpus/web", "cut", resume=True, progress=seen.append, **options)
    assert 0 < result.resumed_documents < result.documents == 80
    assert dataset_files(data_dir / "cut") == dataset_files(data_dir / "whole")
    last = seen[-1]  # the progress reports count documents for a hub dataset, and know the total unless streamed
    assert (last.unit, last.documents, last.tokens) == ("documents", 80, result.tokens)
    assert last.done == 80 and seen[0].total == (None if streaming else 80)


@pytest.mark.parametrize("kind", ["one text", "text files"])
def test_a_prepare_stopped_inside_a_document_resumes_there(kind, monkeypatch, tmp_path, data_dir):
    if kind == "one text":  # also: the tail of train moves to val only once the whole text is in
        source = tmp_path / "play.txt"
        source.write_text(make_text(lines=400, seed=4), encoding="utf-8")
    else:
        source = tmp_path / "texts"
        source.mkdir()
        for i in range(5):
            (source / f"{i}.txt").write_text(make_text(lines=80, seed=i), encoding="utf-8")
    monkeypatch.setattr(sources, "READ_BYTES", 200)  # a text comes in many pieces ...
    monkeypatch.setattr(tokenizing, "BATCH_DOCS", 3)  # ... and batches, so checkpoints fall inside documents
    prepare(str(source), "whole", tokenizer="gpt2", data_dir=data_dir, shard_tokens=300)
    with monkeypatch.context() as m:
        interrupt_after_checkpoints(m, 4)
        with pytest.raises(KeyboardInterrupt):
            prepare(str(source), "cut", tokenizer="gpt2", data_dir=data_dir, shard_tokens=300)
    assert json.loads((data_dir / ".cut.partial" / "progress.json").read_text())["in_doc"]
    prepare(str(source), "cut", tokenizer="gpt2", data_dir=data_dir, shard_tokens=300, resume=True)
    assert dataset_files(data_dir / "cut") == dataset_files(data_dir / "whole")


CHILD = """
import sys, time
from pathlib import Path
from nanogpt_cli.data import prepare, shards, tokenizing

tokenizing.BATCH_DOCS = 8
add = shards.SplitStream.add
shards.SplitStream.add = lambda *args: (time.sleep(0.01), add(*args))[1]  # slow enough to be killed half way
prepare(sys.argv[1], "web", tokenizer="gpt2", data_dir=Path(sys.argv[2]), shard_tokens=1000, num_proc=int(sys.argv[3]))
"""


def kill_when_checkpointed(source: Path, data_dir: Path, num_proc: int = 1) -> list[int]:
    """Run a prepare in a child process and SIGKILL it once its first shard is complete; returns the processes
    it had started (Linux only, else [])."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    log = source.with_name("child.err")  # a file, not a pipe: a worker left behind would hold a pipe open
    with open(log, "w") as err:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(source), str(data_dir), str(num_proc)], env=env, stderr=err
        )
    checkpoint = data_dir / ".web.partial" / "progress.json"
    try:
        while not checkpoint.exists() and child.poll() is None:
            time.sleep(0.005)
        started = descendants(child.pid)
    finally:
        child.kill()
        child.wait()
    assert checkpoint.exists(), log.read_text()
    assert not (data_dir / "web").exists()  # it died half way
    return started


def descendants(pid: int) -> list[int]:
    """The processes below `pid`, from /proc (empty where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def running(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's zombie waits for init to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["jsonl", "parquet folder"])
def test_a_killed_prepare_resumes_to_the_same_bytes(kind, tmp_path, data_dir):
    if kind == "jsonl":
        source = docs_jsonl(tmp_path / "docs.jsonl", 400)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        source = tmp_path / "parquet"
        source.mkdir()
        for part in range(4):
            texts = [f"doc {part}.{i}: " + make_text(lines=3, seed=100 * part + i) for i in range(100)]
            pq.write_table(pa.table({"text": texts}), source / f"part-{part}.parquet")
    kill_when_checkpointed(source, data_dir)
    resumed = prepare(str(source), "web", tokenizer="gpt2", data_dir=data_dir, shard_tokens=1000, resume=True)
    assert 0 < resumed.resumed_documents < resumed.documents == 400
    prepare(str(source), "whole", tokenizer="gpt2", data_dir=data_dir, shard_tokens=1000)
    assert dataset_files(data_dir / "web") == dataset_files(data_dir / "whole")
    assert not (data_dir / ".web.partial").exists()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the worker processes in /proc")
def test_a_killed_prepare_leaves_no_worker_behind(tmp_path, data_dir):
    source = docs_jsonl(tmp_path / "docs.jsonl", 400)
    workers = kill_when_checkpointed(source, data_dir, num_proc=2)
    assert len(workers) >= 2  # the two tokenizer processes (and multiprocessing's resource tracker)
    deadline = time.monotonic() + 60  # they go at once on Linux; a bound, not a measurement
    while any(map(running, workers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in workers if running(pid)]
    for pid in left:  # do not leave them to the next test either
        os.kill(pid, 9)
    assert left == [], "worker processes outlived the prepare that started them"
    resumed = prepare(
        str(source), "web", tokenizer="gpt2", data_dir=data_dir, shard_tokens=1000, resume=True, num_proc=2
    )
    assert 0 < resumed.resumed_documents < resumed.documents == 400
    prepare(str(source), "whole", tokenizer="gpt2", data_dir=data_dir, shard_tokens=1000)
    assert dataset_files(data_dir / "web") == dataset_files(data_dir / "whole")


# --- training reads shards ---


def test_windows_stay_inside_one_shard_and_are_drawn_by_size(tmp_path):
    import torch

    counts = [50, 7, 120, 30]
    paths = []
    for i, n in enumerate(counts):  # shard i holds 1000 * i + position: a token says where it came from
        paths.append(tmp_path / f"train-{i:05d}.bin")
        (np.arange(n) + 1000 * i).astype(np.uint16).tofile(paths[-1])
    split = data.TokenShards(paths, counts, "uint16")
    windows = split.windows(4000, 9, torch.Generator().manual_seed(0)).astype(np.int64)
    assert windows.shape == (4000, 9)
    shard = windows // 1000
    assert (shard == shard[:, :1]).all() and (np.diff(windows, axis=1) == 1).all()  # one shard, consecutive
    seen = np.bincount(shard[:, 0], minlength=4)
    assert seen[1] == 0  # shorter than a window: never drawn
    assert np.allclose(seen, np.array([42, 0, 112, 22]) / 176 * 4000, rtol=0.15)  # by number of windows
    # with one shard the draws are torch.randint's, as before shards: old runs resume onto the same batches
    one = data.TokenShards(paths[2:3], counts[2:3], "uint16")
    starts = torch.randint(120 - 9 + 1, (6,), generator=torch.Generator().manual_seed(5))
    assert (one.windows(6, 9, torch.Generator().manual_seed(5))[:, 0] - 2000).tolist() == starts.tolist()


def metrics_of(run: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in m.items() if k not in ("elapsed_s", "tokens_per_s")} for m in lines]  # timings


def train_metrics(data_dir: Path, name: str, run: Path, **over) -> list[dict]:
    from nanogpt_cli.training.trainer import train

    train(tiny_plan(data_dir, name, run, max_iters=6, eval_interval=3, eval_iters=2, **over))
    return metrics_of(run)


def test_training_on_shards_resumes_exactly(tmp_path, data_dir):
    from nanogpt_cli.training.plan import plan_run
    from nanogpt_cli.training.request import RunRequest
    from nanogpt_cli.training.trainer import train

    source = tmp_path / "play.txt"
    source.write_text(make_text(lines=300, seed=1), encoding="utf-8")
    result = prepare(str(source), "shards", tokenizer="char", data_dir=data_dir, shard_tokens=100)
    assert result.shards["train"] > 50  # windows of block_size + 1 = 33 tokens, 3 per shard at most
    whole = train_metrics(data_dir, "shards", tmp_path / "whole")
    parts = tmp_path / "parts"
    train_metrics(data_dir, "shards", parts, stop_at=4)
    train(plan_run(RunRequest({}, out=parts, resume=True)))
    assert metrics_of(parts) == whole


def test_a_dataset_from_before_shards_still_trains_the_same(tmp_path, data_dir):
    source = tmp_path / "play.txt"
    source.write_text(make_text(lines=300, seed=2), encoding="utf-8")
    prepare(str(source), "new", tokenizer="char", data_dir=data_dir)
    old = data_dir / "old"  # the layout of earlier versions: train.bin, val.bin, no shard list
    old.mkdir()
    meta = load_meta(data_dir, "new")
    for split in ("train", "val"):
        (old / f"{split}.bin").hardlink_to(data_dir / "new" / f"{split}-00000.bin")
    del meta["shards"], meta["shard_tokens"]
    (old / "meta.json").write_text(json.dumps(meta))
    assert read_split(data_dir, "old", "train") == read_split(data_dir, "new", "train")
    assert train_metrics(data_dir, "old", tmp_path / "a") == train_metrics(data_dir, "new", tmp_path / "b")


def test_two_prepares_of_one_name_do_not_write_at_once(tmp_path, data_dir):
    source = docs_jsonl(tmp_path / "docs.jsonl", 20)
    partial = data_dir / ".busy.partial"
    partial.mkdir(parents=True)
    with pipeline._locked(partial):  # as a prepare running in another process holds it
        with pytest.raises(NanoGPTError, match=r"another prepare is writing .*\.busy\.partial; wait for it"):
            prepare(str(source), "busy", tokenizer="byte", data_dir=data_dir)
        assert partial.is_dir()  # the other prepare's folder is left alone
    assert prepare(str(source), "busy", tokenizer="byte", data_dir=data_dir).documents == 20


def test_a_few_files_are_split_by_tokens_not_by_whole_documents(tmp_path, data_dir):
    folder = tmp_path / "two"
    folder.mkdir()
    for name, seed in (("a.txt", 1), ("b.txt", 2)):
        (folder / name).write_text(make_text(lines=120, seed=seed), encoding="utf-8")
    result = prepare(str(folder), "two", tokenizer="char", data_dir=data_dir)
    share = result.val_tokens / result.tokens
    assert 0.09 < share < 0.11 and result.val_split == "tail" and result.val_documents == 1
    assert load_meta(data_dir, "two")["val_split"] == "tail"
    # many documents keep the whole-document rule
    many = write_jsonl(tmp_path / "many.jsonl", [{"text": make_text(lines=3, seed=i)} for i in range(40)])
    assert prepare(str(many), "many", tokenizer="char", data_dir=data_dir).val_split == "documents"
