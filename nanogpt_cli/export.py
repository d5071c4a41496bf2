"""Export a run for other tools: a Hugging Face folder (transformers, pipelines, lm-eval) or one GGUF file
(llama.cpp, ollama, LM Studio).

    export("checkpoints/shk", "hf", Path("exports/shk"))  # then AutoModelForCausalLM.from_pretrained("exports/shk")

A Hugging Face folder holds config.json, generation_config.json, model.safetensors, tokenizer.json and
tokenizer_config.json. Which stock architecture a run becomes is decided in `hf.hf_kind`; a config that no stock
architecture computes exactly is refused, never approximated. Everything is built in a temporary folder (or file)
beside the target and renamed into place, so a refusal or a crash leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanogpt_cli import hf
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.model import GPT

FORMATS = ("hf", "gguf")


@dataclass
class ExportResult:
    path: Path  # the folder (hf) or file (gguf) written
    format: str  # hf | gguf
    architecture: str  # the transformers class, or the GGUF architecture
    tokenizer: str  # gpt2 | char | byte


def export(source: str | Path, fmt: str, out: str | Path, last: bool = False, force: bool = False) -> ExportResult:
    """Export a run folder or .safetensors checkpoint (or a Hugging Face folder / hf:NAME) to `out`."""
    if fmt not in FORMATS:
        raise NanoGPTError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    model, desc = load_source(source, last)
    if fmt == "hf":
        return export_hf(model, desc, Path(out), force)
    return export_gguf(model, desc, Path(out), force)


def load_source(source: str | Path, last: bool = False) -> tuple[GPT, dict[str, Any]]:
    """Our model and tokenizer description from one of our checkpoints or a Hugging Face model."""
    from nanogpt_cli.loading import load_model

    model, meta = load_model(source, last=last)
    if "tokenizer" not in meta:
        raise NanoGPTError(f"{source} has no tokenizer in its metadata, so it cannot be exported with one")
    return model, meta["tokenizer"]


def _check_target(out: Path, force: bool) -> None:
    if out.exists() and not force:
        raise NanoGPTError(f"{out} already exists; pass --force to replace it")


def _replace(tmp: Path, out: Path) -> None:
    """Move the finished tmp into out; an existing out (--force) is set aside first and removed after."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    if old.is_dir():
        shutil.rmtree(old)
    else:
        old.unlink(missing_ok=True)


def _staging(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    return out.with_name(f".{out.name}.tmp-{os.getpid()}")


# --- Hugging Face ---------------------------------------------------------------------------------------


def export_hf(model: GPT, desc: dict[str, Any], out: Path, force: bool = False) -> ExportResult:
    """Write a folder that AutoModelForCausalLM, AutoTokenizer and pipeline("text-generation") load offline."""
    transformers = hf.require("transformers")
    kind = hf.hf_kind(model.config)  # refusals first: nothing is written before every check has passed
    tok, eot = hf.tokenizers_object(desc)
    if desc["vocab_size"] > model.config.vocab_size:
        raise NanoGPTError(f"the tokenizer has {desc['vocab_size']:,} tokens but the model only "
                           f"{model.config.vocab_size:,}")
    _check_target(out, force)
    eot_id = tok.token_to_id(eot) if eot is not None else None
    special = {"bos_token_id": eot_id, "eos_token_id": eot_id, "pad_token_id": None}
    hf_model = hf.to_hf(model, special)  # float32 on the CPU, whatever the model's dtype and device
    _, extra = hf.hf_config_for(model.config, kind, special)

    tmp = _staging(out)
    try:
        with hf.quiet_transformers():
            hf_model.save_pretrained(tmp)
        config_path = tmp / "config.json"
        config = json.loads(config_path.read_text(encoding="utf-8"))
        config.update(extra)
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        # a padded head (vocab_size above the tokenizer's) never picks a token the tokenizer lacks, as in ours
        padding = list(range(desc["vocab_size"], model.config.vocab_size))
        generation = transformers.GenerationConfig(**special, **({"suppress_tokens": padding} if padding else {}))
        generation.save_pretrained(tmp)
        tok.save(str(tmp / "tokenizer.json"))
        # written here, not by save_pretrained: transformers 5 names its own backend class, which 4.x cannot load
        tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model.config.block_size,
                            "clean_up_tokenization_spaces": False}
        if eot is not None:
            tokenizer_config.update(bos_token=eot, eos_token=eot, unk_token=eot)
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n", encoding="utf-8")
        _replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return ExportResult(out, "hf", hf.ARCHS[kind][3], desc["name"])


