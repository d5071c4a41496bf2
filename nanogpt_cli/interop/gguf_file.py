"""GGUF files (llama.cpp, ollama, LM Studio): which llama.cpp architecture computes a model exactly, our weights
and tokenizer under llama.cpp's names (float32, float16 or quantized), and reading a file we wrote back into
our model.

    write_gguf(model, tokenizer_desc, Path("shk.gguf"), quant="q8_0");  model, meta = read_gguf("shk.gguf")

Architectures (`gguf_target`): the one llama.cpp's converter writes for the model's Hugging Face family (the
family it came from, or the one that computes its config: `hf.hf_kind`), laid out as the family's GGUF record says
(families/gguf_base.py): llama, qwen2, qwen3, gemma3, gpt2 and gptneox; our own default block (RoPE on the whole
head, LayerNorm, tanh GELU) goes out as starcoder2. llama.cpp computes GELU with the tanh approximation only, so a
model trained with the exact GELU (--mlp gelu) is refused rather than run slightly differently. Files llama.cpp's
converter wrote are read by gguf_in.py, which hands ours to this module.

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
from nanogpt_cli.interop.families import FAMILIES, GGUF_FAMILIES
from nanogpt_cli.interop.families.gguf_base import (
    GGUFLayout,
)
from nanogpt_cli.model import GPT, rope_inv_freq

QUANTS = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")  # --quant: what gguf's writer can produce
CONFIG_KEY, TOKENIZER_KEY = "nanogpt.config", "nanogpt.tokenizer"
TOKENIZER_JSON_KEY = "nanogpt.tokenizer_json"  # a Hugging Face tokenizer's file, as text: the GGUF is one file
# our trained BPE's split patterns -> the llama.cpp pre-tokenizer that splits with the same regex
PRE_TOKENIZERS = {"gpt2": "gpt-2", "gpt4": "llama-bpe", "gpt4o": "gpt-4o"}


def gguf_target(c: GPTConfig, family: str | None = None) -> tuple[str, GGUFLayout]:
    """The llama.cpp architecture that computes this config exactly, and how the model sits in it: the family's
    (`family`: the one the model came from, kept when it holds the config, as in `hf.hf_kind`); else one sentence
    naming the flags to change. Our own default block (RoPE on the whole head, LayerNorm, tanh GELU, one residual
    after the other) goes out as starcoder2; a GPT-NeoX or Pythia model as gptneox."""
    try:
        kind = hf.hf_kind(c, prefer=family)
    except NanoGPTError as e:
        raise NanoGPTError(f"GGUF export needs a model llama.cpp computes exactly: {e}") from None
    arch, layout = FAMILIES[kind].gguf_arch, FAMILIES[kind].gguf
    plain = FAMILIES[kind].gguf_plain
    if plain is not None and family != kind and plain[0](c):  # a model of ours that another architecture computes
        arch, layout = plain[1], plain[2]
    why = layout.features.refusal(c)
    if why is not None:
        raise NanoGPTError(why)
    return arch, layout


def gguf_arch(c: GPTConfig, family: str | None = None) -> str:
    """gguf_target's architecture name."""
    return gguf_target(c, family)[0]


def layout_of(arch: str, path) -> GGUFLayout:
    """How a file of llama.cpp's `arch` holds our model, or one sentence naming the architectures nanogpt reads."""
    for f in FAMILIES.values():
        if f.gguf_plain is not None and f.gguf_plain[1] == arch:
            return f.gguf_plain[2]
    if arch not in GGUF_FAMILIES:
        raise NanoGPTError(
            f"{path} holds a {arch!r} model; nanogpt reads llama.cpp's {', '.join(GGUF_FAMILIES)} GGUF files"
        )
    return FAMILIES[GGUF_FAMILIES[arch]].gguf


