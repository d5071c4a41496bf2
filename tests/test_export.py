"""Export to Hugging Face folders and GGUF files, checked with clients nobody here wrote: transformers (models,
tokenizers, pipeline, its GGUF reader) and gguf's GGUFReader. Tiny random models; nothing is downloaded."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from nanogpt_cli.cli import app
from nanogpt_cli.config import GPTConfig
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.inference.sample import Sampler, SampleSettings
from nanogpt_cli.interop import hf
from nanogpt_cli.interop.export import export, export_gguf, export_hf
from nanogpt_cli.model import GPT
from nanogpt_cli.runs.checkpoint import save_model
from nanogpt_cli.tokenizer import build_tokenizer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # transformers takes seconds to import and to build its models
pytest.importorskip("tokenizers")

MIXED = "Ünïcödé — “quoth” the king, 🙂 naïve café; 東京 ok\n\tTabs,  two spaces and 1234 digits.\n"

ARCHS = {  # our config flags -> the stock architecture that computes them
    "gpt2": (dict(pos_encoding="learned", mlp="gelu_tanh", bias=True), "GPT2LMHeadModel"),
    "gpt2-sinusoidal": (dict(pos_encoding="sinusoidal", mlp="gelu", tie_embeddings=False), "GPT2LMHeadModel"),
    "llama": (dict(norm="rmsnorm", mlp="swiglu", rope_theta=500.0), "LlamaForCausalLM"),
    "llama-bias": (dict(norm="rmsnorm", mlp="swiglu", bias=True, tie_embeddings=False), "LlamaForCausalLM"),
    "neox": (dict(mlp="gelu"), "GPTNeoXForCausalLM"),  # RoPE, LayerNorm, exact GELU, no biases (older runs)
    "neox-default": (dict(), "GPTNeoXForCausalLM"),  # our default: the same with the tanh GELU
    "neox-bias": (dict(bias=True, mlp="gelu_tanh"), "GPTNeoXForCausalLM"),
    # Pythia's: the parallel residual, RoPE on a quarter of each head
    "neox-pythia": (dict(bias=True, mlp="gelu", parallel_residual=True, rotary_dim=2), "GPTNeoXForCausalLM"),
}


def tiny_model(vocab_size: int, seed: int = 0, **flags) -> GPT:
    """A random model whose biases and norm gains are random too, so a misplaced one shows in the logits."""
    torch.manual_seed(seed)
    shape = {"block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 16, **flags}
    model = GPT(GPTConfig(vocab_size=vocab_size, **shape)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.1)
    return model


def tensors(path: Path) -> dict[str, bytes]:
    from safetensors.torch import load_file

    return {k: v.numpy().tobytes() for k, v in load_file(str(path)).items()}


def nothing_written(parent: Path, out: Path) -> bool:
    return not out.exists() and not any(p.name.startswith(f".{out.name}.") for p in parent.iterdir())


@pytest.mark.parametrize("arch", list(ARCHS))
def test_hf_export_computes_our_function_and_round_trips(arch, tmp_path):
    flags, cls = ARCHS[arch]
    tok = build_tokenizer("char", [MIXED])
    model = tiny_model(tok.vocab_size, **flags)
    out = tmp_path / "export"
    assert export_hf(model, tok.describe(), out).architecture == cls

    ref = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(ref).__name__ == cls
    idx = torch.tensor([tok.encode(MIXED)[:32]])
    with torch.no_grad():
        assert (ref(idx).logits - model(idx)[0]).abs().max().item() <= 1e-4

    # greedy decoding: transformers' generate against the sampler that `nanogpt sample --temperature 0` runs
    save_model(tmp_path / "run.safetensors", model, {"tokenizer": tok.describe()})
    sampler = Sampler.load(tmp_path / "run.safetensors", device="cpu", dtype="float32")
    prompt = "the king"
    ours = sampler.generate(prompt, SampleSettings(max_new_tokens=20, temperature=0)).token_ids
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    prompt_ids = hf_tok(prompt, return_tensors="pt")["input_ids"]
    theirs = ref.generate(prompt_ids, max_new_tokens=20, do_sample=False)[0, prompt_ids.size(1) :].tolist()
    assert theirs == ours

    # export -> load back as ours -> export again: the same tensors, byte for byte
    back, desc = hf.load_pretrained(out)
    assert desc == tok.describe()
    export_hf(back, desc, tmp_path / "again")
    assert tensors(out / "model.safetensors") == tensors(tmp_path / "again" / "model.safetensors")


@pytest.mark.parametrize("umask,file_mode,folder_mode", [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750)])
def test_exported_files_get_the_mode_the_umask_gives_a_new_file(umask, file_mode, folder_mode, tmp_path):
    """safetensors creates model.safetensors 0600; every file of an export gets the mode of any other new file."""
    import os

    tok = build_tokenizer("byte")
    model = tiny_model(tok.vocab_size, norm="rmsnorm", mlp="swiglu")
    old = os.umask(umask)
    try:
        export_hf(model, tok.describe(), tmp_path / "hf")
        export_hf(model, tok.describe(), tmp_path / "hf", force=True)  # a replaced export too
        export_gguf(model, tok.describe(), tmp_path / "model.gguf")
    finally:
        os.umask(old)
    files = [*(tmp_path / "hf").iterdir(), tmp_path / "model.gguf"]
    modes = {p.name: p.stat().st_mode & 0o777 for p in files}
    assert "model.safetensors" in modes and set(modes.values()) == {file_mode}, modes
    assert (tmp_path / "hf").stat().st_mode & 0o777 == folder_mode


def test_hf_export_files_load_in_older_transformers_too(tmp_path):
    """The keys transformers 4.x reads: RoPE base at the top level, a tokenizer class it knows, n_ctx for GPT-2."""
    tok = build_tokenizer("byte")
    export_hf(tiny_model(256, **ARCHS["llama"][0]), tok.describe(), tmp_path / "llama")
    export_hf(tiny_model(256, **ARCHS["gpt2"][0]), tok.describe(), tmp_path / "gpt2")
    export_hf(tiny_model(256), tok.describe(), tmp_path / "neox")
    llama = json.loads((tmp_path / "llama" / "config.json").read_text())
    assert llama["rope_theta"] == 500.0 and llama["bos_token_id"] is None and llama["eos_token_id"] is None
    assert json.loads((tmp_path / "gpt2" / "config.json").read_text())["n_ctx"] == 32
    neox = json.loads((tmp_path / "neox" / "config.json").read_text())
    assert neox["rotary_pct"] == 1.0 and neox["rotary_emb_base"] == 10000.0 and not neox["use_parallel_residual"]
    tokenizer_config = json.loads((tmp_path / "neox" / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert {p.name for p in (tmp_path / "neox").iterdir()} == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }


@pytest.mark.parametrize("name", ["gpt2", "char", "byte"])
def test_exported_tokenizer_has_our_ids(name, tmp_path):
    tok = build_tokenizer(name, [MIXED])
    export_hf(tiny_model(tok.vocab_size, n_layer=1), tok.describe(), tmp_path / "export")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    ids = tok.encode(MIXED)
    assert hf_tok(MIXED)["input_ids"] == ids
    assert hf_tok.decode(ids) == MIXED == tok.decode(ids)
    generation = json.loads((tmp_path / "export" / "generation_config.json").read_text())
    assert generation.get("eos_token_id") == tok.eot_id  # 50256 for gpt2; none for char and byte
    if name == "gpt2":
        assert hf_tok.eos_token == "<|endoftext|>" and hf_tok.convert_tokens_to_ids("<|endoftext|>") == 50256
    assert hf.describe_hf_tokenizer(hf_tok.backend_tokenizer) == tok.describe()


def test_pipeline_generates_from_an_export(tmp_path):
    tok = build_tokenizer("char", [MIXED])
    export_hf(tiny_model(tok.vocab_size), tok.describe(), tmp_path / "export")
    generator = transformers.pipeline("text-generation", model=str(tmp_path / "export"), device="cpu")
    text = generator("the king", max_new_tokens=5, do_sample=False)[0]["generated_text"]
    assert text.startswith("the king") and len(text) == len("the king") + 5


def test_a_padded_vocabulary_never_generates_a_padding_token(tmp_path):
    tok = build_tokenizer("char", [MIXED])
    model = tiny_model(tok.vocab_size + 7)
    with torch.no_grad():
        model.lm_head.weight[tok.vocab_size :] *= 50  # make the padding rows win if nothing stops them
    export_hf(model, tok.describe(), tmp_path / "export")
    generation = json.loads((tmp_path / "export" / "generation_config.json").read_text())
    assert generation["suppress_tokens"] == list(range(tok.vocab_size, tok.vocab_size + 7))
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    out = ref.generate(torch.tensor([tok.encode("the")]), max_new_tokens=10, do_sample=False)
    assert out.max().item() < tok.vocab_size


# --- GGUF ------------------------------------------------------------------------------------------------


def read_gguf(path: Path) -> tuple[dict, dict]:
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}  # ggml lists dims reversed
    return fields, shapes


def test_gguf_llama_reads_back_with_our_logits(tmp_path):
    """transformers' GGUF reader rebuilds the model from the file's metadata and tensors alone. Slow-ish (~15 s):
    it parses GPT-2's 50,257 tokens and 50,000 merges in Python, twice."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    tok = build_tokenizer("gpt2")
    model = tiny_model(tok.vocab_size, **ARCHS["llama"][0])
    path = tmp_path / "model.gguf"
    assert export_gguf(model, tok.describe(), path).architecture == "llama"
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name).eval()
    assert type(ref).__name__ == "LlamaForCausalLM" and ref.config.num_hidden_layers == 2
    idx = torch.tensor([tok.encode(MIXED)[:32]])
    with torch.no_grad():
        assert (ref(idx).logits - model(idx)[0]).abs().max().item() <= 1e-4


