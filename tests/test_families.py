"""Every Hugging Face family (interop/families/): a tiny random model built with transformers' own config class, set
the way the real configs are (grouped-query attention, biases, RoPE scaling, tied or untied, windows), saved beside
a tokenizer trained here; loaded from its folder, our logits equal transformers'; exported back, the folder loads
as the same family with bit-equal weights and equal config fields; an unsupported value is one sentence.

A new family: its file in interop/families/ and one entry in FAMILIES below."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import numpy as np  # noqa: E402
from test_hf_tokenizer import byte_level, sentencepiece  # noqa: E402

from nanogpt_cli.errors import NanoGPTError  # noqa: E402
from nanogpt_cli.interop.export import export  # noqa: E402
from nanogpt_cli.interop.families import FAMILIES as FAMILY_RECORDS  # noqa: E402
from nanogpt_cli.interop.loading import load_model  # noqa: E402

pytestmark = pytest.mark.slow  # transformers takes seconds to import and to build its models

V = 416  # rows of embeddings: above both test tokenizers' vocabularies (400 and about 300)
SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=64)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)
FAMILIES = {  # name -> (transformers config class, its arguments, tokenizer builder)
    "gpt2": (
        "GPT2Config",
        dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, activation_function="gelu_new"),
        byte_level,
    ),
    "llama2": ("LlamaConfig", dict(SMALL, num_attention_heads=4, tie_word_embeddings=False), sentencepiece),
    "llama3.2": (
        "LlamaConfig",
        dict(
            SMALL, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE
        ),
        byte_level,
    ),
    "smollm2": (
        "LlamaConfig",
        dict(SMALL, hidden_size=48, num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True),
        byte_level,
    ),
    "qwen2.5": (
        "Qwen2Config",
        dict(SMALL, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
        byte_level,
    ),
    "qwen3": (
        "Qwen3Config",
        dict(SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
        byte_level,
    ),
    "mistral": (
        "MistralConfig",
        dict(SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=6),
        sentencepiece,
    ),
    "pythia": (
        "GPTNeoXConfig",
        dict(SMALL, num_attention_heads=4, rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False),
        byte_level,
    ),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            SMALL,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=6,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],  # llama.cpp's gemma3 pattern
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
        ),
        sentencepiece,
    ),
}
IGNORED = {"transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype", "nanogpt_origin"}
DROPOUTS = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout", "attention_dropout")  # training only: 0


def special_ids(folder: Path) -> dict[str, int | None]:
    """config.json's bos/eos/pad ids as the tokenizer in `folder` names them (as a real model's config does)."""
    tok = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    settings = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    return {f"{k}_id": ids.get(settings.get(k)) for k in ("bos_token", "eos_token", "pad_token")}


def random_model(name: str, folder: Path, **changes):
    """The family's transformers model with every weight random (norm gains and biases too, so a misplaced one
    shows), saved to `folder` with its tokenizer; changes: config arguments besides the family's."""
    cls, kwargs, tokenizer = FAMILIES[name]
    tokenizer(folder)
    torch.manual_seed(0)
    dropouts = dict.fromkeys(set(DROPOUTS) & getattr(transformers, cls)().to_dict().keys(), 0.0)
    config = getattr(transformers, cls)(**{**kwargs, **changes}, **special_ids(folder), **dropouts)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, random_model(request.param, folder)


def test_a_family_loads_from_its_folder_with_transformers_logits(family):
    name, folder, ref = family
    ours, meta = load_model(folder)
    assert meta["hf_family"] == ref.config.model_type
    idx = torch.randint(0, V, (2, 20))  # longer than the windows
    with torch.no_grad():
        diff = (ours.eval()(idx)[0] - ref(idx).logits).abs().max().item()
    assert diff <= 1e-5, f"{name}: {diff}"


def test_a_family_exports_back_to_itself_bit_equal(family, tmp_path):
    name, folder, ref = family
    export(folder, "hf", tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(back) is type(ref)
    theirs, again = ref.state_dict(), back.state_dict()
    assert theirs.keys() == again.keys()
    for key, tensor in theirs.items():
        assert torch.equal(tensor, again[key]), f"{name}: {key}"
    original, exported = ref.config.to_dict(), back.config.to_dict()
    differ = {k: (v, exported.get(k)) for k, v in original.items() if k not in IGNORED and exported.get(k) != v}
    assert not differ, f"{name}: {differ}"


@pytest.mark.parametrize(
    "name,change,message",
    [
        ("llama2", dict(hidden_act="gelu"), "Llama's hidden_act = 'gelu' has no counterpart in nanogpt"),
        ("qwen2.5", dict(use_sliding_window=True), "Qwen2's use_sliding_window = True has no counterpart"),
        ("gemma3", dict(query_pre_attn_scalar=7), "Gemma 3's query_pre_attn_scalar = 7 has no counterpart"),
        ("gemma3", dict(attn_logit_softcapping=50.0), "Gemma 3's attn_logit_softcapping = 50.0 has no counterpart"),
    ],
)
def test_an_unsupported_config_value_is_one_sentence_naming_it(name, change, message, tmp_path):
    random_model(name, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text(encoding="utf-8"))
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}), encoding="utf-8")
    with pytest.raises(NanoGPTError, match=message) as e:
        load_model(tmp_path)
    assert "\n" not in str(e.value)


# heads of 16 where the family's test shape has 8: the fused step's attention reads heads in whole registers of 16
FUSED_SHAPES = {"gpt2": dict(n_embd=64), "pythia": dict(hidden_size=64), "gemma3": {}}


