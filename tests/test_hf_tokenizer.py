"""Hugging Face tokenizer.json files as our tokenizers: a byte-level BPE and a SentencePiece-style BPE with byte
fallback, both trained here with the tokenizers library, checked against transformers' PreTrainedTokenizerFast on
the same files; the file travelling through prepare, train, sample and export; chat templates and stop ids."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

tk = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from nanogpt_cli.config import GPTConfig  # noqa: E402
from nanogpt_cli.errors import NanoGPTError  # noqa: E402
from nanogpt_cli.hf_tokenizer import HFTokenizer, read_hf_tokenizer  # noqa: E402
from nanogpt_cli.inference.sample import TextStream  # noqa: E402
from nanogpt_cli.model import GPT  # noqa: E402
from nanogpt_cli.tokenizer import build_tokenizer, same_tokenizer, tokenizer_from_description  # noqa: E402

TRAIN = (
    "Hello world, the king and queen. café naïve façade — “quoth” 🙂 日本語のテキストです。 "
    "    indented\n\nnew   lines\tand tabs 12345 67890 "
) * 20
HELD_OUT = [
    "Hello  world!\n\n  café 🙂🙂 日本語",
    "   runs of spaces\n\n\n\tand tabs  ",
    "emoji 🧑‍🚀 and Ω≈ç√ 中文字 (unseen characters)",
    "special strings <|im_start|>user\nhi<|im_end|> <s>x</s> <end_of_turn>",
    " leading space",
    "",
]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
GEMMA = (
    "{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + message['role'] + '\\n' + "
    "message['content'] + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


def byte_level(folder: Path) -> Path:
    """A byte-level BPE (GPT-2, Llama 3, Qwen style) with ChatML's special tokens, and a config as Qwen's."""
    t = tk.Tokenizer(tk.models.BPE())
    t.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = tk.decoders.ByteLevel()
    t.post_processor = tk.processors.ByteLevel(trim_offsets=False)
    trainer = tk.trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    t.train_from_iterator([TRAIN], trainer)
    folder.mkdir(parents=True, exist_ok=True)
    t.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    eos = [t.token_to_id("<|im_end|>"), t.token_to_id("<|endoftext|>")]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}), encoding="utf-8")
    return folder


def sentencepiece(folder: Path, add_bos: bool | None = None) -> Path:
    """A SentencePiece-style BPE (Llama 2, Mistral, Gemma style): <unk> <s> </s>, the 256 <0xNN> byte-fallback
    tokens, merges learnt on ▁-marked words, Metaspace, the Replace/ByteFallback/Fuse/Strip decoder, BOS added by
    the post-processor, and Gemma's turn tokens."""
    t = tk.Tokenizer(tk.models.BPE())
    t.pre_tokenizer = tk.pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    t.train_from_iterator([TRAIN], tk.trainers.BpeTrainer(vocab_size=300, limit_alphabet=60, show_progress=False))
    spec = json.loads(t.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for token, _ in sorted(spec["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in spec["merges"]]
    s = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    s.pre_tokenizer = tk.pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    s.decoder = tk.decoders.Sequence(
        [tk.decoders.Replace("▁", " "), tk.decoders.ByteFallback(), tk.decoders.Fuse(), tk.decoders.Strip(" ", 1, 0)]
    )
    specials = ["<unk>", "<s>", "</s>", "<start_of_turn>", "<end_of_turn>"]
    s.add_special_tokens([tk.AddedToken(x, special=True, normalized=False) for x in specials])
    s.post_processor = tk.processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    folder.mkdir(parents=True, exist_ok=True)
    s.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    if add_bos is not None:
        config["add_bos_token"] = add_bos
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (folder / "chat_template.jinja").write_text(GEMMA, encoding="utf-8")
    end = s.token_to_id("<end_of_turn>")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, end]}), encoding="utf-8")
    return folder


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece"])
def hf_dir(request, tmp_path_factory) -> Path:
    return globals()[request.param](tmp_path_factory.mktemp(request.param))


def theirs(folder: Path):
    """transformers' own reading of the same files."""
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.pop("chat_template", None)
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), **config)