def test_gguf_gpt2_shape_and_metadata(tmp_path):
    """What llama.cpp reads: architecture, sizes, norm eps, the tokenizer's tokens, types, merges and special ids.
    Slow-ish (~8 s): GGUFReader parses the 50,304 tokens and 50,000 merges in Python."""
    gguf = pytest.importorskip("gguf")
    tok = build_tokenizer("gpt2")
    model = tiny_model(50304, pos_encoding="learned", mlp="gelu_tanh")  # padded vocabulary, no biases
    path = tmp_path / "model.gguf"
    assert export_gguf(model, tok.describe(), path).architecture == "gpt2"
    fields, shapes = read_gguf(path)
    assert fields["general.architecture"] == "gpt2" and fields["gpt2.context_length"] == 32
    assert fields["gpt2.block_count"] == 2 and fields["gpt2.attention.head_count"] == 2
    assert fields["gpt2.embedding_length"] == 16 and fields["gpt2.feed_forward_length"] == 64
    assert fields["gpt2.attention.layer_norm_epsilon"] == pytest.approx(1e-5)
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "gpt-2"
    assert fields["tokenizer.ggml.eos_token_id"] == fields["tokenizer.ggml.bos_token_id"] == 50256
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    assert len(tokens) == 50304 and tokens[262] == "Ġthe" and tokens[50256] == "<|endoftext|>"
    assert tokens[-1] == "[PAD50303]" and types[-1] == gguf.TokenType.UNUSED
    assert types[50256] == gguf.TokenType.CONTROL and types[262] == gguf.TokenType.NORMAL
    assert len(fields["tokenizer.ggml.merges"]) == 50000 and fields["tokenizer.ggml.merges"][0] == "Ġ t"
    assert shapes["position_embd.weight"] == (32, 16) and shapes["blk.0.attn_qkv.weight"] == (48, 16)
    assert shapes["blk.0.attn_qkv.bias"] == (48,) and shapes["output.weight"] == (50304, 16)