@pytest.mark.parametrize("name", list(FUSED_SHAPES))
def test_a_familys_decode_steps_through_the_fused_step_equal_its_steps_op_by_op(name, tmp_path):
    """A family loaded from its folder (whose forward equals transformers', above), its projections int8 under
    float32 activations: 14 decode steps of 3 rows, each at its own position and past the sliding window, give the
    same logits through the fused step as op by op."""
    from nanogpt_cli.inference.backends import native
    from nanogpt_cli.inference.backends.cpu import decode_plan, decode_step
    from nanogpt_cli.inference.backends.quantize import quantize_model
    from nanogpt_cli.inference.engine import KVCache

    if not native.available():
        pytest.skip(f"our kernels do not run here: {native.status()}")
    random_model(name, tmp_path, **FUSED_SHAPES[name])
    model, _ = load_model(tmp_path)
    plan = decode_plan(quantize_model(model.eval(), "int8", 32))
    assert plan.fused is not None
    idx = torch.randint(0, V, (3, 24))
    outs = []
    with torch.inference_mode():
        for p in (plan, plan._replace(fused=None)):
            cache = KVCache(model, 3)
            model.hidden_states(idx[:, :9], cache=cache.view(0, 3))
            cache.pos = [9, 5, 2]
            outs.append(torch.stack([decode_step(p, idx[:, t], cache) for t in range(9, 23)]))
    fused, by_op = outs
    assert (fused - by_op).abs().max().item() <= 1e-5 * by_op.abs().max().item()


# --- GGUF files as llama.cpp's converter writes them ----------------------------------------------------------

GGUF_ARCHS = {"llama2": "llama", "llama3.2": "llama", "smollm2": "llama", "qwen2.5": "qwen2", "qwen3": "qwen3"}
GGUF_ARCHS |= {"gemma3": "gemma3", "gpt2": "gpt2", "pythia": "gptneox"}
# llama.cpp computes GELU with the tanh approximation: a Pythia in GGUF computes the tanh one (Pythia's is exact)
GGUF_CHANGES = {"pythia": dict(hidden_act="gelu_new")}


def gguf_source(name: str, folder: Path):
    """random_model as a GGUF of its family computes it."""
    return random_model(name, folder, **GGUF_CHANGES.get(name, {}))


def permute(w, n_head: int, n_kv: int):
    """convert_hf_to_gguf.py's LlamaModel.permute: q and k rows in llama.cpp's interleaved-pair order."""
    n = n_kv if n_kv != n_head else n_head
    return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GPT2_NAMES = {"wte": "token_embd", "wpe": "position_embd", "ln_f": "output_norm", "ln_1": "attn_norm"}
GPT2_NAMES |= {"attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm"}
GPT2_NAMES |= {"mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")  # (in, out) in transformers
NEOX_NAMES = {"embed_in": "token_embd", "final_layer_norm": "output_norm", "input_layernorm": "attn_norm"}
NEOX_NAMES |= {"attention.query_key_value": "attn_qkv", "attention.dense": "attn_output"}
NEOX_NAMES |= {"post_attention_layernorm": "ffn_norm", "mlp.dense_h_to_4h": "ffn_up", "mlp.dense_4h_to_h": "ffn_down"}


def layernorm_converter_tensors(ref, arch: str) -> dict:
    """convert_hf_to_gguf.py's GPT2Model (Conv1D matrices transposed to (out, in)) and GPTNeoXModel
    (query_key_value's rows, q, k, v of head 0, then head 1, ..., reordered into q of every head, k, v)."""
    c = ref.config
    names = GPT2_NAMES if arch == "gpt2" else NEOX_NAMES
    out = {}
    for key, tensor in ref.state_dict().items():
        t = tensor.float().numpy()
        if key in ("lm_head.weight", "embed_out.weight"):
            if not c.tie_word_embeddings:
                out["output.weight"] = t
            continue
        parts = key.split(".")[1:]  # without transformer. / gpt_neox.
        layer = f"blk.{parts[1]}." if parts[0] in ("h", "layers") else ""
        module = ".".join(parts[2:-1] if layer else parts[:-1])
        if arch == "gpt2" and parts[-1] == "weight" and module in CONV1D:
            t = t.T
        if module == "attention.query_key_value":
            n, hs = c.num_attention_heads, c.hidden_size // c.num_attention_heads
            heads = t.reshape(n, 3, hs, *t.shape[1:])
            t = np.concatenate([heads[:, j].reshape(n * hs, *t.shape[1:]) for j in range(3)], axis=0)
        out[f"{layer}{names[module]}.{parts[-1]}"] = np.ascontiguousarray(t)
    return out


