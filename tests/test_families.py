"""Every Hugging Face family (interop/families/): a tiny random model built with transformers' own config class, set
the way the real configs are (grouped-query attention, biases, RoPE scaling, tied or untied, windows), saved beside
a tokenizer trained here; loaded from its folder, our logits equal transformers'; exported back, the folder loads
as the same family with bit-equal weights and equal config fields; an unsupported value is one sentence.

A new family: its file in interop/families/ and one entry in FAMILIES below."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from test_hf_tokenizer import byte_level, sentencepiece  # noqa: E402

from nanogpt_cli.errors import NanoGPTError  # noqa: E402
from nanogpt_cli.interop.export import export  # noqa: E402
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
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=6,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
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


def random_model(name: str, folder: Path):
    """The family's transformers model with every weight random (norm gains and biases too, so a misplaced one
    shows), saved to `folder` with its tokenizer."""
    cls, kwargs, tokenizer = FAMILIES[name]
    tokenizer(folder)
    torch.manual_seed(0)
    dropouts = dict.fromkeys(set(DROPOUTS) & getattr(transformers, cls)().to_dict().keys(), 0.0)
    config = getattr(transformers, cls)(**kwargs, **special_ids(folder), **dropouts)
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