# --- refusals: one sentence, nothing written --------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, fmt, tokenizer, message",
    [
        (
            dict(pos_encoding="learned", norm="rmsnorm"),
            "hf",
            "byte",
            "closest, GPT2LMHeadModel, which has --pos-encoding learned, needs --norm layernorm",
        ),
        (
            dict(norm="rmsnorm"),
            "hf",
            "byte",
            "closest, LlamaForCausalLM, which has --norm rmsnorm, needs --mlp swiglu$",
        ),
        (dict(mlp="swiglu"), "hf", "byte", "closest, LlamaForCausalLM, which has --mlp swiglu, needs --norm rmsnorm$"),
        (dict(mlp="relu2"), "hf", "byte", "closest, GPTNeoXForCausalLM, needs --mlp gelu or gelu_tanh$"),
        (
            dict(norm="rmsnorm", mlp="relu2"),
            "hf",
            "byte",
            "closest, LlamaForCausalLM, which has --norm rmsnorm, needs --mlp swiglu$",
        ),
        (dict(qk_norm=True), "hf", "byte", "closest, Qwen3ForCausalLM, which has --qk-norm, needs --norm rmsnorm"),
        (dict(), "hf", "cl100k_base", "the cl100k_base tokenizer does not export"),
        (
            dict(mlp="gelu"),
            "gguf",
            "gpt2",
            r"^llama.cpp's starcoder2 does not compute --mlp gelu: it needs --mlp gelu_tanh \(llama.cpp computes "
            r"GELU with the tanh approximation only\)$",
        ),
        (dict(pos_encoding="learned", mlp="gelu"), "gguf", "gpt2", "needs --mlp gelu_tanh"),
        (
            dict(mlp="relu2"),
            "gguf",
            "byte",
            "needs a model llama.cpp computes exactly: .* needs --mlp gelu or gelu_tanh$",
        ),
        (
            dict(norm="rmsnorm", mlp="swiglu"),
            "gguf",
            "cl100k_base",
            "supports the gpt2, char, byte and trained tokenizers, not cl100k_base",
        ),
        (dict(), "gguf", "char", "of several UTF-8 bytes .*; prepare with --tokenizer byte or a trained tokenizer"),
    ],
)
def test_unsupported_exports_are_one_sentence_and_write_nothing(flags, fmt, tokenizer, message, tmp_path):
    desc = {"name": tokenizer, "vocab_size": 256 if tokenizer == "byte" else 100277}
    if tokenizer == "char":
        desc = build_tokenizer("char", [MIXED]).describe()
    model = tiny_model(desc["vocab_size"], n_layer=1, **flags)
    out = tmp_path / ("model.gguf" if fmt == "gguf" else "export")
    with pytest.raises(NanoGPTError, match=message) as e:
        (export_hf if fmt == "hf" else export_gguf)(model, desc, out)
    assert "\n" not in str(e.value)
    assert nothing_written(tmp_path, out)