# --- GGUF -----------------------------------------------------------------------------------------------


def gguf_arch(model: GPT, desc: dict[str, Any]) -> str:
    """llama or gpt2, the GGUF architectures llama.cpp runs that compute this model exactly; else one sentence."""
    c = model.config
    try:
        kind = hf.hf_kind(c)
    except NanoGPTError as e:
        raise NanoGPTError(f"GGUF export needs a Llama- or GPT-2-shaped model: {e}") from None
    if kind == "gpt_neox":
        raise NanoGPTError("GGUF export covers Llama-shaped (--norm rmsnorm --mlp swiglu --no-bias) and GPT-2-shaped "
                           "(--pos-encoding learned --mlp gelu_tanh) models, not RoPE with LayerNorm and GELU")
    if kind == "gpt2" and c.mlp != "gelu_tanh":
        raise NanoGPTError("llama.cpp's GPT-2 computes the tanh GELU: GGUF export of a GPT-2-shaped model needs "
                           "--mlp gelu_tanh")
    if kind == "llama" and c.bias:
        raise NanoGPTError("GGUF export of a Llama-shaped model needs --no-bias")
    if desc["name"] != "gpt2":
        raise NanoGPTError(f"GGUF export supports the gpt2 tokenizer only, not {desc['name']}")
    return kind


def export_gguf(model: GPT, desc: dict[str, Any], out: Path, force: bool = False) -> ExportResult:
    """Write one GGUF file (float32 tensors) with the metadata llama.cpp needs to run it."""
    gguf = hf.require("gguf")
    arch = gguf_arch(model, desc)
    if out.suffix != ".gguf":
        raise NanoGPTError(f"--out for --format gguf is a file ending in .gguf, got {out}")
    _check_target(out, force)
    tmp = _staging(out)
    try:
        writer = gguf.GGUFWriter(str(tmp), arch)
        _gguf_metadata(writer, model, arch, gguf)
        _gguf_tokenizer(writer, model.config.vocab_size, gguf)
        for name, tensor in gguf_tensors(model, arch, gguf).items():
            writer.add_tensor(name, tensor)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        _replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return ExportResult(out, "gguf", arch, desc["name"])


def _gguf_metadata(writer, model: GPT, arch: str, gguf) -> None:
    c = model.config
    writer.add_name("nanogpt")
    writer.add_context_length(c.block_size)
    writer.add_embedding_length(c.n_embd)
    writer.add_block_count(c.n_layer)
    writer.add_feed_forward_length(c.hidden_size)
    writer.add_head_count(c.n_head)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch == "llama":
        writer.add_head_count_kv(c.n_head)
        writer.add_rope_freq_base(c.rope_theta)
        writer.add_rope_dimension_count(c.head_size)
        writer.add_layer_norm_rms_eps(c.norm_eps)
        writer.add_vocab_size(c.vocab_size)
    else:
        writer.add_layer_norm_eps(c.norm_eps)


def _gguf_tokenizer(writer, vocab_size: int, gguf) -> None:
    """GPT-2's BPE as llama.cpp reads it: tokens in id order, their types, the merges, the special ids. A padded
    vocabulary gets unused filler tokens, since llama.cpp wants one token per embedding row."""
    vocab, merges = hf._gpt2_files()
    tokens = sorted(vocab, key=vocab.get)
    eot = vocab["<|endoftext|>"]
    types = [gguf.TokenType.CONTROL if i == eot else gguf.TokenType.NORMAL for i in range(len(tokens))]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    types += [gguf.TokenType.UNUSED] * (vocab_size - len(types))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([" ".join(m) for m in merges])
    writer.add_bos_token_id(eot)
    writer.add_eos_token_id(eot)
    writer.add_add_bos_token(False)