def converter_tensors(ref, arch: str) -> dict:
    """The model's tensors under llama.cpp's names, transformed as its converter does."""
    if arch in ("gpt2", "gptneox"):
        return layernorm_converter_tensors(ref, arch)
    c = ref.config
    names = {"embed_tokens": "token_embd", "norm": "output_norm", "input_layernorm": "attn_norm"}
    names |= {f"self_attn.{p}_proj": f"attn_{p}" for p in "qkv"} | {"self_attn.o_proj": "attn_output"}
    names |= {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    names |= {f"mlp.{p}_proj": f"ffn_{p}" for p in ("gate", "up", "down")}
    if arch == "gemma3":
        names |= {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm"}
        names |= {"post_feedforward_layernorm": "post_ffw_norm"}
    else:
        names["post_attention_layernorm"] = "ffn_norm"
    out = {}
    for key, tensor in ref.state_dict().items():
        t = tensor.float().numpy()
        if key == "lm_head.weight":
            if not c.tie_word_embeddings:
                out["output.weight"] = t
            continue
        parts = key.removeprefix("model.").split(".")
        layer = f"blk.{parts[1]}." if parts[0] == "layers" else ""
        module = ".".join(parts[2:-1] if layer else parts[:-1])
        name = f"{layer}{names[module]}.{parts[-1]}"
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            kv = c.num_attention_heads if module.endswith("q_proj") else c.num_key_value_heads
            t = permute(t, c.num_attention_heads, kv)
        if arch == "gemma3" and name.endswith("norm.weight"):
            t = t + 1.0  # Gemma3Model.norm_shift
        out[name] = t
    return out


def converter_keys(w, c, arch: str, tensors: dict) -> None:
    """The ARCH.* keys convert_hf_to_gguf.py writes for the architecture (set_gguf_parameters)."""
    if arch == "gpt2":  # GPT2Model
        w.add_block_count(c.n_layer)
        w.add_context_length(c.n_positions)  # config.json's n_ctx
        w.add_embedding_length(c.n_embd)
        w.add_feed_forward_length(4 * c.n_embd)
        w.add_head_count(c.n_head)
        w.add_layer_norm_eps(c.layer_norm_epsilon)
        return
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    if arch == "gptneox":  # GPTNeoXModel
        partial = getattr(c, "rotary_pct", None) or c.rope_parameters["partial_rotary_factor"]
        w.add_rope_dimension_count(int(partial * (c.hidden_size // c.num_attention_heads)))
        w.add_parallel_residual(c.use_parallel_residual)
        w.add_layer_norm_eps(c.layer_norm_eps)
        return
    w.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if arch == "gemma3":
        w.add_sliding_window(c.sliding_window)
    if rope.get("rope_type") == "llama3":  # LlamaModel.generate_extra_tensors: rope_freqs
        tensors["rope_freqs.weight"] = llama3_factors(rope, head_dim)


def write_converter_gguf(
    ref, folder: Path, arch: str, path: Path, quant: str = "f32", raw=None, without: tuple[str, ...] = ()
) -> None:
    """A GGUF file as llama.cpp's converter writes this model and the tokenizer in `folder`; quant: the type of the
    matrices (f16, or gguf's own quantizer where their rows are whole blocks), as the converter's --outtype does;
    raw(name, shape): a matrix's own bytes and type, or None; without: tensors left out (an odd file)."""
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), arch)
    tensors = {k: t for k, t in converter_tensors(ref, arch).items() if k not in without}
    converter_keys(w, ref.config, arch, tensors)
    add_vocabulary(w, folder, gguf, pre="olmo" if arch == "gptneox" else "gpt-2")  # the converter's GPT-NeoX name
    qtype = getattr(gguf.GGMLQuantizationType, quant.upper())
    for name, t in tensors.items():
        t = np.ascontiguousarray(t, dtype=np.float32)
        if callable(raw) and t.ndim == 2:  # raw(name, shape) -> (bytes, type), or None to write it as float
            if (given := raw(name, t.shape)) is not None:
                w.add_tensor(name, given[0], raw_shape=given[0].shape, raw_dtype=given[1])
                continue
        if quant not in ("f32", "f16") and t.ndim == 2 and t.shape[1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
            w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, t.astype(np.float16) if quant == "f16" and t.ndim == 2 else t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama3_factors(rope: dict, head_dim: int):
    """convert_hf_to_gguf.py's Llama 3 rope_freqs: 1 for short wavelengths, factor for long, smooth between."""
    import math

    base, factor = rope["rope_theta"], rope["factor"]
    low, high, old = rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def add_vocabulary(w, folder: Path, gguf, pre: str = "gpt-2") -> None:
    """tokenizer.ggml.*: a byte-level BPE as model gpt2 (merges, pre-tokenizer `pre`), a SentencePiece-style one as
    model llama (scores, byte tokens), special tokens as control tokens, BOS/EOS and the chat template."""
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    settings = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    vocab = {**spec["model"]["vocab"], **{t["content"]: t["id"] for t in spec["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in spec["added_tokens"] if t["special"]}
    T = gguf.TokenType
    if spec["model"].get("byte_fallback"):
        w.add_tokenizer_model("llama")
        w.add_token_scores([0.0 if t in special else -float(vocab[t]) for t in tokens])
        w.add_add_space_prefix(True)
        types = [T.CONTROL if t in special else T.BYTE if t.startswith("<0x") else T.NORMAL for t in tokens]
        types[vocab["<unk>"]] = T.UNKNOWN
        w.add_unk_token_id(vocab["<unk>"])
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        merges = spec["model"]["merges"]
        w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
        types = [T.CONTROL if t in special else T.NORMAL for t in tokens]
    w.add_token_list(tokens)
    w.add_token_types(types)
    if settings.get("bos_token"):
        w.add_bos_token_id(vocab[settings["bos_token"]])
    w.add_eos_token_id(vocab[settings["eos_token"]])
    w.add_add_bos_token(bool(settings.get("bos_token")))
    template = settings.get("chat_template") or (folder / "chat_template.jinja").read_text(encoding="utf-8")
    w.add_chat_template(template)


def rounded(ref, fn) -> None:
    """Each matrix of transformers' model replaced by fn(it) in the orientation the converter writes it: (out, in),
    GPT-2's Conv1D matrices transposed."""
    conv1d = transformers.pytorch_utils.Conv1D
    with torch.no_grad():
        for module in ref.modules():
            for p in module.parameters(recurse=False):
                if p.dim() == 2:
                    t = p.t() if isinstance(module, conv1d) else p
                    given = torch.from_numpy(fn(t.float().numpy().copy()))
                    t.copy_(given)


CONVERTER_CASES = [(name, "f32") for name in GGUF_ARCHS] + [("gpt2", "f16"), ("pythia", "f16"), ("gemma3", "f16")]


@pytest.mark.parametrize("name,dtype", CONVERTER_CASES)
def test_a_llama_cpp_gguf_loads_with_the_models_logits_and_its_tokenizer(name, dtype, tmp_path):
    """F32 files compute the model's very logits; F16 ones those of the model with its matrices in float16 (norms
    and biases stay float32, as the converter keeps them)."""
    from nanogpt_cli.interop.loading import tokenizer_of

    ref = gguf_source(name, tmp_path / "hf")
    path = tmp_path / "model.gguf"
    write_converter_gguf(ref, tmp_path / "hf", GGUF_ARCHS[name], path, dtype)
    if dtype == "f16":
        rounded(ref, lambda t: t.astype(np.float16).astype(np.float32))
    ours, meta = load_model(path)
    assert meta["hf_family"] == ref.config.model_type
    idx = torch.randint(0, V, (2, 20))
    with torch.no_grad():
        diff = (ours.eval()(idx)[0] - ref(idx).logits).abs().max().item()
    assert diff <= 1e-5, f"{name}: {diff}"
    # the file itself: AutoTokenizer would pick the family's own tokenizer class, which may rewrite its settings
    theirs = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "hf" / "tokenizer.json"),
        **json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text(encoding="utf-8")),
    )
    tok = tokenizer_of(meta, path)
    for text in ("Hello world, the king and queen.", "café naïve 🙂 12345", "  runs   of spaces\n\nnew"):
        assert tok.encode(text) == theirs.encode(text, add_special_tokens=False), f"{name}: {text!r}"
    assert meta["chat_template"] and tok.eot_id == theirs.convert_tokens_to_ids(theirs.eos_token)


QUANT_CASES = [("qwen2.5", q) for q in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")] + [
    ("gpt2", "q8_0"),
    ("pythia", "q4_0"),
    ("smollm2", "bf16"),  # the converter's --outtype bf16: exactly bfloat16's rounding
]


@pytest.mark.parametrize("name,quant", QUANT_CASES)  # gguf's Python quantizers have no K-quants: see below
def test_a_quantized_llama_cpp_gguf_loads_as_the_gguf_package_dequantizes_it(name, quant, tmp_path):
    """Quantized matrices come in as gguf's own dequantization: the logits of transformers' model given those
    same dequantized weights."""
    from typer.testing import CliRunner

    from nanogpt_cli.cli import app

    gguf = pytest.importorskip("gguf")
    ref = gguf_source(name, tmp_path / "hf")
    path = tmp_path / f"model-{quant}.gguf"
    qtype = getattr(gguf.GGMLQuantizationType, quant.upper())
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    write_converter_gguf(ref, tmp_path / "hf", GGUF_ARCHS[name], path, quant)

    def as_gguf_dequantizes(t):
        return gguf.quants.dequantize(gguf.quants.quantize(t, qtype), qtype) if t.shape[1] % block == 0 else t

    rounded(ref, as_gguf_dequantizes)
    ours, _ = load_model(path)
    idx = torch.randint(0, V, (2, 20))
    with torch.no_grad():
        assert (ours.eval()(idx)[0] - ref(idx).logits).abs().max().item() <= 1e-5
    result = CliRunner().invoke(app, ["info", str(path)])
    assert result.exit_code == 0, result.output
    assert "llama.cpp's layout" in result.output and quant.upper() in result.output
    result = CliRunner().invoke(
        app, ["sample", "--checkpoint", str(path), "--prompt", "Hello", "--temperature", "0", "--max-new-tokens", "5"]
    )
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("name", ["smollm2", "gemma3", "gpt2", "pythia"])
def test_a_llama_cpp_gguf_loads_tensor_by_tensor_in_bf16_as_when_cast_after(name, tmp_path):
    """Each tensor read through the family's layout straight into bfloat16 (interop/materialize.py) is the float32
    model's cast after: llama's q/k rows, Gemma's 1 + w gains (taken off in float32), fused GPT-2/NeoX tensors."""
    from nanogpt_cli.interop.loading import load_for_inference

    ref = gguf_source(name, tmp_path / "hf")
    path = tmp_path / "model.gguf"
    write_converter_gguf(ref, tmp_path / "hf", GGUF_ARCHS[name], path, "f16")
    whole, _ = load_model(path)
    loaded = load_for_inference(path, device="cpu", dtype="bfloat16")
    got, want = loaded.model.state_dict(), whole.cast(torch.bfloat16).state_dict()
    assert got.keys() == want.keys()
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in got)


def test_a_llama_cpp_gguf_with_a_tensor_its_architecture_has_no_place_for_is_refused(tmp_path):
    """Qwen2's q/k/v biases in a file that says qwen3 (whose llama.cpp loader has none): one sentence, not a model
    that silently drops them."""
    ref = random_model("qwen2.5", tmp_path / "hf")
    write_converter_gguf(ref, tmp_path / "hf", "qwen3", tmp_path / "model.gguf")
    with pytest.raises(NanoGPTError, match=r"holds blk\.0\.attn_k\.bias, which nanogpt's qwen3 has no place for"):
        load_model(tmp_path / "model.gguf")


@pytest.mark.parametrize("name,tensor", [("smollm2", "token_embd.weight"), ("gpt2", "blk.0.ffn_up.weight")])
def test_a_llama_cpp_gguf_without_a_tensor_its_config_is_read_from_is_refused(name, tensor, tmp_path):
    """A truncated or odd file: one sentence naming the file and the tensor, not a KeyError."""
    ref = gguf_source(name, tmp_path / "hf")
    path = tmp_path / "model.gguf"
    write_converter_gguf(ref, tmp_path / "hf", GGUF_ARCHS[name], path, without=(tensor,))
    with pytest.raises(NanoGPTError, match=rf"^{re.escape(str(path))}: the file has no tensor {re.escape(tensor)}, "):
        load_model(path)


# the byte offsets of the fp16 scales in one block of each type gguf.quants dequantizes but cannot quantize
SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
SCALES |= {"IQ4_NL": (0,), "IQ4_XS": (0,), "TQ2_0": (64,)}
BLOCK_SCALES = SCALES | {"Q8_0": (0,)}  # and Q8_0's, which gguf also quantizes


def random_blocks(kind: str, expected: dict):
    """raw for write_converter_gguf: random blocks of a type (small finite scales) for each matrix whose rows are
    whole blocks, with gguf's dequantization of them put in expected[name]."""
    gguf = pytest.importorskip("gguf")
    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)

    def raw(name: str, shape):
        if shape[1] % block:
            return None
        blocks = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
        for at in BLOCK_SCALES[kind]:
            blocks[..., at : at + 2] = (
                rng.uniform(1e-4, 1e-3, blocks.shape[:2] + (1,)).astype(np.float16).view(np.uint8)
            )
        data = blocks.reshape(shape[0], -1)
        expected[name] = gguf.quants.dequantize(data, qtype)
        return data, qtype

    return raw


def loads_as_gguf_dequantizes(kind: str, tmp_path: Path):
    """A qwen2 converter file of random `kind` blocks, loaded: the model, once its weights are checked to be gguf's
    dequantization of those bytes."""
    from nanogpt_cli.interop import gguf_file

    ref = random_model("qwen2.5", tmp_path / "hf", hidden_size=256, intermediate_size=512, num_hidden_layers=1)
    expected = {}
    path = tmp_path / f"model-{kind}.gguf"
    write_converter_gguf(ref, tmp_path / "hf", "qwen2", path, raw=random_blocks(kind, expected))
    ours, _ = load_model(path)
    written = gguf_file.gguf_tensors(ours, FAMILY_RECORDS["qwen2"].gguf)  # ours under llama.cpp's names again
    assert expected.keys() >= {"token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight"}
    for name, values in expected.items():
        assert np.array_equal(written[name], values), f"{kind}: {name}"
    return ours, path


@pytest.mark.parametrize("kind", list(SCALES))
def test_k_quant_blocks_load_as_the_gguf_package_dequantizes_them(kind, tmp_path):
    """Random blocks of a type (small finite scales) in a converter's file: our float weights are gguf's
    dequantization of those bytes, the model computes finite logits, and `info` names the type and the size."""
    from typer.testing import CliRunner

    from nanogpt_cli.cli import app

    ours, path = loads_as_gguf_dequantizes(kind, tmp_path)
    with torch.no_grad():
        assert torch.isfinite(ours.eval()(torch.randint(0, V, (1, 8)))[0]).all()
    result = CliRunner().invoke(app, ["info", str(path)])
    assert result.exit_code == 0 and kind in result.output, result.output
    assert f"{path.stat().st_size:,}" in result.output, result.output


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K"])
def test_blocks_dequantized_a_few_rows_at_a_time_load_as_when_whole(kind, tmp_path, monkeypatch):
    """CONVERT_BYTES made small: each matrix is dequantized in slices of 3 rows (1 for the 512-wide ffn_down),
    the last one short, and the weights are still gguf's dequantization of the whole matrix."""
    from nanogpt_cli.runs import checkpoint

    monkeypatch.setattr(checkpoint, "CONVERT_BYTES", 4 * 256 * 3)
    loads_as_gguf_dequantizes(kind, tmp_path)


def test_train_init_from_a_llama_cpp_gguf(tmp_path):
    """--init-from a converter-written GGUF on data prepared with its tokenizer (through its Hugging Face export:
    the same tokenizer.json, byte for byte); the LoRA fine-tune's base is the file."""
    from typer.testing import CliRunner

    from nanogpt_cli.cli import app

    ref = random_model("smollm2", tmp_path / "hf")
    path = tmp_path / "model.gguf"
    write_converter_gguf(ref, tmp_path / "hf", "llama", path)
    runner = CliRunner()
    r = runner.invoke(app, ["export", str(path), "--format", "hf", "--out", str(tmp_path / "back")])
    assert r.exit_code == 0, r.output
    text = tmp_path / "text.txt"
    text.write_text("Hello world, the king and queen. " * 200, encoding="utf-8")
    data = tmp_path / "data"
    args = ["prepare", str(text), "--name", "t", "--tokenizer", str(tmp_path / "back"), "--data-dir", str(data)]
    assert (r := runner.invoke(app, args)).exit_code == 0, r.output
    args = ["train", "--data", "t", "--data-dir", str(data), "--init-from", str(path), "--out", str(tmp_path / "run")]
    args += ["--max-iters", "1", "--batch-size", "2", "--eval-iters", "1", "--device", "cpu"]
    assert (r := runner.invoke(app, args)).exit_code == 0, r.output


@pytest.mark.parametrize("name", [n for n in GGUF_ARCHS if n != "llama2"])
def test_gguf_export_writes_llama_cpps_architecture_and_converter_layout(name, tmp_path):
    """Our GGUF export of an imported model is in the architecture llama.cpp's converter writes for its family, with
    the tensors it writes, bit for bit, and every ARCH.* key it writes, with the same value; llama.cpp's layout reads
    it back (gguf_in, not our own config) into the model's logits."""
    gguf = pytest.importorskip("gguf")
    from nanogpt_cli.interop.gguf_header import read_header
    from nanogpt_cli.interop.gguf_in import read_llama_cpp_gguf

    ref = gguf_source(name, tmp_path / "hf")
    export(tmp_path / "hf", "gguf", tmp_path / "ours.gguf")
    arch = GGUF_ARCHS[name]
    reader = gguf.GGUFReader(str(tmp_path / "ours.gguf"))
    assert reader.fields["general.architecture"].contents() == arch
    ours = {t.name: t.data.reshape([int(n) for n in reversed(t.shape)]) for t in reader.tensors}
    theirs = converter_tensors(ref, arch)
    assert set(theirs) <= set(ours)  # ours also writes a tied head as output.weight
    for key, tensor in theirs.items():
        assert (ours[key] == tensor).all(), f"{name}: {key}"
    write_converter_gguf(ref, tmp_path / "hf", arch, tmp_path / "converter.gguf")
    converter = gguf.GGUFReader(str(tmp_path / "converter.gguf")).fields
    keys = {k for k in converter if k.startswith(f"{arch}.")}
    defaults = {f"{arch}.attention.key_length", f"{arch}.attention.value_length"}  # n_embd / n_head: ours omits them
    assert keys - set(reader.fields) <= defaults, f"{name}: {keys - set(reader.fields)}"
    for key in keys & set(reader.fields):
        assert reader.fields[key].contents() == converter[key].contents(), f"{name}: {key}"
    idx = torch.randint(0, V, (2, 20))
    header = read_header(tmp_path / "ours.gguf")
    for back in (load_model(tmp_path / "ours.gguf")[0], read_llama_cpp_gguf(header, tmp_path / "ours.gguf")[0]):
        with torch.no_grad():
            assert (back.eval()(idx)[0] - ref(idx).logits).abs().max().item() <= 1e-5, name


@pytest.mark.parametrize(
    "name,change,message",
    [
        (
            "mistral",
            {},
            r"llama.cpp's llama does not compute --sliding-window 6 under --block-size \d+: it needs a "
            "--sliding-window of at least --block-size",
        ),
        ("gemma3", dict(layer_types=["sliding_attention"] * 6), "every sixth layer global"),
        ("pythia", dict(hidden_act="gelu"), "llama.cpp computes GELU with the tanh approximation"),
    ],
)
def test_gguf_export_refuses_what_llama_cpps_architecture_cannot_compute(name, change, message, tmp_path):
    random_model(name, tmp_path / "hf", **change)
    with pytest.raises(NanoGPTError, match=message) as e:
        export(tmp_path / "hf", "gguf", tmp_path / "out.gguf")
    assert "\n" not in str(e.value) and not (tmp_path / "out.gguf").exists()


def test_a_run_started_from_a_family_exports_back_to_it(tmp_path):
    """train --init-from a Qwen2.5 folder, resumed once: the run's export is Qwen2ForCausalLM again (a Llama with
    attention_bias would compute the same, but is not the model the user started from), and llama.cpp's qwen2."""
    from typer.testing import CliRunner

    from nanogpt_cli.cli import app

    random_model("qwen2.5", tmp_path / "hf")
    runner = CliRunner()
    text = tmp_path / "text.txt"
    text.write_text("Hello world, the king and queen. " * 200, encoding="utf-8")
    data, run = tmp_path / "data", tmp_path / "run"
    args = ["prepare", str(text), "--name", "t", "--tokenizer", str(tmp_path / "hf"), "--data-dir", str(data)]
    assert (r := runner.invoke(app, args)).exit_code == 0, r.output
    args = ["train", "--data", "t", "--data-dir", str(data), "--out", str(run), "--batch-size", "2"]
    args += ["--eval-iters", "1", "--device", "cpu"]
    r = runner.invoke(app, [*args, "--init-from", str(tmp_path / "hf"), "--max-iters", "1"])
    assert r.exit_code == 0, r.output
    assert (r := runner.invoke(app, [*args, "--resume", "--max-iters", "2"])).exit_code == 0, r.output
    args = ["export", str(run), "--last", "--format", "hf", "--out", str(tmp_path / "e")]  # the resumed step's
    assert (r := runner.invoke(app, args)).exit_code == 0, r.output
    assert type(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "e")).__name__ == "Qwen2ForCausalLM"
    args = ["export", str(run), "--format", "gguf", "--out", str(tmp_path / "e.gguf")]  # and llama.cpp's qwen2
    assert (r := runner.invoke(app, args)).exit_code == 0, r.output
    gguf = pytest.importorskip("gguf")
    assert gguf.GGUFReader(str(tmp_path / "e.gguf")).fields["general.architecture"].contents() == "qwen2"


# --- LoRA on imported models, exported for peft ----------------------------------------------------------------

CHATS = [
    [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "5"}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Reverse abc."},
        {"role": "assistant", "content": "cba"},
    ],
]