def test_cli_export_writes_once_and_refuses_to_overwrite(trained_run, tmp_path):
    runner = CliRunner()
    out = tmp_path / "exported"
    result = runner.invoke(app, ["export", str(trained_run), "--format", "hf", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "GPTNeoXForCausalLM" in result.output and (out / "model.safetensors").is_file()
    before = tensors(out / "model.safetensors")
    again = runner.invoke(app, ["export", str(trained_run), "--out", str(out)])
    assert again.exit_code == 1 and "already exists; pass --force" in again.output
    assert runner.invoke(app, ["export", str(trained_run), "--out", str(out), "--force"]).exit_code == 0
    assert tensors(out / "model.safetensors") == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left behind
    gguf = runner.invoke(app, ["export", str(trained_run), "--format", "gguf", "--out", str(tmp_path / "m.gguf")])
    assert gguf.exit_code == 1 and gguf.output.count("\n") == 1 and not (tmp_path / "m.gguf").exists()
    bad = runner.invoke(app, ["export", str(trained_run), "--format", "onnx", "--out", str(tmp_path / "x")])
    assert bad.exit_code == 1 and "--format must be one of hf, gguf" in bad.output


def test_info_and_runs_say_what_an_export_folder_is(trained_run, tmp_path):
    """An export folder is described as one (architecture, size, the run and step it came from), not a damaged run."""
    runner = CliRunner()
    exports = tmp_path / "exports"
    out = exports / "shk"
    assert runner.invoke(app, ["export", str(trained_run), "--format", "hf", "--out", str(out)]).exit_code == 0
    step = json.loads((trained_run / "trainer.json").read_text())["step"]
    info = runner.invoke(app, ["info", str(out)], terminal_width=200)
    assert info.exit_code == 0, info.output
    params = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(out).parameters())
    said = f"Hugging Face export: GPTNeoXForCausalLM, {params:,} parameters, from run {trained_run} step {step}"
    assert said in info.output and "damaged" not in info.output
    as_json = json.loads(runner.invoke(app, ["info", str(out), "--json"]).output)
    assert as_json["params"] == params and as_json["step"] == step and as_json["dataset"] == "play"
    for folder in (out, exports):  # the export itself, and a folder holding it
        listed = runner.invoke(app, ["runs", str(folder)], terminal_width=200)
        assert listed.exit_code == 0 and "damaged" not in listed.output and said in listed.output, listed.output
        row = json.loads(runner.invoke(app, ["runs", str(folder), "--json"]).output)
        assert row["status"] == "export" and row["step"] == step and row["params"] == params


def test_loading_what_is_not_a_usable_hf_model_is_one_sentence(tmp_path):
    with pytest.raises(NanoGPTError, match="is not a folder holding a Hugging Face model"):
        hf.load_pretrained(tmp_path / "nothing")
    # a tokenizer that is neither GPT-2's BPE nor one of our char/byte exports
    tk = pytest.importorskip("tokenizers")
    other = tk.Tokenizer(tk.models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    with pytest.raises(NanoGPTError, match="neither GPT-2's BPE nor a char, byte or trained vocabulary"):
        hf.describe_hf_tokenizer(other)
    # a model type with no counterpart
    config = transformers.GPTJConfig(vocab_size=10, n_positions=8, n_embd=8, n_layer=1, n_head=2, rotary_dim=4)
    transformers.GPTJForCausalLM(config).save_pretrained(tmp_path / "gptj")
    with pytest.raises(NanoGPTError, match="model_type 'gptj' has no counterpart in nanogpt"):
        hf.load_pretrained(tmp_path / "gptj")


def test_a_missing_optional_package_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "gguf", None)  # what `import gguf` sees when it is not installed
    tok = build_tokenizer("gpt2")
    with pytest.raises(NanoGPTError, match=r'needs the gguf package: pip install -e "\.\[hf\]"'):
        export_gguf(
            tiny_model(tok.vocab_size, n_layer=1, norm="rmsnorm", mlp="swiglu"), tok.describe(), tmp_path / "m.gguf"
        )
    assert not (tmp_path / "m.gguf").exists()


def test_export_reads_a_hugging_face_folder_too(tmp_path):
    tok = build_tokenizer("byte")
    model = tiny_model(256, **ARCHS["gpt2"][0])
    export_hf(model, tok.describe(), tmp_path / "a")
    export(tmp_path / "a", "hf", tmp_path / "b")
    assert tensors(tmp_path / "a" / "model.safetensors") == tensors(tmp_path / "b" / "model.safetensors")


# --- Hugging Face models coming in: --init-from, sample and eval ------------------------------------------


def save_random_gpt2(folder: Path, desc: dict, n_embd: int = 32) -> None:
    """A random GPT2LMHeadModel saved by transformers itself, with a tokenizer for `desc` beside it."""
    config = transformers.GPT2Config(
        vocab_size=desc["vocab_size"],
        n_positions=32,
        n_embd=n_embd,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    tok, eot = hf.tokenizers_object(desc)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eot).save_pretrained(folder)


def test_init_from_a_hugging_face_folder_trains_and_saves_our_run(char_data, tmp_path):
    from nanogpt_cli.data import load_meta
    from nanogpt_cli.training.plan import plan_run
    from nanogpt_cli.training.request import RunRequest
    from nanogpt_cli.training.trainer import train

    data_dir, name = char_data
    save_random_gpt2(tmp_path / "gpt2", load_meta(data_dir, name)["tokenizer"])
    flags = {
        "data": name,
        "data_dir": str(data_dir),
        "dtype": "float32",
        "device": "cpu",
        "max_iters": 20,
        "eval_interval": 20,
        "eval_iters": 4,
        "batch_size": 8,
        "warmup_iters": 0,
        "learning_rate": 3e-3,
    }
    plan = plan_run(RunRequest(flags, out=tmp_path / "run", init_from=str(tmp_path / "gpt2")))
    assert plan.model.pos_encoding == "learned" and plan.model.mlp == "gelu_tanh" and plan.model.n_embd == 32
    train(plan)
    losses = [
        m["val_loss"]
        for m in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
        if m.get("kind", "eval") == "eval"
    ]
    assert losses[0] == pytest.approx(torch.log(torch.tensor(plan.model.vocab_size * 1.0)).item(), abs=0.3)
    assert losses[-1] < losses[0] - 0.3
    assert (tmp_path / "run" / "model.safetensors").is_file()  # our usual run folder


def test_init_from_a_bpe_model_into_a_char_dataset_is_one_sentence(char_data, tmp_path):
    data_dir, name = char_data
    save_random_gpt2(tmp_path / "gpt2", build_tokenizer("gpt2").describe(), n_embd=8)
    result = CliRunner().invoke(
        app,
        [
            "train",
            "--data",
            name,
            "--data-dir",
            str(data_dir),
            "--out",
            str(tmp_path / "run"),
            "--init-from",
            str(tmp_path / "gpt2"),
        ],
    )
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        f"error: --init-from {tmp_path / 'gpt2'} uses the gpt2 tokenizer but dataset '{name}' was prepared with "
        "char; prepare it with --tokenizer gpt2"
    ]
    assert not (tmp_path / "run").exists()


