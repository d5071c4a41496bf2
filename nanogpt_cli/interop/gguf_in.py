"""Reading a GGUF file that llama.cpp's converter wrote (not one of ours): the config from `ARCH.*` metadata, the
weights from `blk.N.*` tensors (dequantized through the gguf package; llama-arch q/k rows put back in the order
transformers and we rotate), and the tokenizer rebuilt as a tokenizer.json from `tokenizer.ggml.*`.

    model, meta = read_any_gguf("model.gguf")   # ours (gguf_file.read_gguf) or llama.cpp's converter's

Architectures (each family's GGUF layout, families/): llama (Llama, SmolLM2, TinyLlama, Mistral), qwen2, qwen3,
gemma3, gpt2 and gptneox (Pythia). Tokenizers: byte-level BPE
(tokenizer.ggml.model gpt2, with merges and a pre-tokenizer llama.cpp names) and SentencePiece-style BPE with byte
fallback (llama, with scores; the merges are derived from the scores as transformers' converter does).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from nanogpt_cli.config import GPTConfig
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.interop.families import FAMILIES, GGUF_FAMILIES
from nanogpt_cli.interop.gguf_pre import PRE_KEY, pre_tokenizer
from nanogpt_cli.model import GPT


def _reader(path: str | Path):
    from nanogpt_cli.interop.gguf_header import read_header

    return read_header(path)


def read_any_gguf(path: str | Path, quantize: str | None = None, group_size: int = 32) -> tuple[GPT, dict[str, Any]]:
    """Our model and metadata from a GGUF file nanogpt wrote (gguf_file.py) or llama.cpp's converter wrote.
    quantize, group_size: the form our own files' Q8_0 / Q4_0 blocks load into as they are (read_gguf); a
    converter's file loads in float32, and load_for_inference quantizes it after."""
    from nanogpt_cli.interop import gguf_file

    reader = _reader(path)
    if gguf_file.CONFIG_KEY in reader.fields:
        return gguf_file.read_gguf(path, quantize, group_size)
    return read_llama_cpp_gguf(reader, path)


def lazy_any_gguf(path: str | Path, quantize: str | None = None, group_size: int = 32):
    """read_any_gguf's model as a LazyModel (materialize.py), read tensor by tensor: ours (gguf_file.lazy_gguf) or
    a converter's, whose tensors are all dequantized (quantize then applies to each block once it is read)."""
    from nanogpt_cli.interop import gguf_file

    reader = _reader(path)
    if gguf_file.CONFIG_KEY in reader.fields:
        return gguf_file.lazy_gguf(path, quantize, group_size)
    return lazy_llama_cpp_gguf(reader, path)


def read_any_gguf_meta(path: str | Path) -> dict[str, Any]:
    """read_any_gguf's metadata without the weights (for `info`)."""
    from nanogpt_cli.interop import gguf_file

    reader = _reader(path)
    if gguf_file.CONFIG_KEY in reader.fields:
        return gguf_file.read_gguf_meta(path)
    return read_llama_cpp_meta(reader, path)


def field(reader, key: str, default: Any = None) -> Any:
    return reader.get(key, default)


def read_llama_cpp_gguf(reader, path: str | Path) -> tuple[GPT, dict[str, Any]]:
    """Our model (float32) and metadata from a GGUF file in llama.cpp's converter layout."""
    import torch

    from nanogpt_cli.interop.materialize import materialize

    lazy = lazy_llama_cpp_gguf(reader, path)
    return materialize(lazy, torch.float32).eval(), lazy.meta