CHATML_MARKED = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.mark.parametrize("name", ["llama3.2", "qwen2.5"])  # a Llama with grouped-query attention; q/k/v biases
def test_a_lora_run_on_an_imported_model_loads_onto_the_original_with_peft(name, tmp_path):
    """finetune --init-from the folder --lora on its own chat template, then export --format peft --base the
    folder: peft's adapter on transformers' original model gives our fine-tuned model's logits."""
    peft = pytest.importorskip("peft")
    from nanogpt_cli.data.chat import prepare_chat
    from nanogpt_cli.interop.loading import load_lora
    from nanogpt_cli.interop.source import parse_source
    from nanogpt_cli.lora import LoRAConfig
    from nanogpt_cli.training.finetune import plan_finetune
    from nanogpt_cli.training.request import RunRequest
    from nanogpt_cli.training.trainer import Trainer

    folder = tmp_path / "hf"
    random_model(name, folder)
    src = tmp_path / "chats.jsonl"
    src.write_text("\n".join(json.dumps({"messages": CHATS[i % 2]}) for i in range(40)) + "\n", encoding="utf-8")
    template = tmp_path / "chatml.jinja"  # the folder's ChatML with the assistant's words marked for the loss
    template.write_text(CHATML_MARKED, encoding="utf-8")
    prepared = prepare_chat(
        str(src), "chats", data_dir=str(tmp_path / "data"), tokenizer=str(folder), chat_template=str(template)
    )
    assert prepared.trained_tokens > 0
    values = dict(data="chats", data_dir=str(tmp_path / "data"), dtype="float32", device="cpu", max_iters=4)
    values.update(eval_interval=4, eval_iters=1, batch_size=4, warmup_iters=0, learning_rate=3e-2)
    lora = LoRAConfig(r=4, alpha=8, dropout=0.1, targets=("all",))
    job = plan_finetune(RunRequest(values, out=tmp_path / "lora", init_from=str(folder)), lora=lora)
    Trainer(job.plan, trainable=job.trainable).fit()
    run = tmp_path / "lora"
    export(run, "peft", tmp_path / "adapter", base=folder)

    original = transformers.AutoModelForCausalLM.from_pretrained(folder)
    tuned = peft.PeftModel.from_pretrained(original, tmp_path / "adapter").eval()
    ours, _ = load_lora(parse_source(run / "model.safetensors"), merge=False)
    idx = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = tuned(idx).logits
        diff = (ours.eval()(idx)[0] - theirs).abs().max().item()
        assert diff <= 1e-5, f"{name}: {diff}"
        with tuned.disable_adapter():  # and the adapter matters: the original alone differs
            moved = (theirs - tuned(idx).logits).abs().max().item()
        assert moved > 1e-3, f"{name}: the adapter moved the logits by {moved}"