def test_ids_and_text_equal_transformers(hf_dir):
    ours, ref = build_tokenizer(str(hf_dir)), theirs(hf_dir)
    assert isinstance(ours, HFTokenizer) and ours.vocab_size == len(ref)
    for text in HELD_OUT:
        special = ours.encode_special(text)
        assert special == ref(text, add_special_tokens=False)["input_ids"], text
        assert ours.encode_document(text) == ref(text)["input_ids"], text  # BOS as the model expects it
        assert ours.decode(special) == ref.decode(special, skip_special_tokens=False), text
        plain = ours.encode(text)  # special-token strings are text here
        assert plain == ref(text, add_special_tokens=False, split_special_tokens=True)["input_ids"], text
        assert ours.decode(plain) == ref.decode(plain), text
    # every single id, and random sequences of them, decode as theirs do
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        ids = torch.randint(0, ours.vocab_size, (12,), generator=gen).tolist()
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=False)


def test_special_tokens_bos_and_end_ids(tmp_path):
    bl = build_tokenizer(str(byte_level(tmp_path / "bl")))
    assert bl.bos_id is None and bl.eot_id == bl.token_id("<|im_end|>")
    assert set(bl.stop_ids) == {bl.token_id("<|im_end|>"), bl.token_id("<|endoftext|>")}
    assert bl.encode_special("<|im_start|>") == [bl.token_id("<|im_start|>")]
    assert bl.token_id("<|im_start|>") not in bl.encode("<|im_start|>")
    sp = build_tokenizer(str(sentencepiece(tmp_path / "sp")))
    assert sp.bos_id == 1 and sp.eot_id == 2 and set(sp.stop_ids) == {2, sp.token_id("<end_of_turn>")}
    assert sp.special_strings == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    # add_bos_token false in tokenizer_config.json overrides the file's post-processor, as in transformers
    no_bos = sentencepiece(tmp_path / "sp-nobos", add_bos=False)
    ours = build_tokenizer(str(no_bos))
    assert ours.bos_id is None and ours.encode_document("hi") == theirs(no_bos)("hi")["input_ids"]
    eos_too = sentencepiece(tmp_path / "sp-eos", add_bos=True)
    config = json.loads((eos_too / "tokenizer_config.json").read_text()) | {"add_eos_token": True}
    (eos_too / "tokenizer_config.json").write_text(json.dumps(config))
    ours = build_tokenizer(str(eos_too))
    assert ours.encode_document("hi") == theirs(eos_too)("hi")["input_ids"] and ours.encode_document("hi")[-1] == 2


def test_the_description_holds_the_sha256_and_the_file_is_needed(tmp_path):
    folder = byte_level(tmp_path / "bl")
    tok = build_tokenizer(str(folder / "tokenizer.json"))  # the file itself names it too
    desc = tok.describe()
    assert desc["kind"] == "hf" and len(json.dumps(desc)) < 1000  # the vocabulary is not in the JSON
    again = tokenizer_from_description(desc, folder)
    assert again.encode(HELD_OUT[0]) == tok.encode(HELD_OUT[0])
    assert same_tokenizer(desc, dict(desc, name="another name"))
    with pytest.raises(NanoGPTError, match="has no tokenizer.json"):
        tokenizer_from_description(desc, tmp_path / "empty")
    other = byte_level(tmp_path / "other")
    (other / "tokenizer.json").write_text((other / "tokenizer.json").read_text().replace("<|im_end|>", "<|x|>"))
    with pytest.raises(NanoGPTError, match="is not the one"):
        tokenizer_from_description(desc, other)


def test_streaming_decode_never_splits_a_character(hf_dir):
    tok = build_tokenizer(str(hf_dir))
    text = "naïve 🙂🧑‍🚀 日本語のテキスト 中文字 Ω≈ç√"
    ids = tok.encode(text)
    if (hf_dir / "chat_template.jinja").exists():  # SentencePiece: unseen characters are byte-fallback pieces
        assert any(len(tok.decode_bytes([i])) == 1 and tok.decode_bytes([i])[0] >= 0x80 for i in ids)
    stream = TextStream(tok, stop=[], eot=tok.stop_ids, limit=10_000)
    pieces = [stream.feed(i) for i in ids] + [stream.finish()]
    assert all("\ufffd" not in p for p in pieces)
    joined = "".join(pieces)
    assert joined == tok.decode(ids) or joined == " " + tok.decode(ids)  # SentencePiece strips a text's 1st space
    for held in HELD_OUT:  # each token's bytes, joined, are the library's decoded text
        ids = tok.encode_special(held)
        text = tok.decode_bytes(ids).decode("utf-8")
        assert text == tok.decode(ids) or text == " " + tok.decode(ids), held