def lazy_llama_cpp_gguf(reader, path: str | Path):
    """read_llama_cpp_gguf's model on the meta device and how to read each of its tensors (materialize.py),
    through the family's GGUF layout; a tensor the layout has no place for is refused."""
    import torch

    from nanogpt_cli.interop.gguf_file import check_blocks, check_gguf_shapes, gguf_floats, gguf_parts
    from nanogpt_cli.interop.materialize import LazyModel, empty_model

    arch = _arch(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    config = _config(reader, arch, {k: tuple(int(n) for n in reversed(t.shape)) for k, t in tensors.items()}, path)
    layout = FAMILIES[GGUF_FAMILIES[arch]].gguf
    check_blocks(reader, config.n_layer, path)
    model = empty_model(config, str(path))
    shapes = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    names = set(shapes) - ({"lm_head.weight"} if config.tie_embeddings else set())
    parts = gguf_parts(layout, config, names)
    used = {"rope_freqs.weight"} | {t for theirs in parts.values() for t in theirs}  # rope_freqs: in the config
    unread = sorted(set(tensors) - used)
    if unread:
        raise NanoGPTError(f"{path} holds {unread[0]}, which nanogpt's {arch} has no place for")
    found = {k: t.dims for k, t in tensors.items() if k != "rope_freqs.weight"}
    biases = [t for n, theirs in parts.items() if n.endswith(".bias") for t in theirs]  # absent biases are zero
    check_gguf_shapes(path, model, parts, found, biases)
    sources = {}  # our tensor -> a function of the dtype that reads it
    for name in names:
        theirs = parts.get(name, ())
        if theirs and all(t in tensors for t in theirs):
            sources[name] = partial(gguf_floats, path, layout, config, [tensors[t] for t in theirs])
        elif name.endswith(".bias"):
            sources[name] = partial(_zeros, shapes[name])  # absent biases are zero
        else:
            raise NanoGPTError(f"{path} has no tensor for our {name}")

    def read(name: str, dtype: torch.dtype) -> torch.Tensor:
        return sources[name](dtype)

    return LazyModel(model, read, _meta(reader, arch, config, path), str(path))


def _zeros(shape: tuple[int, ...], dtype):
    import torch

    return torch.zeros(shape, dtype=dtype)


def read_llama_cpp_meta(reader, path: str | Path) -> dict[str, Any]:
    """read_llama_cpp_gguf's metadata without reading the weights (for `info`): config, tokenizer, architecture,
    file type, and the tensor types with how many of each ("tensor_types")."""
    from nanogpt_cli.interop.gguf_file import check_blocks

    arch = _arch(reader, path)
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    config = _config(reader, arch, shapes, path)
    check_blocks(reader, config.n_layer, path)  # a config of 100,000 blocks is not counted as a model's
    meta = _meta(reader, arch, config, path, tokenizer=False)
    counts: dict[str, int] = {}
    for t in reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return {**meta, "tensor_types": counts}


def _arch(reader, path) -> str:
    arch = field(reader, "general.architecture")
    if arch not in GGUF_FAMILIES:
        raise NanoGPTError(
            f"{path} holds a {arch!r} model; nanogpt reads llama.cpp's {', '.join(GGUF_FAMILIES)} GGUF files and "
            "its own"
        )
    return arch


def _meta(reader, arch: str, config: GPTConfig, path, tokenizer: bool = True) -> dict[str, Any]:
    """The metadata load_model gives; tokenizer False: the tokenizer only named and counted, not built (`info`)."""
    from nanogpt_cli.hf_tokenizer import TOKENIZER_TEXT

    if not tokenizer:
        tokens = field(reader, "tokenizer.ggml.tokens")
        described = {"name": Path(path).stem, "kind": "hf"}
        return {
            "config": config.to_dict(),
            "tokenizer": described | ({"vocab_size": len(tokens)} if isinstance(tokens, list) else {}),
            "architecture": arch,
            "file_type": field(reader, "general.file_type", 0),
            "source": str(path),
            "format": "gguf",
            "writer": "llama.cpp",
            "hf_family": GGUF_FAMILIES[arch],
        }
    tok = gguf_tokenizer(reader, path)
    meta: dict[str, Any] = {
        "config": config.to_dict(),
        "tokenizer": tok.describe(),
        TOKENIZER_TEXT: tok.text,
        "architecture": arch,
        "file_type": int(field(reader, "general.file_type", 0)),
        "source": str(path),
        "format": "gguf",
        "writer": "llama.cpp",
        "hf_family": GGUF_FAMILIES[arch],
    }
    if field(reader, "tokenizer.ggml.model") == "gpt2":  # an export names the same llama.cpp pre-tokenizer again
        meta[PRE_KEY] = field(reader, "tokenizer.ggml.pre", "default")
    if tok.chat_template:
        meta["chat_template"] = tok.chat_template
    return meta


# the ARCH.* keys that are counts and widths: each a positive whole number
SIZES = ("block_count", "head_count", "head_count_kv", "embedding_length", "context_length", "feed_forward_length")
SIZES += ("key_length", "value_length", "rope.dimension_count")


def _config(reader, arch: str, tensors: dict[str, tuple[int, ...]], path) -> GPTConfig:
    """Our config from the `ARCH.*` keys and the tensors' shapes (the family's GGUF layout reads them); a value
    without a counterpart is one sentence."""
    from nanogpt_cli.interop.families.base import default_width
    from nanogpt_cli.interop.families.gguf_base import Keys

    keys = Keys(arch, {k: field(reader, k) for k in reader.fields if k.startswith(f"{arch}.")})
    for key, value in keys.values.items():
        if isinstance(value, list):
            continue  # a value per layer: config_in says whether it has a counterpart
        if key.endswith(SIZES) and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise NanoGPTError(f"{path}: {key} = {value!r}, where llama.cpp needs a positive whole number")
    try:
        fields = FAMILIES[GGUF_FAMILIES[arch]].gguf.config_in(keys, tensors)
        if fields.get("pos_encoding") == "rope":
            fields.update(
                _rope_scaling(reader, arch, tensors, fields.get("head_dim") or fields["n_embd"] // fields["n_head"])
            )
        return default_width(GPTConfig(**fields))
    except NanoGPTError as e:
        raise NanoGPTError(f"{path}: {e}") from None
    except (ValueError, TypeError, ArithmeticError) as e:  # a value of the wrong type, a head count of 0
        raise NanoGPTError(f"{path}: its {arch}.* metadata does not describe a model nanogpt can build ({e})") from None


def _rope_scaling(reader, arch: str, tensors: dict[str, tuple[int, ...]], head_dim: int) -> dict[str, Any]:
    """Our rope_* fields: linear and YaRN from `rope.scaling.*`, Llama 3's from the rope_freqs tensor (its factors
    must be what the standard Llama 3 settings give, which is what the converter writes)."""
    kind = field(reader, f"{arch}.rope.scaling.type", "none")
    out: dict[str, Any] = {}
    if kind in ("linear", "yarn"):
        out = {"rope_scaling": kind, "rope_factor": float(field(reader, f"{arch}.rope.scaling.factor"))}
        if kind == "yarn":
            out["rope_original_context"] = int(field(reader, f"{arch}.rope.scaling.original_context_length"))
    elif kind != "none":
        raise NanoGPTError(f"{arch}.rope.scaling.type = {kind!r} has no counterpart here")
    if "rope_freqs.weight" in tensors:
        out = _llama3_scaling(_rope_freqs(reader), reader, arch, head_dim)
    return out


def _rope_freqs(reader) -> np.ndarray:
    import gguf

    from nanogpt_cli.interop.gguf_file import read_tensor_data

    t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    return gguf.quants.dequantize(read_tensor_data(reader.path, t), t.tensor_type).astype(np.float32).reshape(-1)


def _llama3_scaling(factors: np.ndarray, reader, arch: str, head_dim: int) -> dict[str, Any]:
    from nanogpt_cli.model import rope_inv_freq

    theta = float(field(reader, f"{arch}.rope.freq_base", 10000.0))
    context = int(field(reader, f"{arch}.context_length"))
    factor = float(factors.max())
    for original in [8192] + [2**k for k in range(1, 21)]:  # Llama 3.1-3.2 have 8192; small tests have less
        c = dict(rope_scaling="llama3", rope_factor=factor, rope_original_context=original)
        config = GPTConfig(block_size=context, n_head=1, n_embd=head_dim, pos_encoding="rope", rope_theta=theta, **c)
        scaled = rope_inv_freq(head_dim, theta, config)
        if np.allclose((rope_inv_freq(head_dim, theta) / scaled).numpy(), factors, rtol=1e-5, atol=0):
            return c
    raise NanoGPTError("rope_freqs.weight holds factors that no Llama 3 RoPE scaling nanogpt knows gives")


def gguf_tokenizer(reader, path):
    """An HFTokenizer rebuilt from `tokenizer.ggml.*`: its tokenizer.json text, BOS/EOS, end of turn and template."""
    from nanogpt_cli.hf_tokenizer import HFTokenizer

    model = field(reader, "tokenizer.ggml.model")
    tokens = field(reader, "tokenizer.ggml.tokens")
    if tokens is None:
        raise NanoGPTError(f"{path} has no tokenizer.ggml.tokens, so nanogpt cannot encode text for it")
    types = field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    scores = field(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
    for key, values, kind in (("tokens", tokens, str), ("token_type", types, int), ("scores", scores, (int, float))):
        if not isinstance(values, list) or len(values) != len(tokens) or not all(isinstance(v, kind) for v in values):
            raise NanoGPTError(f"{path}: tokenizer.ggml.{key} is not one {kind_name(kind)} per token")
    ids = {key: field(reader, f"tokenizer.ggml.{key}_token_id") for key in ("bos", "eos", "unknown", "padding", "eot")}
    for key, i in ids.items():
        if i is not None and (not isinstance(i, int) or isinstance(i, bool)):
            raise NanoGPTError(f"{path}: tokenizer.ggml.{key}_token_id = {i!r} is not a token id")
    # an id past the vocabulary is no token, as llama.cpp takes it (it warns and uses its default)
    ids = {key: i if i is not None and 0 <= i < len(tokens) else None for key, i in ids.items()}
    if model == "gpt2":
        text = _byte_level_json(tokens, types, field(reader, "tokenizer.ggml.merges") or [], reader, path)
    elif model == "llama":
        text = _sentencepiece_json(tokens, types, scores, bool(field(reader, "tokenizer.ggml.add_space_prefix", True)))
    else:
        raise NanoGPTError(f"{path}: tokenizer.ggml.model = {model!r} has no counterpart here (gpt2 and llama do)")

    def token(key: str) -> str | None:
        return tokens[ids[key]] if ids[key] is not None else None

    eot = ids["eot"]
    settings = {
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": bool(field(reader, "tokenizer.ggml.add_bos_token", model == "llama")),
        "add_eos_token": bool(field(reader, "tokenizer.ggml.add_eos_token", False)),
        "stop_ids": [eot] if eot is not None else [],
    }
    return HFTokenizer(text, Path(path).stem, settings, field(reader, "tokenizer.chat_template"))


def kind_name(kind) -> str:
    return {str: "string", int: "whole number"}.get(kind, "number")


def _added(tokens: list[str], types: list[int]) -> list[dict[str, Any]]:
    """tokenizer.json's added tokens: llama.cpp's control tokens (special) and user-defined ones."""
    return [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False}
        | {"special": types[i] == 3}
        for i, t in enumerate(tokens)
        if types[i] in (3, 4)
    ]


def _byte_level_json(tokens, types, merges, reader, path) -> str:
    """A byte-level BPE as tokenizer.json, cutting text as its llama.cpp pre-tokenizer does (gguf_pre; "default",
    which older files name, as GPT-2's regex)."""
    import tokenizers as tk

    pre = field(reader, "tokenizer.ggml.pre", "default")
    known = pre_tokenizer("gpt-2" if pre == "default" else pre) if isinstance(pre, str) else None
    if known is None:
        raise NanoGPTError(f"{path}: tokenizer.ggml.pre = {pre!r} is a pre-tokenizer nanogpt does not know")
    vocab = {t: i for i, t in enumerate(tokens) if types[i] not in (3, 4)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    for pair in pairs:  # checked here: the tokenizers library panics on a merge outside the vocabulary
        if len(pair) != 2 or pair[0] not in vocab or pair[1] not in vocab or pair[0] + pair[1] not in vocab:
            raise NanoGPTError(f"{path}: tokenizer.ggml.merges holds {' '.join(pair)!r}, which the vocabulary lacks")
    tok = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=pairs, ignore_merges=known[1]))
    tok.pre_tokenizer = known[0]
    tok.decoder = tk.decoders.ByteLevel()
    return _with_added(tok, tokens, types)


def _sentencepiece_json(tokens, types, scores, space_prefix: bool) -> str:
    """A SentencePiece BPE as tokenizer.json: merges of every token that splits into two tokens, the merge of the
    higher-scoring token first (transformers' SentencePiece converter does the same)."""
    import tokenizers as tk

    vocab = {t: i for i, t in enumerate(tokens) if types[i] not in (3, 4)}
    merges = []
    for t, i in vocab.items():
        if types[i] != 1:
            continue
        for cut in range(1, len(t)):
            left, right = t[:cut], t[cut:]
            if left in vocab and right in vocab:
                merges.append((-scores[i], vocab[left], vocab[right], left, right))
    merges.sort()
    unk = next((t for i, t in enumerate(tokens) if types[i] == 2), None)
    model = tk.models.BPE(
        vocab=vocab, merges=[(m[3], m[4]) for m in merges], byte_fallback=True, unk_token=unk, fuse_unk=True
    )
    tok = tk.Tokenizer(model)
    tok.pre_tokenizer = tk.pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if space_prefix else "never", split=False
    )
    steps = [tk.decoders.Replace("▁", " "), tk.decoders.ByteFallback(), tk.decoders.Fuse()]
    tok.decoder = tk.decoders.Sequence(steps + ([tk.decoders.Strip(" ", 1, 0)] if space_prefix else []))
    return _with_added(tok, tokens, types)


def _with_added(tok, tokens, types) -> str:
    """The tokenizer's JSON with llama.cpp's control and user-defined tokens as added tokens at their own ids."""
    spec = json.loads(tok.to_str())
    spec["added_tokens"] = _added(tokens, types)
    vocab = spec["model"]["vocab"]
    for t in spec["added_tokens"]:
        vocab[t["content"]] = t["id"]
    return json.dumps(spec, ensure_ascii=False)