def test_sample_and_eval_read_an_export_as_they_read_the_run(trained_run, char_data, tmp_path):
    data_dir, name = char_data
    runner = CliRunner()
    assert runner.invoke(app, ["export", str(trained_run), "--out", str(tmp_path / "hf")]).exit_code == 0
    outputs = {}
    for source in (str(trained_run), str(tmp_path / "hf")):
        sample = runner.invoke(
            app,
            [
                "sample",
                "--checkpoint",
                source,
                "--prompt",
                "The king",
                "--temperature",
                "0",
                "--max-new-tokens",
                "40",
                "--device",
                "cpu",
                "--dtype",
                "float32",
            ],
        )
        ppl = runner.invoke(
            app,
            [
                "eval",
                "perplexity",
                "--checkpoint",
                source,
                "--data",
                name,
                "--data-dir",
                str(data_dir),
                "--json",
                "--device",
                "cpu",
            ],
        )
        assert sample.exit_code == 0 and ppl.exit_code == 0, sample.output + ppl.output
        outputs[source] = sample.output, json.loads(ppl.output.strip().splitlines()[-1])["loss"]
    (run_text, run_loss), (hf_text, hf_loss) = outputs.values()
    assert hf_text == run_text and len(run_text) > 40
    assert hf_loss == pytest.approx(run_loss, abs=1e-5)