def test_a_converted_models_long_context_trains_at_seq_len_1024_unless_given_and_exports_whole(tmp_path):
    """finetune --init-from a SmolLM2-shaped folder whose context is 2,048 tokens: without --seq-len it trains
    sequences of 1,024 and says so; a given --seq-len is kept, the whole context included (no note); a run trained at
    16 keeps the model's context, and its exports write max_position_embeddings (GGUF: context_length) 2,048."""
    from nanogpt_cli.data.chat import prepare_chat
    from nanogpt_cli.lora import LoRAConfig
    from nanogpt_cli.training.finetune import plan_finetune
    from nanogpt_cli.training.request import RunRequest
    from nanogpt_cli.training.trainer import Trainer

    folder = tmp_path / "hf"
    random_model("smollm2", folder, max_position_embeddings=2048)
    src, template = tmp_path / "chats.jsonl", tmp_path / "chatml.jinja"
    src.write_text("\n".join(json.dumps({"messages": CHATS[i % 2]}) for i in range(40)) + "\n", encoding="utf-8")
    template.write_text(CHATML_MARKED, encoding="utf-8")
    prepare_chat(str(src), "chats", data_dir=str(tmp_path / "data"), tokenizer=str(folder), chat_template=str(template))
    values = dict(data="chats", data_dir=str(tmp_path / "data"), dtype="float32", device="cpu", max_iters=2)
    values.update(eval_interval=2, eval_iters=1, batch_size=2, warmup_iters=0)
    run, lora = tmp_path / "run", LoRAConfig(r=2)
    default = plan_finetune(RunRequest(values, out=run, init_from=str(folder)), lora=lora).plan
    assert default.seq_len == 1024 and default.model.block_size == 2048
    assert [n for n in default.notes if n.startswith("--seq-len")] == [
        "--seq-len 1024: training sequences of 1,024 tokens, the default for a converted model; it keeps its context "
        "of 2,048 (give --seq-len 2048 to train at all of it)"
    ]
    whole = plan_finetune(RunRequest({**values, "seq_len": 2048}, out=run, init_from=str(folder)), lora=lora).plan
    assert whole.seq_len == 2048 and not [n for n in whole.notes if "--seq-len" in n]
    short = plan_finetune(RunRequest({**values, "seq_len": 16}, out=run, init_from=str(folder)), lora=lora)
    trainer = Trainer(short.plan, trainable=short.trainable)
    trainer.fit()
    assert trainer.parts.batches.get_batch("train")[0].shape == (2, 16)
    assert load_model(run)[0].config.block_size == 2048
    export(run, "hf", tmp_path / "e", merge=True)
    assert json.loads((tmp_path / "e" / "config.json").read_text())["max_position_embeddings"] == 2048
    gguf = pytest.importorskip("gguf")
    export(run, "gguf", tmp_path / "e.gguf", merge=True)
    assert gguf.GGUFReader(str(tmp_path / "e.gguf")).fields["llama.context_length"].contents() == 2048


