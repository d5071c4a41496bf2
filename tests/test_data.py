"""prepare(): sources, the train/val split, dtypes, atomic replacement, the Tiny Shakespeare download."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import make_text
from nanogpt_cli import data
from nanogpt_cli.data import load_meta, open_split, prepare, token_dtype
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.tokenizer import tokenizer_from_description


def read_split(data_dir: Path, name: str, split: str) -> list[int]:
    return open_split(data_dir, name, split).tolist()


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
    assert (data_dir / "play" / "train.bin").stat().st_size == 2 * len(train)
    assert result.train_tokens == len(train) and result.bytes_on_disk == sum(
        p.stat().st_size for p in (data_dir / "play").iterdir())
    assert sorted(p.name for p in data_dir.iterdir()) == ["play"]


def test_reading_in_small_pieces_gives_the_same_tokens(monkeypatch, tmp_path, data_dir, tiktoken_gpt2):
    # the file is read and tokenized in pieces; cutting only at safe line breaks keeps BPE's result exact
    text = make_text(lines=400, seed=1) + "tail   \n\n  with spaces  \r\n"
    path = tmp_path / "long.txt"
    path.write_text(text, encoding="utf-8", newline="")
    monkeypatch.setattr(data, "READ_BYTES", 64)
    monkeypatch.setattr(data, "BATCH_CHARS", 300)
    prepare(str(path), "pieces", tokenizer="gpt2", data_dir=data_dir, num_proc=2)
    assert read_split(data_dir, "pieces", "train") + read_split(data_dir, "pieces", "val") == \
        tiktoken_gpt2.encode_ordinary(text)


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
    val = open_split(data_dir, "wide", "val")  # the tail holds the highest code points, so the highest ids
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


def test_few_documents_still_give_validation_one(tmp_path, data_dir):
    path = write_jsonl(tmp_path / "few.jsonl", [{"text": "alpha beta"}, {"text": "gamma delta"},
                                                {"text": "epsilon zeta eta"}])
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

        def progress(stage, done, total):
            if stage == "splitting":  # the tokens are written; the interrupt comes while splitting them
                raise KeyboardInterrupt
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
    assert not open_split(data_dir, "a", "val").flags.writeable
    with pytest.raises(NanoGPTError, match="unknown split 'test'"):
        open_split(data_dir, "a", "test")


@pytest.fixture
def shakespeare_url(monkeypatch, tmp_path):
    """Tiny Shakespeare's URL pointed at a local file: download, checksum and cache run without a network."""
    origin = tmp_path / "origin" / "input.txt"
    origin.parent.mkdir()
    origin.write_text(make_text(seed=3), encoding="utf-8")
    monkeypatch.setattr(data, "SHAKESPEARE_URL", origin.as_uri())
    monkeypatch.setattr(data, "SHAKESPEARE_SHA256", hashlib.sha256(origin.read_bytes()).hexdigest())
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
    monkeypatch.setattr(data, "SHAKESPEARE_SHA256", "0" * 64)
    with pytest.raises(NanoGPTError, match=r"has sha256 [0-9a-f]{64}, not 0{64}; it was not kept"):
        prepare("shakespeare", "shk", tokenizer="char", data_dir=data_dir)
    assert not (tmp_path / "cache" / "tinyshakespeare.txt").exists()
    assert not data_dir.exists()


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