def gguf_vocabulary(
    desc: dict[str, Any], vocab_size: int, gguf, tokenizer=None, pre: str | None = None
) -> dict[str, Any]:
    """The tokenizer as llama.cpp reads it: tokens in id order, their types, merges, pre-tokenizer, end-of-text id.
    A padded vocabulary gets unused filler tokens, since llama.cpp wants one token per embedding row. A Hugging
    Face tokenizer (`tokenizer`, an HFTokenizer) is read from its file (`_hf_vocabulary`); `pre`: the llama.cpp
    pre-tokenizer a GGUF it came from named, kept when it cuts text as the file does (gguf_pre.llama_pre)."""
    if desc.get("kind") == "hf":
        return _pad(_hf_vocabulary(tokenizer, gguf, pre), vocab_size, gguf)
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


def _hf_vocabulary(tok, gguf, pre: str | None = None) -> dict[str, Any]:
    """A Hugging Face BPE as llama.cpp reads it: byte-level ("gpt2": tokens in GPT-2's byte alphabet, merges, the
    llama.cpp pre-tokenizer that cuts text as it does: gguf_pre) or SentencePiece-style with byte fallback
    ("llama": scores by id, <0xNN> byte tokens); added tokens are control (special) or user-defined tokens.
    Anything else is one sentence."""
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
    from nanogpt_cli.interop.gguf_pre import llama_pre

    return {**vocab, "model": "gpt2", "pre": llama_pre(spec, tok.name, pre)}


def _prepends_space(spec: dict[str, Any]) -> bool:
    """Whether the tokenizer puts ▁ before a text (Metaspace's prepend_scheme, or a Prepend normalizer)."""
    pre, norm = spec.get("pre_tokenizer") or {}, json.dumps(spec.get("normalizer") or {})
    if pre.get("type") == "Metaspace":
        return pre.get("prepend_scheme", "always") != "never"
    return '"Prepend"' in norm


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
    family: str | None = None,
    pre: str | None = None,
) -> None:
    """Write the model to `path` (checks first: a refusal writes nothing) in the architecture of its family
    (`family`: the one it came from; gguf_target); a chat template goes in as tokenizer.chat_template, without the
    generation tags llama.cpp does not know. A Hugging Face tokenizer (`tokenizer`) goes in as llama.cpp's vocabulary
    and as its tokenizer.json's text (TOKENIZER_JSON_KEY), and its end-of-turn ids as llama.cpp's end-of-text
    token. pre: the llama.cpp pre-tokenizer a GGUF the model came from named (gguf_vocabulary)."""
    gguf = hf.require("gguf")
    if quant not in QUANTS:
        raise NanoGPTError(f"--quant must be one of {', '.join(QUANTS)}, got {quant!r}")
    c = model.config
    arch, layout = gguf_target(c, family)
    vocab = gguf_vocabulary(desc, c.vocab_size, gguf, tokenizer, pre)
    tensors = gguf_tensors(model, layout)
    writer = _writer_class(gguf)(str(path), arch)
    writer.add_name("nanogpt")
    layout.keys_out(writer, c)
    file_type = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16"}.get(quant, f"MOSTLY_{quant.upper()}")
    writer.add_file_type(getattr(gguf.LlamaFileType, file_type))
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


def _parts(c: GPTConfig, ours: str, theirs: tuple[str, ...]) -> list[int] | int:
    """Where one of our fused tensors splits into its GGUF tensors along dim 0: q, k, v by their heads (grouped-query
    attention has fewer key/value heads), others in equal parts."""
    if len(theirs) == 3 and ours.startswith("attn.c_attn"):
        q, kv = c.n_head * c.head_size, c.kv_heads * c.head_size
        return [q, q + kv]
    return len(theirs)


def _groups(layout: GGUFLayout, c: GPTConfig):
    """(llama.cpp's prefix, ours, names) for the tensors outside the blocks, then for each block."""
    yield "", "", layout.top
    for i in range(c.n_layer):
        yield f"blk.{i}.", f"transformer.h.{i}.", layout.block


