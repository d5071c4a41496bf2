"""GGUF files (llama.cpp, ollama, LM Studio): which llama.cpp architecture computes a model exactly, our weights
and tokenizer under llama.cpp's names (float32, float16 or quantized), and reading a file we wrote back into
our model.

    write_gguf(model, tokenizer_desc, Path("shk.gguf"), quant="q8_0");  model, meta = read_gguf("shk.gguf")

Architectures (`gguf_arch`): llama (RoPE, RMSNorm, SwiGLU, no biases), qwen3 (the same with QK-norm), gpt2
(learned or sinusoidal positions, LayerNorm, tanh GELU) and starcoder2 (RoPE on the whole head, LayerNorm, tanh
GELU: our default config). llama.cpp computes GELU with the tanh approximation only, so a model trained with the
exact GELU (--mlp gelu) is refused rather than run slightly differently. Files llama.cpp's converter wrote are
read by gguf_in.py, which hands ours to this module.

Tokenizers: gpt2, byte, char (characters of one UTF-8 byte) and trained BPEs (gpt2, gpt4 and gpt4o patterns), all
as llama.cpp's byte-level BPE ("gpt2" model): tokens spelled in GPT-2's byte alphabet in id order, merges derived
from the ranks, and the pre-tokenizer llama.cpp knows for the pattern. Our config and tokenizer description ride
along as `nanogpt.config` / `nanogpt.tokenizer` (llama.cpp ignores keys it does not know), so `read_gguf` rebuilds
exactly what was exported.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from nanogpt_cli.config import GPTConfig
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.interop import hf
from nanogpt_cli.interop.families import FAMILIES
from nanogpt_cli.model import GPT, rope_inv_freq

QUANTS = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")  # --quant: what gguf's writer can produce
CONFIG_KEY, TOKENIZER_KEY = "nanogpt.config", "nanogpt.tokenizer"
TOKENIZER_JSON_KEY = "nanogpt.tokenizer_json"  # a Hugging Face tokenizer's file, as text: the GGUF is one file
# our trained BPE's split patterns -> the llama.cpp pre-tokenizer that splits with the same regex
PRE_TOKENIZERS = {"gpt2": "gpt-2", "gpt4": "llama-bpe", "gpt4o": "gpt-4o"}
RMS_ARCHS = ("llama", "qwen3")  # RMSNorm, SwiGLU, no biases but q/k/v's; only llama's q/k rows are reordered


def gguf_arch(c: GPTConfig) -> str:
    """llama, gpt2 or starcoder2: the llama.cpp architecture that computes this config exactly; else one sentence
    naming the flags to change."""
    try:
        kind = hf.hf_kind(c)
    except NanoGPTError as e:
        raise NanoGPTError(f"GGUF export needs a model llama.cpp computes exactly: {e}") from None
    if kind == "qwen3":  # llama.cpp's qwen3: Llama's tensors plus attn_q_norm / attn_k_norm, NeoX-order RoPE
        if c.bias or c.attn_bias:
            raise NanoGPTError("GGUF export of a Qwen3-shaped model needs --no-bias and no --qkv-bias")
        return "qwen3"
    if kind not in ("gpt2", "llama", "gpt_neox"):
        raise NanoGPTError(
            f"GGUF export writes llama, qwen3, gpt2 and starcoder2 models; a {hf.ARCHS[kind][3]}-shaped model "
            f"(llama.cpp's {FAMILIES[kind].gguf_arch}) does not convert"
        )
    if kind in ("gpt2", "gpt_neox") and c.mlp != "gelu_tanh":
        raise NanoGPTError(
            "llama.cpp computes GELU with the tanh approximation: GGUF export of a model with "
            "LayerNorm and GELU needs --mlp gelu_tanh (or --norm rmsnorm --mlp swiglu --no-bias)"
        )
    if kind == "gpt_neox" and (c.parallel_residual or c.rotary_dim is not None):
        raise NanoGPTError(
            "GGUF export writes a GPT-NeoX-shaped model as starcoder2, which has neither --parallel-residual nor "
            "--rotary-dim: train without them to export to GGUF"
        )
    if kind == "llama" and c.bias:  # llama.cpp's Llama has optional q, k, v biases (--qkv-bias), not the others
        raise NanoGPTError("GGUF export of a Llama-shaped model needs --no-bias (--qkv-bias may stay)")
    return "starcoder2" if kind == "gpt_neox" else kind


def gguf_vocabulary(desc: dict[str, Any], vocab_size: int, gguf, tokenizer=None) -> dict[str, Any]:
    """The tokenizer as llama.cpp reads it: tokens in id order, their types, merges, pre-tokenizer, end-of-text id.
    A padded vocabulary gets unused filler tokens, since llama.cpp wants one token per embedding row. A Hugging
    Face tokenizer (`tokenizer`, an HFTokenizer) is read from its file (`_hf_vocabulary`)."""
    if desc.get("kind") == "hf":
        return _pad(_hf_vocabulary(tokenizer, gguf), vocab_size, gguf)
    from nanogpt_cli.tokenizer import (
        BPETokenizer,
        byte_to_unicode,
        merges_from_ranks,
        spell_bytes,
        tokenizer_from_description,
    )

    name, pre, merges, eot = desc["name"], "gpt-2", [], None
    if desc.get("kind") == "bpe":
        tok = tokenizer_from_description(desc)
        assert isinstance(tok, BPETokenizer)
        pattern = {v: k for k, v in _patterns().items()}.get(tok.pattern)
        if pattern not in PRE_TOKENIZERS:
            raise NanoGPTError(
                f"llama.cpp has no pre-tokenizer for the split pattern of the {name} tokenizer "
                f"({tok.pattern_name or 'custom'}); train it with --pattern gpt2, gpt4 or gpt4o to "
                "export it to GGUF"
            )
        pre = PRE_TOKENIZERS[pattern]
        tokens = [spell_bytes(t) for t in tok.ranks] + sorted(tok.special_tokens, key=tok.special_tokens.get)
        merges = [f"{spell_bytes(a)} {spell_bytes(b)}" for a, b in merges_from_ranks(tok.ranks)]
        eot = tok.eot_id
        control = set(tok.special_tokens.values())
    elif name == "gpt2":
        vocab, gpt2_merges = hf._gpt2_files()
        tokens = sorted(vocab, key=vocab.get)
        merges = [" ".join(m) for m in gpt2_merges]
        eot = vocab["<|endoftext|>"]
        control = {eot}
    elif name == "byte":
        tokens, control = list(byte_to_unicode()), set()
    elif name == "char":
        wide = [ch for ch in desc["chars"] if len(ch.encode("utf-8")) > 1]
        if wide:
            shown = " ".join(repr(ch) for ch in wide[:8]) + (" ..." if len(wide) > 8 else "")
            raise NanoGPTError(
                f"the char vocabulary holds {len(wide)} character(s) of several UTF-8 bytes ({shown}), "
                "which llama.cpp's byte-level vocabulary can only build from tokens this model lacks; "
                "prepare with --tokenizer byte or a trained tokenizer to export to GGUF"
            )
        tokens, control = [spell_bytes(ch.encode("utf-8")) for ch in desc["chars"]], set()
    else:
        raise NanoGPTError(f"GGUF export supports the gpt2, char, byte and trained tokenizers, not {name}")
    types = [gguf.TokenType.CONTROL if i in control else gguf.TokenType.NORMAL for i in range(len(tokens))]
    vocab = {"tokens": tokens, "types": types, "merges": merges, "pre": pre, "eot": eot}
    return _pad({**vocab, "model": "gpt2", "bos": eot, "add_bos": False}, vocab_size, gguf)


def _pad(vocab: dict[str, Any], vocab_size: int, gguf) -> dict[str, Any]:
    n = len(vocab["tokens"])
    vocab["tokens"] = vocab["tokens"] + [f"[PAD{i}]" for i in range(n, vocab_size)]
    vocab["types"] = vocab["types"] + [gguf.TokenType.UNUSED] * (vocab_size - n)
    if vocab.get("scores") is not None:
        vocab["scores"] = vocab["scores"] + [-1e9] * (vocab_size - n)
    return vocab


# a byte-level BPE's split regex (its Split pre-tokenizer) -> the llama.cpp pre-tokenizer that splits the same way
HF_PRE_TOKENIZERS = {
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+""": "qwen2",
}