def _llama_rope_order(w, n_head: int):
    """llama.cpp's Llama rotates interleaved pairs (x[2i], x[2i+1]); we and transformers rotate (x[i], x[i+hs/2]).
    Reorder each head's rows of q and k so the two compute the same (the permutation llama.cpp's converter does)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(model: GPT, arch: str, gguf) -> dict[str, Any]:
    """GGUF tensor name -> float32 numpy array, names from gguf's own table."""
    c = model.config
    sd = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    T, names = gguf.MODEL_TENSOR, gguf.TENSOR_NAMES

    def name(kind, i=None, suffix="weight"):
        return f"{names[kind].format(bid=i)}.{suffix}"

    def zeros(n):
        import numpy as np

        return np.zeros(n, dtype=np.float32)

    out = {name(T.TOKEN_EMBD): sd["transformer.wte.weight"]}
    if arch == "gpt2":
        pos = model.pos_table if c.pos_encoding == "sinusoidal" else model.transformer.wpe.weight
        out[name(T.POS_EMBD)] = pos.detach().float().cpu().numpy()
    for i in range(c.n_layer):
        p = f"transformer.h.{i}."
        if arch == "llama":
            q, k, v = sd[p + "attn.c_attn.weight"].reshape(3, c.n_embd, c.n_embd)
            gate, up = sd[p + "mlp.c_fc.weight"].reshape(2, c.hidden_size, c.n_embd)
            out.update({
                name(T.ATTN_NORM, i): sd[p + "ln_1.weight"],
                name(T.ATTN_Q, i): _llama_rope_order(q, c.n_head), name(T.ATTN_K, i): _llama_rope_order(k, c.n_head),
                name(T.ATTN_V, i): v, name(T.ATTN_OUT, i): sd[p + "attn.c_proj.weight"],
                name(T.FFN_NORM, i): sd[p + "ln_2.weight"],
                name(T.FFN_GATE, i): gate, name(T.FFN_UP, i): up, name(T.FFN_DOWN, i): sd[p + "mlp.c_proj.weight"],
            })
        else:  # GPT-2: every linear and norm has a bias in llama.cpp; a model without biases gets zeros
            def bias(key, n):
                return sd.get(p + key, zeros(n))

            C, H = c.n_embd, c.hidden_size
            out.update({
                name(T.ATTN_NORM, i): sd[p + "ln_1.weight"], name(T.ATTN_NORM, i, "bias"): bias("ln_1.bias", C),
                name(T.ATTN_QKV, i): sd[p + "attn.c_attn.weight"],
                name(T.ATTN_QKV, i, "bias"): bias("attn.c_attn.bias", 3 * C),
                name(T.ATTN_OUT, i): sd[p + "attn.c_proj.weight"],
                name(T.ATTN_OUT, i, "bias"): bias("attn.c_proj.bias", C),
                name(T.FFN_NORM, i): sd[p + "ln_2.weight"], name(T.FFN_NORM, i, "bias"): bias("ln_2.bias", C),
                name(T.FFN_UP, i): sd[p + "mlp.c_fc.weight"], name(T.FFN_UP, i, "bias"): bias("mlp.c_fc.bias", H),
                name(T.FFN_DOWN, i): sd[p + "mlp.c_proj.weight"],
                name(T.FFN_DOWN, i, "bias"): bias("mlp.c_proj.bias", C),
            })
    out[name(T.OUTPUT_NORM)] = sd["transformer.ln_f.weight"]
    if arch == "gpt2":
        out[name(T.OUTPUT_NORM, suffix="bias")] = sd.get("transformer.ln_f.bias", zeros(c.n_embd))
    # the head is written even when tied: readers that do not re-tie (transformers' GGUF loader) still find it
    out[name(T.OUTPUT)] = sd["lm_head.weight"]
    return {k: v.copy() if not v.flags["C_CONTIGUOUS"] else v for k, v in out.items()}