def test_hf_name_offline_is_one_sentence(no_network, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    said = f"hf:someone/model is not in the Hugging Face cache ({tmp_path / 'hf' / 'hub'}) and HF_HUB_OFFLINE"
    with pytest.raises(NanoGPTError, match=re.escape(said)):
        read_hf_tokenizer("hf:someone/model")


def test_stop_ids_end_a_stream(tmp_path):
    tok = build_tokenizer(str(sentencepiece(tmp_path / "sp")))
    end = tok.token_id("<end_of_turn>")
    stream = TextStream(tok, stop=[], eot=tok.stop_ids, limit=100)
    text = "".join(stream.feed(i) for i in [*tok.encode("hello"), end])
    assert stream.done and stream.reason == "eot" and text.strip() == "hello"


def forced_model(tok, token: int, block_size: int = 64) -> GPT:
    """A tiny GPT whose every next token is `token`: ln_f gives a constant vector the head row of `token` matches."""
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=tok.vocab_size,
        block_size=block_size,
        n_layer=1,
        n_head=2,
        n_embd=16,
        tie_embeddings=False,
        bias=True,
    )
    model = GPT(config)
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[token].fill_(1.0)
    return model


def test_chat_stops_at_the_models_end_of_turn(tmp_path):
    """A run on the SentencePiece tokenizer whose model writes <end_of_turn> at once: chat renders Gemma's
    template (from chat_template.jinja) and stops there, an id only generation_config.json names."""
    from nanogpt_cli.data.chat_template import ChatTemplate
    from nanogpt_cli.inference.chat import ChatSession
    from nanogpt_cli.inference.sample import SampleSettings
    from nanogpt_cli.interop.export import export_hf
    from nanogpt_cli.interop.loading import load_model

    folder = sentencepiece(tmp_path / "sp")
    tok = read_hf_tokenizer(str(folder))
    end = tok.token_id("<end_of_turn>")
    model = forced_model(tok, end)
    hf_dir = tmp_path / "model"
    export_hf(model, tok.describe(), hf_dir, chat_template=tok.chat_template, tokenizer=tok)
    _, meta = load_model(hf_dir)
    assert meta["tokenizer"]["kind"] == "hf" and end in meta["tokenizer"]["stop_ids"]
    session = ChatSession.load(hf_dir, SampleSettings(temperature=0, max_new_tokens=20), device="cpu")
    assert isinstance(session.template, ChatTemplate) and "<start_of_turn>" in session.template.source
    reply = session.ask("hello")
    assert reply.ids[0] == 1 and reply.ids[1] == tok.token_id("<start_of_turn>")  # BOS, then the turn token
    assert "".join(reply) == "" and reply.stop_reason == "eot"