# --- chat, serve and eval straight on a family folder and on a llama.cpp GGUF ------------------------------------


def run_cli(*args: str, stdin: str | None = None) -> str:
    """The command's output; its exit code must be 0."""
    from typer.testing import CliRunner

    from nanogpt_cli.cli import app

    result = CliRunner().invoke(app, list(args), input=stdin)
    assert result.exit_code == 0, result.output
    return result.output


def served_completion(source: Path, prompt: str, n: int) -> str:
    """One greedy completion from `nanogpt serve SOURCE` on 127.0.0.1 (port 0), through the openai client."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from test_serve import Live

    from nanogpt_cli.config import LoadSpec
    from nanogpt_cli.serve import ServeOptions

    live = Live(ServeOptions(LoadSpec(str(source), device="cpu", dtype="float32"), port=0))
    try:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        name = client.models.list().data[0].id
        return client.completions.create(model=name, prompt=prompt, max_tokens=n, temperature=0).choices[0].text
    finally:
        live.stop()


def test_chat_serve_and_eval_run_on_a_qwen2_folder_and_a_llama_cpp_gguf(tmp_path):
    """sample, chat (one turn through stdin), serve (one completion) and eval perplexity take the folder and the
    converter's .gguf of the same weights: greedy text equal to sample's, the same perplexity from both (on a text
    file: a dataset prepared with the folder's tokenizer.json is refused for the .gguf, whose tokenizer is rebuilt
    from tokenizer.ggml.*)."""
    from nanogpt_cli.inference.chat import ChatSession
    from nanogpt_cli.inference.sample import SampleSettings

    ref = random_model("qwen2.5", tmp_path / "hf")
    write_converter_gguf(ref, tmp_path / "hf", "qwen2", tmp_path / "model.gguf")
    text = tmp_path / "text.txt"
    text.write_text("Hello world, the king and queen. café 🙂\n" * 100, encoding="utf-8")
    cpu = ("--device", "cpu", "--dtype", "float32")
    perplexities, replies = [], []
    for source in (str(tmp_path / "hf"), str(tmp_path / "model.gguf")):
        sampled = run_cli(
            "sample", "--checkpoint", source, "--prompt", "Hello", "--temperature", "0", *cpu, "--max-new-tokens", "8"
        )
        assert sampled.startswith("Hello") and served_completion(Path(source), "Hello", 8) == sampled[5:-1]
        out = run_cli("chat", source, "--temperature", "0", "--max-new-tokens", "6", *cpu, stdin="hi there\n/exit\n")
        session = ChatSession.load(source, SampleSettings(temperature=0.0), max_new_tokens=6, device="cpu")
        replies.append("".join(session.ask("hi there")))
        assert out == replies[-1] + "\n", out
        args = ["eval", "perplexity", "--checkpoint", source, "--input", str(text), "--json", *cpu]  # one tokenizer
        perplexities.append(json.loads(run_cli(*args))["perplexity"])
    assert replies[0] == replies[1]
    assert perplexities[0] == pytest.approx(perplexities[1], rel=1e-5) and perplexities[0] > 1.0


def copied_into_a_random_model(ref):
    """What conversion built before it filled a meta model: GPT(config), every converted tensor copied into it."""
    from nanogpt_cli.interop import hf
    from nanogpt_cli.model import GPT

    kind = ref.config.model_type
    theirs = {k: v.float() for k, v in ref.state_dict().items()}
    config = hf.from_hf(ref).config  # the config conversion is not what is compared here
    model = GPT(config)
    ours = model.state_dict()
    with torch.no_grad():
        for name, source in hf._mapping(config, kind).items():
            if name not in ours:
                continue
            sources = source if isinstance(source, tuple) else (source,)
            if not all(s in theirs for s in sources):
                ours[name].zero_()
                continue
            ours[name].copy_(hf._to_ours(kind, name, torch.cat([theirs[s] for s in sources], dim=0), config))
    return model


@pytest.mark.parametrize("consume", [False, True])
def test_a_converted_model_equals_one_copied_into_a_random_model(family, consume):
    from nanogpt_cli.interop import hf

    name, folder, ref = family
    expected = copied_into_a_random_model(ref).state_dict()
    source = transformers.AutoModelForCausalLM.from_pretrained(folder) if consume else ref
    model = hf.from_hf(source, consume=consume)
    got = model.state_dict()
    assert not [k for k, t in got.items() if t.is_meta], name
    assert got.keys() == expected.keys()
    for k in expected:
        assert got[k].dtype == expected[k].dtype and torch.equal(got[k], expected[k]), f"{name}: {k}"
        assert got[k].is_contiguous(), f"{name}: {k}"
    assert (model.lm_head.weight is model.transformer.wte.weight) == model.config.tie_embeddings
    old_buffers = dict(copied_into_a_random_model(ref).named_buffers())
    assert dict(model.named_buffers()).keys() == old_buffers.keys()
    for k, t in model.named_buffers():  # the position tables, made as GPT(config) makes them
        assert torch.equal(t, old_buffers[k]), f"{name}: {k}"
