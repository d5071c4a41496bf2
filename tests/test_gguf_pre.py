"""llama.cpp's pre-tokenizer names (interop/gguf_pre.py): for each family in docs/models.md, a tokenizer trained here
with the tokenizers library and the pre-tokenizer and normalizer that family's tokenizer.json has, exported to GGUF:
the name written is the one llama.cpp's converter writes for the family (SentencePiece-style ones go out as its
"llama" vocabulary), llama.cpp's own regexes for that name (llama-vocab.cpp, in its spelling) cut text as the
tokenizer does, and transformers' GGUF loader (where it knows the name) and ours give the tokenizer's ids; a cut
llama.cpp lacks is one sentence; a GGUF's own name goes out again."""

from __future__ import annotations

import json
import unicodedata

import pytest

tk = pytest.importorskip("tokenizers")
gguf = pytest.importorskip("gguf")

from nanogpt_cli.config import GPTConfig  # noqa: E402
from nanogpt_cli.errors import NanoGPTError  # noqa: E402
from nanogpt_cli.hf_tokenizer import HFTokenizer, byte_to_unicode  # noqa: E402
from nanogpt_cli.interop.export import export, export_gguf  # noqa: E402
from nanogpt_cli.interop.gguf_pre import llama_pre  # noqa: E402
from nanogpt_cli.interop.loading import load_model, tokenizer_of  # noqa: E402
from nanogpt_cli.model import GPT  # noqa: E402

# the split regexes as the families' tokenizer.json files spell them
LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
    r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# llama.cpp's regexes for the names (llama-vocab.cpp), each cutting the pieces the one before left
LLAMA_CPP_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
LLAMA_CPP = {
    "gpt-2": [LLAMA_CPP_GPT2],
    "smollm": [r"\p{N}", LLAMA_CPP_GPT2],
    "llama-bpe": [
        CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ],
    "qwen2": [CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
}


def split(regex: str):
    return tk.pre_tokenizers.Split(tk.Regex(regex), behavior="isolated")


def byte_level(regex: bool = True):
    return tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=regex)


# byte-level family -> (normalizer, pre-tokenizer, ignore_merges) as its tokenizer.json has them, and the name
# llama.cpp's converter writes for it (Pythia's "olmo" cuts as "gpt-2" does)
FAMILIES = {
    "gpt2": ((None, byte_level(), False), "gpt-2"),
    "llama3": ((None, tk.pre_tokenizers.Sequence([split(LLAMA3), byte_level(False)]), True), "llama-bpe"),
    "smollm2": ((None, tk.pre_tokenizers.Sequence([tk.pre_tokenizers.Digits(True), byte_level()]), False), "smollm"),
    "qwen2": ((tk.normalizers.NFC(), tk.pre_tokenizers.Sequence([split(QWEN2), byte_level(False)]), False), "qwen2"),
    "pythia": ((tk.normalizers.NFC(), byte_level(), False), "gpt-2"),
    "mistral-nemo": ((None, tk.pre_tokenizers.Sequence([split(TEKKEN), byte_level(False)]), True), "tekken"),
}
TRAIN = (
    "Hello world, the king's men and WE'LL see. café naïve — “quoth” 🙂 日本語のテキスト 12345 678 3.14159\n\n"
    "    indented code(x): return x**2  # ok\r\n\ttabs  and   spaces 2024-12-07 1,000,000 ٣٤٥ x² "
) * 20
HELD_OUT = [  # digits, runs of spaces, tabs and newlines, contractions, other scripts, emoji, superscripts
    "Year 20245: 3.14159 1,000,000 x²+y³ ٣٤٥ and 12a34b",
    "  multiple   spaces  \t\ttabs\n\n\r\n  indented\n    def f(x): return x**2",
    "I'm sure they'RE here, we'll see — can't you? 'S 'll",
    "café naïve Ω≈ç√ 日本語 中文字 한국어 🙂🧑\u200d🚀 ÀÉÎ",
    "<|endoftext|> special strings are text here",
    " leading space",
    "",
]


# SentencePiece-style family -> whether a text gets a ▁ in front: Llama 2, TinyLlama and Mistral 7B (a Prepend
# normalizer), Gemma 3 (spaces replaced only); llama.cpp's "llama" vocabulary, with no pre-tokenizer of its own
SENTENCEPIECE = {"llama2": True, "gemma3": False}