def gguf_tensors(model: GPT, layout: GGUFLayout) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32 numpy array, in `layout`'s names and order of rows. A bias the model lacks is
    written as zeros where llama.cpp's loader requires it."""
    c = model.config
    sd = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    if c.pos_encoding == "sinusoidal":  # llama.cpp's gpt2 reads the table as learned positions
        sd["transformer.wpe.weight"] = model.pos_table.detach().float().cpu().numpy()
    out: dict[str, np.ndarray] = {}
    if c.rope_scaling == "llama3":
        # llama.cpp divides each RoPE frequency by its factor here (as its converter writes Llama 3.1's)
        out["rope_freqs.weight"] = rope_freq_factors(c)
    # the head is written even when tied: readers that do not re-tie (transformers' GGUF loader) still find it
    for prefix, p, table in _groups(layout, c):
        for ours, theirs in table.items():
            parts = theirs if isinstance(theirs, tuple) else (theirs,)
            weight = sd.get(p + ours)
            if weight is None:
                if ours in layout.optional or not ours.endswith(".bias"):
                    continue  # a tensor llama.cpp can do without (gguf_target checked the others)
                weight = np.zeros(sd[p + ours.replace(".bias", ".weight")].shape[0], dtype=np.float32)
            for name, part in zip(parts, np.split(weight, _parts(c, ours, parts), axis=0)):
                out[prefix + name] = layout.to_theirs(prefix + name, part, c)
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def gguf_parts(layout: GGUFLayout, c: GPTConfig, names) -> dict[str, tuple[str, ...]]:
    """Our tensor -> the llama.cpp tensors it was cut into, in order along dim 0, for those of `names` (our state
    dict's) that `layout` places: the reverse of gguf_tensors' names. Each is then read on its own (gguf_joined)."""
    out: dict[str, tuple[str, ...]] = {}
    for prefix, p, table in _groups(layout, c):
        for name, theirs in table.items():
            if p + name in names:
                out[p + name] = tuple(prefix + t for t in (theirs if isinstance(theirs, tuple) else (theirs,)))
    return out


def check_blocks(header, n_layer: int, path) -> None:
    """The file's blocks (blk.N.* tensors) against the config's n_layer, before a model of that many is built."""
    from nanogpt_cli.interop.materialize import check_blocks as check

    check(str(path), n_layer, (t.name for t in header.tensors), r"blk\.(\d+)\.")