def test_a_hub_model_that_cannot_be_reached_is_one_sentence(tmp_path):
    import os
    import subprocess

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run(
        [sys.executable, "-m", "nanogpt_cli", "sample", "--checkpoint", "hf:nobody/nothing"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1
    cache = tmp_path / "hf" / "hub"
    assert proc.stderr.startswith(f"error: hf:nobody/nothing is not in the Hugging Face cache ({cache})")


# --- trained tokenizers, GGUF of the default config, quantized GGUF, reading our GGUF back -------------------

ASCII = "ROMEO: What light through yonder window breaks?\nJULIET: Ay me! 1234, said she.\n" * 12


def trained_bpe(pattern: str = "gpt4", vocab_size: int = 300):
    from nanogpt_cli.tokenizer import train_bpe
    from conftest import make_text

    return train_bpe([make_text(lines=150, seed=3)], vocab_size, "play", pattern)


def fitted_model(tok, steps: int = 40, **flags) -> GPT:
    """A default-config model (n_embd 32: whole q8_0 blocks) fitted a little to ASCII, so greedy text is
    confident rather than random ties."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=2, n_head=2, n_embd=32, **flags))
    data = torch.tensor(tok.encode(ASCII))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - 33, (8,))
        x = torch.stack([data[s : s + 32] for s in starts])
        y = torch.stack([data[s + 1 : s + 33] for s in starts])
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def hf_greedy(folder: Path, gguf_name: str, prompt_ids: list[int], n: int) -> list[int]:
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_name).eval()
    out = ref.generate(torch.tensor([prompt_ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt_ids) :].tolist()


def our_greedy(model: GPT, desc: dict, prompt: str, n: int, tmp_path: Path) -> list[int]:
    save_model(tmp_path / "ours.safetensors", model, {"tokenizer": desc})
    sampler = Sampler.load(tmp_path / "ours.safetensors", device="cpu", dtype="float32")
    settings = SampleSettings(max_new_tokens=n, temperature=0, ignore_eot=True)
    return sampler.generate(prompt, settings).token_ids


@pytest.mark.parametrize("pattern", ["gpt2", "gpt4"])
def test_a_trained_tokenizer_exports_to_hugging_face_with_our_ids(pattern, tmp_path):
    tok = trained_bpe(pattern)
    export_hf(tiny_model(tok.vocab_size, n_layer=1), tok.describe(), tmp_path / "export")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    held_out = MIXED + "  The KING's 12345 men\r\n\n\n  "  # not in the training text
    ids = tok.encode(held_out)
    assert hf_tok(held_out)["input_ids"] == ids and hf_tok.decode(ids) == held_out
    assert hf_tok.eos_token == "<|endoftext|>" and hf_tok.convert_tokens_to_ids("<|endoftext|>") == tok.eot_id
    back = hf.describe_hf_tokenizer(hf_tok.backend_tokenizer)
    assert {**back, "name": tok.name} == tok.describe()


@pytest.mark.parametrize("tokenizer", ["char", "byte", "trained"])
def test_gguf_of_the_default_config_reads_back_in_transformers_with_our_ids_and_greedy_text(tokenizer, tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    tok = trained_bpe() if tokenizer == "trained" else build_tokenizer(tokenizer, [ASCII])
    model = fitted_model(tok)  # the default config: RoPE, LayerNorm, tanh GELU, no biases
    path = tmp_path / "model.gguf"
    assert export_gguf(model, tok.describe(), path).architecture == "starcoder2"
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    text = ASCII[:120] if tokenizer == "char" else MIXED + ASCII[:80]
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    prompt = "ROMEO: What"
    ours = our_greedy(model, tok.describe(), prompt, 20, tmp_path)
    assert hf_greedy(tmp_path, path.name, tok.encode(prompt), 20) == ours


def test_q8_0_gguf_keeps_the_greedy_text_and_is_smaller(tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    tok = build_tokenizer("char", [ASCII])
    model = fitted_model(tok, steps=80)
    full = export_gguf(model, tok.describe(), tmp_path / "f32.gguf")
    q8 = export_gguf(model, tok.describe(), tmp_path / "q8.gguf", quant="q8_0")
    f16 = export_gguf(model, tok.describe(), tmp_path / "f16.gguf", quant="f16")
    assert q8.f32_bytes == full.bytes == full.f32_bytes and f16.bytes < full.bytes
    assert q8.bytes < f16.bytes and q8.bytes < 0.5 * full.bytes
    prompt = tok.encode("ROMEO: What")
    greedy = {name: hf_greedy(tmp_path, name, prompt, 12) for name in ("f32.gguf", "q8.gguf", "f16.gguf")}
    assert greedy["q8.gguf"][:10] == greedy["f32.gguf"][:10] == greedy["f16.gguf"][:10]
    assert greedy["f32.gguf"] == our_greedy(model, tok.describe(), "ROMEO: What", 12, tmp_path)


def test_sample_eval_and_info_read_a_gguf_we_wrote(tmp_path):
    pytest.importorskip("gguf")
    tok = build_tokenizer("char", [ASCII])
    model = fitted_model(tok, steps=20)
    save_model(tmp_path / "run.safetensors", model, {"tokenizer": tok.describe()})
    runner = CliRunner()
    made = runner.invoke(
        app,
        [
            "export",
            str(tmp_path / "run.safetensors"),
            "--format",
            "gguf",
            "--quant",
            "q8_0",
            "--out",
            str(tmp_path / "m.gguf"),
        ],
    )
    assert made.exit_code == 0 and "q8_0" in made.output and "x smaller than float32" in made.output, made.output
    (tmp_path / "text.txt").write_text(ASCII[:400])
    outputs = []
    for source in ("run.safetensors", "m.gguf"):
        sample = runner.invoke(
            app,
            [
                "sample",
                "--checkpoint",
                str(tmp_path / source),
                "--prompt",
                "ROMEO:",
                "--temperature",
                "0",
                "--max-new-tokens",
                "30",
                "--device",
                "cpu",
            ],
        )
        ppl = runner.invoke(
            app,
            [
                "eval",
                "perplexity",
                "--checkpoint",
                str(tmp_path / source),
                "--input",
                str(tmp_path / "text.txt"),
                "--json",
                "--device",
                "cpu",
            ],
        )
        assert sample.exit_code == 0 and ppl.exit_code == 0, sample.output + ppl.output
        outputs.append((sample.output, json.loads(ppl.output.strip().splitlines()[-1])["loss"]))
    assert outputs[1][0][:16] == outputs[0][0][:16] and len(outputs[1][0]) > 30
    assert outputs[1][1] == pytest.approx(outputs[0][1], abs=0.02)  # q8_0 rounding, no more
    info = runner.invoke(app, ["info", str(tmp_path / "m.gguf"), "--json"])
    assert info.exit_code == 0, info.output
    shown = json.loads(info.output)
    assert shown["kind"] == "gguf (starcoder2)" and shown["model"]["n_embd"] == 32 and "char" in shown["tokenizer"]
    (tmp_path / "foreign.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    foreign = runner.invoke(app, ["sample", "--checkpoint", str(tmp_path / "foreign.gguf")])
    assert foreign.exit_code == 1 and foreign.output.count("\n") == 1


def test_gguf_refuses_a_pattern_llama_cpp_does_not_know_in_one_sentence(tmp_path):
    pytest.importorskip("gguf")
    tok = trained_bpe("nanochat")
    out = tmp_path / "model.gguf"
    with pytest.raises(
        NanoGPTError,
        match="llama.cpp has no pre-tokenizer for the split pattern of the play "
        "tokenizer \\(nanochat\\); train it with --pattern gpt2, gpt4 or gpt4o",
    ):
        export_gguf(tiny_model(tok.vocab_size, n_layer=1), tok.describe(), out, quant="q8_0")
    with pytest.raises(NanoGPTError, match="--quant must be one of f32, f16"):
        export_gguf(tiny_model(tok.vocab_size, n_layer=1), trained_bpe().describe(), out, quant="q3")
    assert nothing_written(tmp_path, out)