def test_prepare_train_sample_export_with_the_file_travelling(tmp_path, text_file):
    """prepare --tokenizer FOLDER copies tokenizer.json beside meta.json (each document starts with BOS), train
    copies it into the run, sample reads it there, and the hf export is read back by AutoTokenizer."""
    from typer.testing import CliRunner

    from nanogpt_cli.cli import app
    from nanogpt_cli.data.reader import load_meta

    folder = sentencepiece(tmp_path / "sp")
    runner = CliRunner()
    data = tmp_path / "data"
    r = runner.invoke(
        app, ["prepare", str(text_file), "--name", "play", "--tokenizer", str(folder), "--data-dir", str(data)]
    )
    assert r.exit_code == 0, r.output
    meta = load_meta(data, "play")
    assert (
        meta["tokenizer"]["kind"] == "hf"
        and (data / "play" / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    )
    import numpy as np

    first = np.fromfile(data / "play" / meta["shards"]["train"][0]["file"], dtype=meta["dtype"])
    assert first[0] == 1  # BOS
    run = tmp_path / "run"
    args = ["train", "--data", "play", "--data-dir", str(data), "--out", str(run), "--max-iters", "2"]
    args += ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "32", "--batch-size", "2"]
    args += ["--eval-interval", "2", "--eval-iters", "1", "--device", "cpu", "--dtype", "float32"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert (run / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    r = runner.invoke(
        app, ["sample", "--checkpoint", str(run), "--prompt", "café 🙂", "--max-new-tokens", "8", "--device", "cpu"]
    )
    assert r.exit_code == 0, r.output
    out = tmp_path / "export"
    r = runner.invoke(app, ["export", str(run), "--format", "hf", "--out", str(out)])
    assert r.exit_code == 0, r.output
    back = transformers.AutoTokenizer.from_pretrained(str(out))
    ours = build_tokenizer(str(folder))
    for text in HELD_OUT:
        assert back(text)["input_ids"] == ours.encode_document(text), text
    generation = json.loads((out / "generation_config.json").read_text())
    assert sorted(generation["eos_token_id"]) == sorted(ours.stop_ids) and generation["bos_token_id"] == 1


def test_chat_data_with_the_tokenizers_template_and_export_back(tmp_path):
    """prepare --format chat on a Hugging Face tokenizer renders its own template (ChatML) with its special
    tokens; the ids equal apply_chat_template's, and an export writes the template back."""
    from nanogpt_cli.data.chat import prepare_chat
    from nanogpt_cli.data.chat_template import ChatTemplate, specials
    from nanogpt_cli.data.reader import load_meta
    from nanogpt_cli.interop.export import export_hf

    folder = byte_level(tmp_path / "bl")
    chats = tmp_path / "chats.jsonl"
    convs = [
        [{"role": "user", "content": f"hi {i} café"}, {"role": "assistant", "content": f"hello 🙂 {i}"}]
        for i in range(4)
    ]
    convs[0] = [{"role": "system", "content": "be brief"}, *convs[0]]
    chats.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs), encoding="utf-8")
    prepare_chat(str(chats), "chats", tokenizer=str(folder), data_dir=str(tmp_path / "data"))
    meta = load_meta(tmp_path / "data", "chats")
    assert meta["chat_template"] == CHATML and (tmp_path / "data" / "chats" / "tokenizer.json").is_file()
    tok = read_hf_tokenizer(str(folder))
    template = ChatTemplate(CHATML, special=specials(tok))
    ref = theirs(folder)
    for conv in convs:
        expect = ref.apply_chat_template(conv, chat_template=CHATML, tokenize=True, add_generation_prompt=True)
        expect = expect["input_ids"] if isinstance(expect, dict) or hasattr(expect, "keys") else expect
        assert template.tokens(conv, tok) == list(expect)
    model = forced_model(tok, tok.token_id("<|im_end|>"))
    export_hf(model, tok.describe(), tmp_path / "out", chat_template=CHATML, tokenizer=tok)
    back = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert back.chat_template == CHATML
    assert back.apply_chat_template(convs[1], tokenize=False, add_generation_prompt=True) == template.render(convs[1])