def family_tokenizer(name: str, folder) -> HFTokenizer:
    if name in SENTENCEPIECE:
        return sentencepiece_family(SENTENCEPIECE[name])
    (normalizer, pre, ignore_merges), _ = FAMILIES[name]
    t = tk.Tokenizer(tk.models.BPE(ignore_merges=ignore_merges))
    t.normalizer, t.pre_tokenizer, t.decoder = normalizer, pre, tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    t.train_from_iterator([TRAIN], trainer)
    folder.mkdir(parents=True, exist_ok=True)
    t.save(str(folder / "tokenizer.json"))
    return HFTokenizer(t.to_str(), name, {"eos_token": "<|endoftext|>"}, folder=folder)


def sentencepiece_family(prefix: bool) -> HFTokenizer:
    """A BPE with byte fallback as Llama 2's and Gemma's tokenizer.json are: <unk> <s> </s>, the 256 <0xNN> tokens,
    merges learnt on ▁-marked words, spaces replaced by ▁ (and a ▁ put in front: `prefix`)."""
    t = tk.Tokenizer(tk.models.BPE())
    t.pre_tokenizer = tk.pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    t.train_from_iterator([TRAIN], tk.trainers.BpeTrainer(vocab_size=300, limit_alphabet=60, show_progress=False))
    learnt = json.loads(t.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for token, _ in sorted(learnt["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learnt["merges"]]
    s = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    replace = tk.normalizers.Replace(" ", "▁")
    s.normalizer = tk.normalizers.Sequence([tk.normalizers.Prepend("▁"), replace]) if prefix else replace
    steps = [tk.decoders.Replace("▁", " "), tk.decoders.ByteFallback(), tk.decoders.Fuse()]
    s.decoder = tk.decoders.Sequence(steps + ([tk.decoders.Strip(" ", 1, 0)] if prefix else []))
    s.add_special_tokens([tk.AddedToken(x, special=True, normalized=False) for x in ["<unk>", "<s>", "</s>"]])
    settings = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": False}
    return HFTokenizer(s.to_str(), "spm", settings)


def export_of(tok: HFTokenizer, path) -> dict:
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=16, n_layer=1, n_head=2, n_embd=16))
    export_gguf(model, tok.describe(), path, tokenizer=tok)
    return gguf.GGUFReader(str(path)).fields


def llama_cpp_cut(text: str, regexes: list[str]) -> list[str]:
    """The pieces llama.cpp's regexes cut `text` into: each regex cuts every piece into its matches and the text
    between them (unicode_regex_split), spelled in GPT-2's byte alphabet as the tokenizers library shows them."""
    import regex as re

    pieces = [text]
    for r in regexes:
        out = []
        for piece in pieces:
            start = 0
            for m in re.finditer(r, piece):
                out += [piece[start : m.start()], m.group()]
                start = m.end()
            out.append(piece[start:])
        pieces = [p for p in out if p]
    alphabet = byte_to_unicode()
    return ["".join(alphabet[b] for b in p.encode("utf-8")) for p in pieces]


@pytest.mark.parametrize("name", [*FAMILIES, *SENTENCEPIECE])
def test_each_familys_tokenizer_goes_out_under_llama_cpps_name_and_reads_back_with_its_ids(name, tmp_path):
    tok = family_tokenizer(name, tmp_path / "tok")
    fields = export_of(tok, tmp_path / "m.gguf")
    model, pre = ("llama", "default") if name in SENTENCEPIECE else ("gpt2", FAMILIES[name][1])
    assert fields["tokenizer.ggml.model"].contents() == model and fields["tokenizer.ggml.pre"].contents() == pre
    if name in SENTENCEPIECE:
        assert bool(fields["tokenizer.ggml.add_space_prefix"].contents()) == SENTENCEPIECE[name]
    backend = tk.Tokenizer.from_str(tok.text)
    if pre in LLAMA_CPP:  # llama.cpp's own regexes for the name cut as the tokenizer's pre-tokenizer does
        for text in HELD_OUT:
            theirs = [p for p, _ in backend.pre_tokenizer.pre_tokenize_str(unicodedata.normalize("NFC", text))]
            assert llama_cpp_cut(text, LLAMA_CPP[pre]) == theirs, (name, text)
    _, meta = load_model(tmp_path / "m.gguf")
    again = tokenizer_of(meta, tmp_path / "m.gguf")
    assert all(again.encode(text) == tok.encode(text) for text in HELD_OUT)


@pytest.mark.slow  # transformers takes seconds to import
@pytest.mark.parametrize("name", [n for n in FAMILIES if n != "smollm2"])  # transformers has no split for smollm
def test_transformers_reads_the_gguf_tokenizer_with_the_same_ids(name, tmp_path):
    """transformers' GGUF reader, on the byte-level names it knows. (Its SentencePiece reader is chosen by the
    architecture, and puts no ▁ before a text that starts with a space, where llama.cpp and Llama 2's file do.)"""
    transformers = pytest.importorskip("transformers")
    tok = family_tokenizer(name, tmp_path / "tok")
    export_of(tok, tmp_path / "m.gguf")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    for text in HELD_OUT:
        assert theirs(text, add_special_tokens=False)["input_ids"] == tok.encode_special(text), (name, text)


@pytest.mark.parametrize(
    "pre,normalizer,words",
    [
        (tk.pre_tokenizers.Sequence([split(r"\p{N}{1,2}"), byte_level(False)]), None, "Split \\+ ByteLevel"),
        (tk.pre_tokenizers.ByteLevel(add_prefix_space=True), None, "ByteLevel"),
        (tk.pre_tokenizers.Sequence([tk.pre_tokenizers.Punctuation(), byte_level()]), None, "Punctuation"),
        (byte_level(), tk.normalizers.Lowercase(), "ByteLevel, a Lowercase normalizer"),
    ],
)
def test_a_cut_llama_cpp_lacks_is_one_sentence_and_writes_nothing(pre, normalizer, words, tmp_path):
    t = tk.Tokenizer(tk.models.BPE())
    t.normalizer, t.pre_tokenizer = normalizer, pre
    t.train_from_iterator([TRAIN], tk.trainers.BpeTrainer(vocab_size=300, show_progress=False))
    tok = HFTokenizer(t.to_str(), "odd", {})
    with pytest.raises(NanoGPTError, match=f"llama.cpp has no pre-tokenizer that cuts text as the odd .*{words}"):
        export_of(tok, tmp_path / "m.gguf")
    assert not list(tmp_path.iterdir())


def test_a_carried_name_is_kept_only_when_it_cuts_as_the_tokenizer(tmp_path):
    spec = json.loads(family_tokenizer("smollm2", tmp_path).text)
    assert llama_pre(spec, "x") == "smollm"
    assert llama_pre(spec, "x", "starcoder") == "starcoder"  # llama.cpp cuts StarCoder's text as SmolLM's
    assert llama_pre(spec, "x", "qwen2") == "smollm"  # a name that cuts otherwise is not the tokenizer's
    whole_words = {**spec, "model": {**spec["model"], "ignore_merges": True}}  # llama.cpp's smollm merges always
    with pytest.raises(NanoGPTError, match="Digits \\+ ByteLevel, ignore_merges\\) does"):
        llama_pre(whole_words, "x", "smollm")


@pytest.mark.slow  # transformers builds the model
def test_a_llama_cpp_gguf_goes_out_under_its_own_pre_tokenizer_name(tmp_path):
    """Pythia's GGUF as llama.cpp's converter writes it names its pre-tokenizer "olmo" (which cuts as "gpt-2"): an
    export of the file names "olmo" again, and so does an export of that export."""
    pytest.importorskip("transformers")
    from test_families import random_model, write_converter_gguf

    ref = random_model("pythia", tmp_path / "hf")
    write_converter_gguf(ref, tmp_path / "hf", "gptneox", tmp_path / "pythia.gguf")
    export(tmp_path / "pythia.gguf", "gguf", tmp_path / "again.gguf")
    assert gguf.GGUFReader(str(tmp_path / "again.gguf")).fields["tokenizer.ggml.pre"].contents() == "olmo"
    export(tmp_path / "again.gguf", "gguf", tmp_path / "third.gguf")  # our own file keeps it too
    assert gguf.GGUFReader(str(tmp_path / "third.gguf")).fields["tokenizer.ggml.pre"].contents() == "olmo"