def _hf_vocabulary(tok, gguf) -> dict[str, Any]:
    """A Hugging Face BPE as llama.cpp reads it: byte-level ("gpt2": tokens in GPT-2's byte alphabet, merges, the
    pre-tokenizer of its split regex) or SentencePiece-style with byte fallback ("llama": scores by id, <0xNN>
    byte tokens); added tokens are control (special) or user-defined tokens. Anything else is one sentence."""
    spec = json.loads(tok.text)
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise NanoGPTError(
            f"GGUF export of a Hugging Face tokenizer needs a BPE model, and the {tok.name} tokenizer is "
            f"{model.get('type')}"
        )
    added = tok.added_tokens()
    tokens = [tok.token_text(i) or f"[PAD{i}]" for i in range(tok.vocab_size)]
    sentencepiece = bool(model.get("byte_fallback"))
    types = []
    for i, t in enumerate(tokens):
        if i in added:
            types.append(gguf.TokenType.CONTROL if added[i] else gguf.TokenType.USER_DEFINED)
        elif sentencepiece and len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            types.append(gguf.TokenType.BYTE)
        elif t == model.get("unk_token"):
            types.append(gguf.TokenType.UNKNOWN)
        else:
            types.append(gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    vocab = {"tokens": tokens, "types": types, "merges": merges, "eot": tok.eot_id, "bos": tok.bos_id}
    vocab["add_bos"] = tok.bos_id is not None
    if sentencepiece:  # llama.cpp's SentencePiece merges the pair whose token scores highest: the earliest id
        vocab.update(model="llama", pre="default", scores=[-float(i) for i in range(len(tokens))])
        vocab["space_prefix"] = _prepends_space(spec)
        vocab["unk"] = tok.token_id(model.get("unk_token"))
        return vocab
    return {**vocab, "model": "gpt2", "pre": _hf_pre_tokenizer(spec, tok.name)}


def _prepends_space(spec: dict[str, Any]) -> bool:
    """Whether the tokenizer puts ▁ before a text (Metaspace's prepend_scheme, or a Prepend normalizer)."""
    pre, norm = spec.get("pre_tokenizer") or {}, json.dumps(spec.get("normalizer") or {})
    if pre.get("type") == "Metaspace":
        return pre.get("prepend_scheme", "always") != "never"
    return '"Prepend"' in norm


def _hf_pre_tokenizer(spec: dict[str, Any], name: str) -> str:
    """The llama.cpp pre-tokenizer of a byte-level BPE: GPT-2's regex, or one of the split regexes it knows."""
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [p.get("type") for p in parts]
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Split", "ByteLevel"]:
        regex = (parts[0].get("pattern") or {}).get("Regex")
        known = {v: PRE_TOKENIZERS[k] for k, v in _patterns().items() if k in PRE_TOKENIZERS} | HF_PRE_TOKENIZERS
        if regex in known:
            return known[regex]
    raise NanoGPTError(
        f"llama.cpp has no pre-tokenizer nanogpt knows to match the {name} tokenizer's ({' + '.join(map(str, kinds))}),"
        " so a GGUF export would split text differently"
    )


def _patterns() -> dict[str, str]:
    from nanogpt_cli.tokenizer import PATTERNS

    return PATTERNS


def write_gguf(
    model: GPT,
    desc: dict[str, Any],
    path: Path,
    quant: str = "f32",
    chat_template: str | None = None,
    tokenizer=None,
) -> None:
    """Write the model to `path` (checks first: a refusal writes nothing); a chat template goes in as
    tokenizer.chat_template, without the generation tags llama.cpp does not know. A Hugging Face tokenizer
    (`tokenizer`) goes in as llama.cpp's vocabulary and as its tokenizer.json's text (TOKENIZER_JSON_KEY), and its
    end-of-turn ids as llama.cpp's end-of-text token."""
    gguf = hf.require("gguf")
    if quant not in QUANTS:
        raise NanoGPTError(f"--quant must be one of {', '.join(QUANTS)}, got {quant!r}")
    c = model.config
    arch = gguf_arch(c)
    vocab = gguf_vocabulary(desc, c.vocab_size, gguf, tokenizer)
    tensors = gguf_tensors(model, arch, gguf)
    writer = _writer_class(gguf)(str(path), arch)
    _metadata(writer, c, arch, quant, gguf)
    writer.add_tokenizer_model(vocab["model"])
    writer.add_tokenizer_pre(vocab["pre"])
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    if vocab.get("scores") is not None:
        writer.add_token_scores(vocab["scores"])
        writer.add_add_space_prefix(vocab["space_prefix"])
        if vocab.get("unk") is not None:
            writer.add_unk_token_id(vocab["unk"])
    # llama.cpp refuses a byte-level vocabulary without a merges key, even an empty one (char and byte)
    writer.add_key_value(
        gguf.Keys.Tokenizer.MERGES, vocab["merges"], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.STRING
    )
    if vocab["bos"] is not None:
        writer.add_bos_token_id(vocab["bos"])
    if vocab["eot"] is not None:
        writer.add_eos_token_id(vocab["eot"])
    turn = [i for i in (tokenizer.stop_ids if tokenizer is not None else ()) if i != vocab["eot"]]
    if turn:  # an instruct model's end of turn (<|im_end|>, <|eot_id|>): llama.cpp stops there too
        writer.add_eot_token_id(turn[0])
    writer.add_add_bos_token(vocab["add_bos"])
    if chat_template:
        from nanogpt_cli.data.chat import strip_generation_tags

        writer.add_chat_template(strip_generation_tags(chat_template))
    writer.add_string(CONFIG_KEY, c.to_json())
    writer.add_string(TOKENIZER_KEY, json.dumps(desc, ensure_ascii=False))
    if tokenizer is not None and desc.get("kind") == "hf":
        writer.add_string(TOKENIZER_JSON_KEY, tokenizer.text)
    for name, tensor in tensors.items():
        data, qtype = _quantize(tensor, quant, gguf)
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _writer_class(gguf):
    """gguf's writer, able to write an empty array: the format has them (a count of 0) and llama.cpp reads them,
    but the writer refuses one, having no first element to take the element type from."""

    class Writer(gguf.GGUFWriter):
        def _pack_val(self, val, vtype, add_vtype, sub_type=None):
            if vtype == gguf.GGUFValueType.ARRAY and sub_type is not None and len(val) == 0:
                head = self._pack("I", vtype) if add_vtype else b""
                return head + self._pack("I", sub_type) + self._pack("Q", 0)
            return super()._pack_val(val, vtype, add_vtype, sub_type)

    return Writer


def _metadata(writer, c: GPTConfig, arch: str, quant: str, gguf) -> None:
    writer.add_name("nanogpt")
    writer.add_context_length(c.block_size)
    writer.add_embedding_length(c.n_embd)
    writer.add_block_count(c.n_layer)
    writer.add_feed_forward_length(c.hidden_size)
    writer.add_head_count(c.n_head)
    file_type = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16"}.get(quant, f"MOSTLY_{quant.upper()}")
    writer.add_file_type(getattr(gguf.LlamaFileType, file_type))
    if arch in ("llama", "qwen3", "starcoder2"):
        writer.add_head_count_kv(c.kv_heads)
        writer.add_rope_freq_base(c.rope_theta)
        writer.add_rope_dimension_count(c.head_size)
        writer.add_vocab_size(c.vocab_size)
        if c.head_size * c.n_head != c.n_embd:  # llama.cpp takes n_embd / n_head unless told
            writer.add_key_length(c.head_size)
            writer.add_value_length(c.head_size)
    if c.rope_scaling in ("linear", "yarn"):  # llama3's scaling goes in the rope_freqs tensor (gguf_tensors)
        writer.add_rope_scaling_type(getattr(gguf.RopeScalingType, str(c.rope_scaling).upper()))
        writer.add_rope_scaling_factor(c.rope_factor)
    if c.rope_scaling == "yarn":  # llama.cpp applies YaRN's attention temperature itself
        writer.add_rope_scaling_orig_ctx_len(c.rope_context)
        writer.add_rope_scaling_yarn_beta_fast(c.rope_beta_fast)
        writer.add_rope_scaling_yarn_beta_slow(c.rope_beta_slow)
    if arch in RMS_ARCHS:
        writer.add_layer_norm_rms_eps(c.norm_eps)
    else:
        writer.add_layer_norm_eps(c.norm_eps)


def rope_freq_factors(c: GPTConfig) -> np.ndarray:
    """What llama.cpp divides each of RoPE's frequencies by: the plain frequency over the scaled one. (hs/2,)"""
    plain, scaled = rope_inv_freq(c.head_size, c.rope_theta), rope_inv_freq(c.head_size, c.rope_theta, c)
    return (plain / scaled).numpy().astype(np.float32)


def _quantize(tensor: np.ndarray, quant: str, gguf):
    """(data, raw type or None) for one tensor. Vectors (norms, biases) stay float32, as llama.cpp keeps them; a
    matrix whose rows are not a whole number of quantization blocks falls back to float16, as llama.cpp's
    converter does."""
    if quant == "f32" or tensor.ndim == 1:
        return tensor, None
    qtype = getattr(gguf.GGMLQuantizationType, quant.upper())
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    if quant == "f16" or tensor.shape[-1] % block != 0:
        return tensor.astype(np.float16), None
    return gguf.quants.quantize(tensor, qtype), qtype


def _llama_rope_order(w, n_head: int, inverse: bool = False):
    """llama.cpp's Llama rotates interleaved pairs (x[2i], x[2i+1]); we and transformers rotate (x[i], x[i+hs/2]).
    Reorder each head's rows of q and k so the two compute the same (the permutation llama.cpp's converter does);
    `inverse` undoes it."""
    rows = w.shape[0]
    split = (n_head, rows // n_head // 2, 2) if inverse else (n_head, 2, rows // n_head // 2)
    return w.reshape(*split, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _block_names(arch: str, c: GPTConfig) -> dict[str, tuple[str, ...]]:
    """Our block tensor -> the GGUF tensors it is cut into, in order along dim 0 (one name: the same tensor)."""
    names = {
        "ln_1.weight": ("attn_norm",),
        "attn.c_proj.weight": ("attn_output",),
        "ln_2.weight": ("ffn_norm",),
        "mlp.c_proj.weight": ("ffn_down",),
    }
    if arch == "gpt2":
        names.update({"attn.c_attn.weight": ("attn_qkv",), "mlp.c_fc.weight": ("ffn_up",)})
    else:
        names.update(
            {
                "attn.c_attn.weight": ("attn_q", "attn_k", "attn_v"),
                "mlp.c_fc.weight": ("ffn_gate", "ffn_up") if arch in RMS_ARCHS else ("ffn_up",),
            }
        )
    if arch == "qwen3":
        names.update({"attn.q_norm.weight": ("attn_q_norm",), "attn.k_norm.weight": ("attn_k_norm",)})
    if arch not in RMS_ARCHS:  # every linear and norm of llama.cpp's gpt2 and starcoder2 has a bias
        names.update({k.replace(".weight", ".bias"): v for k, v in list(names.items())})
    elif c.attn_bias:
        names["attn.c_attn.bias"] = ("attn_q", "attn_k", "attn_v")
    return names


def _parts(c: GPTConfig, ours: str, theirs: tuple[str, ...]) -> list[int] | int:
    """Where one of our fused tensors splits into its GGUF tensors along dim 0: q, k, v by their heads (grouped-query
    attention has fewer key/value heads), others in equal parts."""
    if len(theirs) == 3 and ours.startswith("attn.c_attn"):
        q, kv = c.n_head * c.head_size, c.kv_heads * c.head_size
        return [q, q + kv]
    return len(theirs)


def _rope_heads(c: GPTConfig, name: str) -> int:
    """Heads of a GGUF q or k tensor, which llama.cpp's pair order permutes head by head."""
    return c.n_head if name == "attn_q" else c.kv_heads


def gguf_tensors(model: GPT, arch: str, gguf=None) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32 numpy array. A model without biases gets zero biases where llama.cpp wants them."""
    c = model.config
    sd = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    if arch == "gpt2":
        sd["transformer.wpe.weight"] = (
            (model.pos_table if c.pos_encoding == "sinusoidal" else model.transformer.wpe.weight)
            .detach()
            .float()
            .cpu()
            .numpy()
        )
    out = {"token_embd.weight": sd["transformer.wte.weight"]}
    if arch == "gpt2":
        out["position_embd.weight"] = sd["transformer.wpe.weight"]
    if c.rope_scaling == "llama3":
        # llama.cpp divides each RoPE frequency by its factor here (as its converter writes Llama 3.1's)
        out["rope_freqs.weight"] = rope_freq_factors(c)
    for i in range(c.n_layer):
        p = f"transformer.h.{i}."
        for ours, theirs in _block_names(arch, c).items():
            weight = sd.get(p + ours)
            if weight is None:  # a bias the model does not have
                weight = np.zeros(sd[p + ours.replace(".bias", ".weight")].shape[0], dtype=np.float32)
            for name, part in zip(theirs, np.split(weight, _parts(c, ours, theirs), axis=0)):
                if arch == "llama" and name in ("attn_q", "attn_k"):
                    part = _llama_rope_order(part, _rope_heads(c, name))
                out[f"blk.{i}.{name}.{ours.rsplit('.', 1)[1]}"] = part
    out["output_norm.weight"] = sd["transformer.ln_f.weight"]
    if arch not in RMS_ARCHS:
        out["output_norm.bias"] = sd.get("transformer.ln_f.bias", np.zeros(c.n_embd, dtype=np.float32))
    # the head is written even when tied: readers that do not re-tie (transformers' GGUF loader) still find it
    out["output.weight"] = sd["lm_head.weight"]
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


# --- reading a file we wrote --------------------------------------------------------------------------------


def is_gguf(path: str | Path) -> bool:
    path = Path(path)
    if path.suffix.lower() != ".gguf" or not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def read_gguf_meta(path: str | Path) -> dict[str, Any]:
    """Our config and tokenizer description from a GGUF file nanogpt wrote, plus its architecture and type (any
    GGUF file: gguf_in.read_any_gguf_meta)."""
    gguf = hf.require("gguf")
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise NanoGPTError(f"{path} is not a readable GGUF file ({e})") from None
    return _meta(reader, path)


def _meta(reader, path) -> dict[str, Any]:
    fields = reader.fields
    if CONFIG_KEY not in fields or TOKENIZER_KEY not in fields:
        raise NanoGPTError(
            f"{path} is a GGUF file that nanogpt did not write (it has no {CONFIG_KEY}); nanogpt "
            "reads back its own GGUF exports only"
        )
    file_type = fields["general.file_type"].contents() if "general.file_type" in fields else 0
    from nanogpt_cli.hf_tokenizer import TOKENIZER_TEXT

    extra = {TOKENIZER_TEXT: fields[TOKENIZER_JSON_KEY].contents()} if TOKENIZER_JSON_KEY in fields else {}
    return {
        **extra,
        "config": json.loads(fields[CONFIG_KEY].contents()),
        "tokenizer": json.loads(fields[TOKENIZER_KEY].contents()),
        "architecture": fields["general.architecture"].contents(),
        "file_type": int(file_type),
        "source": str(path),
        "format": "gguf",
    }


def read_gguf(path: str | Path, quantize: str | None = None, group_size: int = 32) -> tuple[GPT, dict[str, Any]]:
    """Our model (float32) and metadata from a GGUF file `write_gguf` wrote; quantized tensors are dequantized,
    except the blocks' matrices in the form `quantize` asks for (gguf_blocks.GGUF_FORMS), which load as they are
    (any GGUF file: gguf_in.read_any_gguf)."""
    import torch

    from nanogpt_cli.interop.materialize import materialize

    lazy = lazy_gguf(path, quantize, group_size)
    return materialize(lazy, torch.float32).eval(), lazy.meta


def lazy_gguf(path: str | Path, quantize: str | None = None, group_size: int = 32):
    """read_gguf's model on the meta device and how to read each of its tensors from the file, one at a time
    (materialize.py): the blocks' matrices held in the form `quantize` asks for become QuantizedLinear layers."""
    import torch

    from nanogpt_cli.interop.gguf_blocks import GGUF_FORMS
    from nanogpt_cli.interop.materialize import LazyModel, empty_model

    gguf = hf.require("gguf")
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise NanoGPTError(f"{path} is not a readable GGUF file ({e})") from None
    meta = _meta(reader, path)
    try:
        config = GPTConfig.from_dict(meta["config"])
    except (TypeError, ValueError) as e:
        raise NanoGPTError(f"{path} holds an invalid model config: {e}") from None
    arch, model = gguf_arch(config), empty_model(config)
    direct = GGUF_FORMS.get(quantize) if quantize == "int8" or group_size == 32 else None
    tensors = {t.name: t for t in reader.tensors}

    def raw(name: str) -> np.ndarray:  # the file's bytes or values, never dequantized
        if name not in tensors:
            raise NanoGPTError(f"{path} does not match its config: it has no tensor {name}")
        return read_tensor_data(path, tensors[name])

    def floats(name: str, dtype: torch.dtype) -> torch.Tensor:
        raw(name)  # a missing tensor is one sentence
        return dequantized(path, tensors[name], dtype)

    def joined(keys: list[str], theirs: tuple[str, ...], read_one, *dtype) -> np.ndarray | torch.Tensor:
        return _joined([read_one(k, *dtype) for k in keys], theirs, arch, config)

    top = {"transformer.wte.weight": "token_embd.weight", "transformer.ln_f.weight": "output_norm.weight"}
    top |= {"lm_head.weight": "output.weight", "transformer.wpe.weight": "position_embd.weight"}
    top |= {"transformer.ln_f.bias": "output_norm.bias"}
    names = set(model.state_dict())
    sources = {ours: partial(floats, theirs) for ours, theirs in top.items() if ours in names}
    packed = {}  # a projection -> its layer from the file's raw blocks, given its bias
    for i in range(config.n_layer):
        for name, theirs in _block_names(arch, config).items():
            if f"transformer.h.{i}.{name}" not in names:
                continue  # zero biases llama.cpp wanted
            suffix = name.rsplit(".", 1)[1]
            keys = [f"blk.{i}.{t}.{suffix}" for t in theirs]
            if (
                direct
                and suffix == "weight"
                and all(k in tensors and tensors[k].tensor_type.name == direct for k in keys)
            ):
                blocks = partial(joined, keys, theirs, raw)
                packed[f"transformer.h.{i}.{name.removesuffix('.weight')}"] = partial(_blocks_layer, blocks, direct)
            else:  # a part that is blocks while another is not is dequantized with the rest
                sources[f"transformer.h.{i}.{name}"] = partial(joined, keys, theirs, floats)

    def read(name: str, dtype: torch.dtype) -> torch.Tensor:
        if name not in sources:
            raise NanoGPTError(f"{path} has no tensor for our {name}")
        return sources[name](dtype)

    return LazyModel(model, read, meta, str(path), packed)


def dequantized(path: str | Path, t, dtype):
    """A GGUFReader tensor (out, in) as a torch tensor in dtype, dequantized to float32 a slice of rows at a time
    (the gguf package's dequantization holds several float copies of what it is given)."""
    import torch

    from nanogpt_cli.runs.checkpoint import CONVERT_BYTES

    gguf = hf.require("gguf")
    shape = [int(n) for n in reversed(t.shape)]
    data = read_tensor_data(path, t)
    out = torch.empty(shape, dtype=dtype)
    rows, data = out.view(-1, shape[-1]), data.reshape(-1, data.shape[-1])  # (rows, in), (rows, bytes or in)
    step = max(1, CONVERT_BYTES // (4 * rows.size(1)))
    for r in range(0, rows.size(0), step):
        part = gguf.quants.dequantize(data[r : r + step], t.tensor_type).astype(np.float32)
        rows[r : r + step] = torch.from_numpy(part.reshape(-1, rows.size(1)))
    return out


def read_tensor_data(path: str | Path, t) -> np.ndarray:
    """A GGUFReader tensor's data (t.data's shape and dtype) read from the file into memory of its own: reading
    it through the reader's map of the whole file would keep every page read resident until the map is gone."""
    data = np.empty(t.data.shape, t.data.dtype)
    with open(path, "rb") as f:
        f.seek(t.data_offset)
        read = f.readinto(data.reshape(-1).view(np.uint8))
    if read != data.nbytes:
        raise NanoGPTError(f"{path} is truncated: {t.name} has {read:,} of {data.nbytes:,} bytes")
    return data


def _blocks_layer(blocks, block_type: str, bias):
    from nanogpt_cli.interop.gguf_blocks import linear_from_blocks

    return linear_from_blocks(blocks(), block_type, bias)


def _joined(parts: list, theirs: tuple[str, ...], arch: str, config: GPTConfig) -> np.ndarray:
    """One tensor of ours from the GGUF tensors it was cut into (float tensors or raw blocks, row by row)."""
    import torch

    if arch == "llama" and len(parts) == 3:  # a permutation of rows: the same on raw blocks
        parts[:2] = [_llama_rope_order(p, _rope_heads(config, t), inverse=True) for p, t in zip(parts[:2], theirs)]
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts, axis=0)
    return torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