def test_serve_stops_at_the_end_of_turn(tmp_path):
    """serve on an export whose model writes <|im_end|> (named by generation_config.json) ends the reply there."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from nanogpt_cli.config import LoadSpec
    from nanogpt_cli.interop.export import export_hf
    from nanogpt_cli.serve import ServeOptions, build_server

    folder = byte_level(tmp_path / "bl")
    tok = read_hf_tokenizer(str(folder))
    export_hf(forced_model(tok, tok.token_id("<|im_end|>")), tok.describe(), tmp_path / "m", tokenizer=tok)
    server = build_server(ServeOptions(LoadSpec(str(tmp_path / "m"), device="cpu", dtype="float32"), port=0))
    state = server.state
    state.scheduler.start()
    try:
        with TestClient(server.config.app, base_url="http://127.0.0.1") as client:  # a name the server answers
            r = client.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9}
            )
    finally:
        state.scheduler.stop()
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == ""
    assert r.json()["usage"]["completion_tokens"] == 1


def test_gguf_export_writes_llama_cpps_vocabulary_and_reads_back(hf_dir, tmp_path):
    gguf = pytest.importorskip("gguf")
    from nanogpt_cli.interop.export import export_gguf
    from nanogpt_cli.interop.loading import load_model, tokenizer_of

    tok = read_hf_tokenizer(str(hf_dir))
    model = forced_model(tok, 3)
    model.config.mlp = "gelu_tanh"  # llama.cpp's GELU
    out = tmp_path / "m.gguf"
    export_gguf(model, tok.describe(), out, tokenizer=tok)
    fields = gguf.GGUFReader(str(out)).fields
    sentencepiece_kind = (hf_dir / "chat_template.jinja").exists()
    assert fields["tokenizer.ggml.model"].contents() == ("llama" if sentencepiece_kind else "gpt2")
    tokens = fields["tokenizer.ggml.tokens"].contents()
    assert tokens[: tok.vocab_size] == [tok.token_text(i) for i in range(tok.vocab_size)]
    assert bool(fields["tokenizer.ggml.add_bos_token"].contents()) == (tok.bos_id is not None)
    _, meta = load_model(out)
    again = tokenizer_of(meta, out)
    assert again.encode_special(HELD_OUT[3]) == tok.encode_special(HELD_OUT[3])


def test_lora_finetune_of_an_hf_folder_on_its_own_template(tmp_path):
    """finetune --init-from a Hugging Face folder with a tokenizer of its own, on chat data prepared with that
    folder's tokenizer and template: the run keeps both, and its chat stops at the model's end of turn."""
    from typer.testing import CliRunner

    from nanogpt_cli.cli import app
    from nanogpt_cli.inference.chat import ChatSession
    from nanogpt_cli.inference.sample import SampleSettings
    from nanogpt_cli.interop.export import export_hf

    folder = byte_level(tmp_path / "bl")
    tok = read_hf_tokenizer(str(folder))
    model_dir = tmp_path / "model"
    model = forced_model(tok, tok.token_id("<|im_end|>"))
    export_hf(model, tok.describe(), model_dir, chat_template=tok.chat_template, tokenizer=tok)
    chats = tmp_path / "chats.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "ok"}]} for i in range(6)
    ]
    chats.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    runner = CliRunner()
    data = tmp_path / "data"
    args = ["prepare", str(chats), "--name", "chats", "--format", "chat", "--tokenizer", str(model_dir)]
    r = runner.invoke(app, [*args, "--data-dir", str(data)])
    assert r.exit_code == 0, r.output
    run = tmp_path / "run"
    args = ["finetune", "--data", "chats", "--data-dir", str(data), "--init-from", str(model_dir), "--lora"]
    args += ["--out", str(run), "--max-iters", "1", "--batch-size", "2", "--eval-interval", "1"]
    r = runner.invoke(app, [*args, "--eval-iters", "1", "--device", "cpu", "--dtype", "float32"])
    assert r.exit_code == 0, r.output
    assert (run / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    session = ChatSession.load(run, SampleSettings(temperature=0, max_new_tokens=5), device="cpu")
    assert session.template.source == CHATML
    reply = session.ask("hello")
    assert "".join(reply) == "" and reply.stop_reason == "eot"


def test_hf_name_reads_the_hubs_cache_offline(tmp_path, monkeypatch, no_network):
    """hf:NAME goes through huggingface_hub's snapshot_download, which offline answers from its cache: a cache
    laid out as the hub writes it (refs/main -> snapshots/COMMIT/) gives the tokenizer, named hf:NAME."""
    import huggingface_hub.constants

    home = tmp_path / "hf"
    repo = home / "hub" / "models--someone--tiny"
    commit = "0" * 40
    byte_level(repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(home / "hub"))
    tok = build_tokenizer("hf:someone/tiny")
    assert tok.name == "hf:someone/tiny" and tok.chat_template == CHATML
    assert tok.encode_special("<|im_end|>") == [tok.token_id("<|im_end|>")]


def test_tokenizer_info_and_encode_commands(tmp_path):
    from typer.testing import CliRunner

    from nanogpt_cli.cli import app

    folder = sentencepiece(tmp_path / "sp")
    runner = CliRunner()
    info = json.loads(runner.invoke(app, ["tokenizer", "info", str(folder), "--json"]).output)
    assert info["bos_id"] == 1 and info["eot_id"] == 2 and info["chat_template"] is True
    assert sorted(info["stop_ids"]) == [2, build_tokenizer(str(folder)).token_id("<end_of_turn>")]
    encoded = json.loads(runner.invoke(app, ["tokenizer", "encode", str(folder), "a <end_of_turn>", "--json"]).output)
    assert encoded["ids"][-1] == build_tokenizer(str(folder)).token_id("<end_of_turn>")


def test_prepare_in_worker_processes_gives_the_same_shards(tmp_path, text_file):
    """--num-proc 2: each worker builds the tokenizer from the file's text it is handed."""
    from nanogpt_cli.data import prepare

    folder = byte_level(tmp_path / "bl")
    one = prepare(str(text_file), "one", tokenizer=str(folder), data_dir=tmp_path / "data")
    two = prepare(str(text_file), "two", tokenizer=str(folder), data_dir=tmp_path / "data", num_proc=2)
    assert one.train_tokens == two.train_tokens and one.val_tokens == two.val_tokens
    for split in ("train", "val"):
        a = (tmp_path / "data" / "one" / f"{split}-00000.bin").read_bytes()
        assert a == (tmp_path / "data" / "two" / f"{split}-00000.bin").read_bytes()


def test_a_chat_template_file_that_is_not_utf8_is_one_sentence(tmp_path):
    folder = byte_level(tmp_path / "bl")
    (folder / "chat_template.jinja").write_bytes(b"{{ messages }}\xff\xfe")
    with pytest.raises(NanoGPTError, match=r"chat_template\.jinja is not UTF-8 text"):
        build_tokenizer(str(folder))