def check_gguf_shapes(path, model: GPT, parts: dict[str, tuple[str, ...]], found: dict[str, tuple], optional=()):
    """The file's tensors (llama.cpp's name -> shape, PyTorch's order) against the shapes our model's tensors
    (`parts`: gguf_parts') cut into, before any is read: one sentence naming a tensor missing, extra or of
    another shape. optional: llama.cpp's names that may be absent."""
    from nanogpt_cli.interop.materialize import check_tensors

    c, shapes = model.config, {k: tuple(v.shape) for k, v in model.state_dict().items()}
    expected = {}
    for name, theirs in parts.items():
        rows, rest = shapes[name][0], shapes[name][1:]
        if len(theirs) == 3 and ".attn.c_attn." in name:
            sizes = [n * c.head_size for n in (c.n_head, c.kv_heads, c.kv_heads)]
        else:
            sizes = [rows // len(theirs)] * len(theirs)
        expected |= {t: (size, *rest) for t, size in zip(theirs, sizes)}
    check_tensors(str(path), expected, found, optional)


def gguf_joined(layout: GGUFLayout, c: GPTConfig, theirs: tuple[str, ...], parts: list):
    """One tensor of ours from its llama.cpp `parts` (named `theirs`: gguf_parts), numpy arrays or torch tensors:
    the layout's transform on each, then concatenated along dim 0. On a matrix the transforms move whole rows only,
    so raw quantized rows pass as they are."""
    import torch

    moved = [layout.to_ours(name, part, c) for name, part in zip(theirs, parts)]
    if len(moved) == 1:
        return moved[0]
    return np.concatenate(moved, axis=0) if isinstance(moved[0], np.ndarray) else torch.cat(moved, dim=0)


def gguf_floats(path: str | Path, layout: GGUFLayout, c: GPTConfig, parts: list, dtype):
    """One tensor of ours in dtype from its GGUF tensors `parts` (gguf_parts' order), dequantized a slice of rows at
    a time. A matrix is read straight into dtype, as the layout's transforms only move its rows; a vector (norm
    gains, biases) is transformed in float32 (Gemma's gains are stored as 1 + w), then cast: the values loading
    the file into a float32 model and casting it after give."""
    import torch

    into = dtype if len(parts[0].shape) > 1 else torch.float32
    tensors = [dequantized(path, t, into) for t in parts]
    return gguf_joined(layout, c, tuple(t.name for t in parts), tensors).to(dtype)


# --- reading a file we wrote --------------------------------------------------------------------------------


def is_gguf(path: str | Path) -> bool:
    """A file that begins with GGUF's magic, whatever its name; or one named .gguf, whose reader then says what
    its first bytes are not (the format is named by its magic, not by the reader that failed last)."""
    path = Path(path)
    if not path.is_file():
        return False
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError:
        return path.suffix.lower() == ".gguf"
    return magic == b"GGUF" or path.suffix.lower() == ".gguf"


def read_gguf_meta(path: str | Path) -> dict[str, Any]:
    """Our config and tokenizer description from a GGUF file nanogpt wrote, plus its architecture and type (any
    GGUF file: gguf_in.read_any_gguf_meta)."""
    from nanogpt_cli.interop.gguf_header import read_header

    header = read_header(path)
    meta = _meta(header, path)
    if isinstance(meta["config"].get("n_layer"), int):  # a config of 100,000 blocks is not counted as a model's
        _check_block_count(header, meta, meta["config"]["n_layer"], path)
    return meta


def _check_block_count(header, meta: dict[str, Any], n_layer: int, path) -> None:
    """Our config's blocks against what llama.cpp reads (ARCH.block_count) and the blk.N tensors."""
    blocks = header.get(f"{meta['architecture']}.block_count")
    if blocks is not None and blocks != n_layer:  # what llama.cpp reads must be the model we read
        raise NanoGPTError(
            f"{path} is damaged: its {meta['architecture']}.block_count ({blocks!r}) disagrees with its "
            f"{CONFIG_KEY} ({n_layer} blocks)"
        )
    check_blocks(header, n_layer, path)


def _meta(header, path) -> dict[str, Any]:
    fields = header.fields
    if CONFIG_KEY not in fields or TOKENIZER_KEY not in fields:
        raise NanoGPTError(
            f"{path} is a GGUF file that nanogpt did not write (it has no {CONFIG_KEY}); nanogpt "
            "reads back its own GGUF exports only"
        )
    from nanogpt_cli.hf_tokenizer import TOKENIZER_TEXT

    extra = {TOKENIZER_TEXT: _text(fields, TOKENIZER_JSON_KEY, path)} if TOKENIZER_JSON_KEY in fields else {}
    arch = fields.get("general.architecture")
    if isinstance(fields.get("tokenizer.ggml.pre"), str):  # its export names the same llama.cpp pre-tokenizer again
        from nanogpt_cli.interop.gguf_pre import PRE_KEY

        extra[PRE_KEY] = fields["tokenizer.ggml.pre"]
    if arch in GGUF_FAMILIES:  # its export prefers that family again (a Qwen2 stays Qwen2, not Llama with biases)
        extra[hf.FAMILY_KEY] = GGUF_FAMILIES[arch]
    file_type = fields.get("general.file_type", 0)
    return {
        **extra,
        "config": _json_object(fields, CONFIG_KEY, path),
        "tokenizer": _json_object(fields, TOKENIZER_KEY, path),
        "architecture": arch,
        "file_type": file_type if isinstance(file_type, int) else 0,
        "source": str(path),
        "format": "gguf",
    }


def _text(fields: dict[str, Any], key: str, path) -> str:
    if not isinstance(fields[key], str):
        raise NanoGPTError(f"{path} holds a {key} that is not text, as nanogpt writes it")
    return fields[key]


def _json_object(fields: dict[str, Any], key: str, path) -> dict[str, Any]:
    """One of our keys' JSON object, or one sentence saying the file's is damaged."""
    try:
        value = json.loads(_text(fields, key, path))
    except ValueError as e:
        raise NanoGPTError(f"{path} holds a {key} that is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise NanoGPTError(f"{path} holds a {key} that is not a JSON object")
    return value


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
    from nanogpt_cli.interop.gguf_header import read_header
    from nanogpt_cli.interop.materialize import LazyModel, empty_model

    reader = read_header(path)
    meta = _meta(reader, path)
    try:
        config = GPTConfig.from_dict(meta["config"])
    except (TypeError, ValueError) as e:
        raise NanoGPTError(f"{path} holds an invalid model config: {e}") from None
    layout = layout_of(meta["architecture"], path)
    _check_block_count(reader, meta, config.n_layer, path)
    model = empty_model(config, str(path))
    direct = GGUF_FORMS.get(quantize) if quantize == "int8" or group_size == 32 else None
    tensors = {t.name: t for t in reader.tensors}
    names = set(model.state_dict()) - ({"lm_head.weight"} if config.tie_embeddings else set())
    parts = gguf_parts(layout, config, names)
    missing = sorted(n for n in names if n not in parts)
    if missing:
        raise NanoGPTError(f"{path} has no tensor for our {missing[0]}")
    # what export writes beside the model: rope_freqs (in the config), a tied head's copy for readers that do not
    # tie, and the zero biases llama.cpp's loader requires
    wanted = {t for theirs in parts.values() for t in theirs}
    found = {t.name: t.dims for t in reader.tensors if t.name in wanted or not t.name.endswith(".bias")}
    for name in ("rope_freqs.weight", "output.weight" if config.tie_embeddings else ""):
        found.pop(name, None)
    check_gguf_shapes(path, model, parts, found)
    sources = {}  # our tensor -> a function of the dtype that reads it
    packed = {}  # a projection -> its layer from the file's raw blocks, given its bias
    for name, theirs in parts.items():
        if direct and name.startswith("transformer.h.") and all(tensors[t].tensor_type.name == direct for t in theirs):
            blocks = partial(_raw_blocks, path, layout, config, [tensors[t] for t in theirs])
            packed[name.removesuffix(".weight")] = partial(_blocks_layer, blocks, direct)
        else:  # a matrix with a part that is blocks while another is not is dequantized whole
            sources[name] = partial(gguf_floats, path, layout, config, [tensors[t] for t in theirs])

    def read(name: str, dtype: torch.dtype) -> torch.Tensor:
        return sources[name](dtype)

    return LazyModel(model, read, meta, str(path), packed)


def dequantized(path: str | Path, t, dtype):
    """A GGUF tensor (gguf_header.GGUFTensor, (out, in)) as a torch tensor in dtype, dequantized to float32 a
    slice of rows at a time (the gguf package's dequantization holds several float copies of what it is given)."""
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
    """A tensor's data (gguf_header.GGUFTensor: its data_shape and data_dtype, as GGUFReader holds it) read from
    the file into memory of its own: reading it through a map of the whole file would keep every page read
    resident until the map is gone."""
    data = np.empty(t.data_shape, t.data_dtype)
    with open(path, "rb") as f:
        f.seek(t.data_offset)
        read = f.readinto(data.reshape(-1).view(np.uint8))
    if read != data.nbytes:
        raise NanoGPTError(f"{path} is truncated: {t.name} has {read:,} of {data.nbytes:,} bytes")
    return data


def _blocks_layer(blocks, block_type: str, bias):
    from nanogpt_cli.interop.gguf_blocks import linear_from_blocks

    return linear_from_blocks(blocks(), block_type, bias)


def _raw_blocks(path: str | Path, layout: GGUFLayout, c: GPTConfig, parts: list) -> np.ndarray:
    """One matrix of ours as the file's raw quantized rows (gguf_blocks), its parts put in place by the layout."""
    return gguf_joined(layout, c, tuple(t.name for t in parts), [read_tensor_data(path, t) for t in parts])
