"""Reading a GGUF file that llama.cpp's converter wrote (not one of ours): the config from `ARCH.*` metadata, the
weights from `blk.N.*` tensors (dequantized through the gguf package; llama-arch q/k rows put back in the order
transformers and we rotate), and the tokenizer rebuilt as a tokenizer.json from `tokenizer.ggml.*`.

    model, meta = read_any_gguf("model.gguf")   # ours (gguf_file.read_gguf) or llama.cpp's converter's

Architectures: llama (Llama, SmolLM2, TinyLlama, Mistral), qwen2, qwen3, gemma3. Tokenizers: byte-level BPE
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
from nanogpt_cli.model import GPT

ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}  # llama.cpp's -> family
BLOCK = {  # ours <- llama.cpp's, per block (a tuple: concatenated along dim 0)
    "ln_1.weight": "attn_norm.weight",
    "attn.c_attn.weight": ("attn_q.weight", "attn_k.weight", "attn_v.weight"),
    "attn.c_attn.bias": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    "attn.c_proj.weight": "attn_output.weight",
    "attn.q_norm.weight": "attn_q_norm.weight",
    "attn.k_norm.weight": "attn_k_norm.weight",
    "post_ln_1.weight": "post_attention_norm.weight",
    "ln_2.weight": "ffn_norm.weight",
    "mlp.c_fc.weight": ("ffn_gate.weight", "ffn_up.weight"),
    "mlp.c_proj.weight": "ffn_down.weight",
    "post_ln_2.weight": "post_ffw_norm.weight",
}
GEMMA3_PATTERN, GEMMA3_LOCAL_THETA = "LLLLLG", 10000.0  # what llama.cpp assumes for gemma3 when the file is silent


def _reader(path: str | Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise NanoGPTError(f"{path} is not a readable GGUF file ({e})") from None


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
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_llama_cpp_gguf(reader, path: str | Path) -> tuple[GPT, dict[str, Any]]:
    """Our model (float32) and metadata from a GGUF file in llama.cpp's converter layout."""
    import torch

    from nanogpt_cli.interop.materialize import materialize

    lazy = lazy_llama_cpp_gguf(reader, path)
    return materialize(lazy, torch.float32).eval(), lazy.meta


def lazy_llama_cpp_gguf(reader, path: str | Path):
    """read_llama_cpp_gguf's model on the meta device and how to read each of its tensors (materialize.py)."""
    import torch

    from nanogpt_cli.interop.materialize import LazyModel, empty_model

    arch = _arch(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    config = _config(reader, arch, {k: tuple(int(n) for n in reversed(t.shape)) for k, t in tensors.items()}, path)
    model = empty_model(config)
    shapes = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    sources = _weights(arch, config, tensors, shapes.keys(), path)
    for name, shape in shapes.items():
        if name in sources or name == "lm_head.weight" and config.tie_embeddings:
            continue
        if not name.endswith(".bias"):
            raise NanoGPTError(f"{path} has no tensor for our {name}")
        sources[name] = partial(torch.zeros, shape)  # absent biases are zero

    def read(name: str, dtype: torch.dtype) -> torch.Tensor:
        return sources[name](dtype=dtype)

    return LazyModel(model, read, _meta(reader, arch, config, path), str(path))


def read_llama_cpp_meta(reader, path: str | Path) -> dict[str, Any]:
    """read_llama_cpp_gguf's metadata without reading the weights (for `info`): config, tokenizer, architecture,
    file type, and the tensor types with how many of each ("tensor_types")."""
    arch = _arch(reader, path)
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    meta = _meta(reader, arch, _config(reader, arch, shapes, path), path)
    counts: dict[str, int] = {}
    for t in reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return {**meta, "tensor_types": counts}


def _arch(reader, path) -> str:
    arch = field(reader, "general.architecture")
    if arch not in ARCHS:
        raise NanoGPTError(
            f"{path} holds a {arch!r} model; nanogpt reads llama.cpp's {', '.join(ARCHS)} GGUF files and its own"
        )
    return arch


def _meta(reader, arch: str, config: GPTConfig, path) -> dict[str, Any]:
    from nanogpt_cli.hf_tokenizer import TOKENIZER_TEXT

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
        "hf_family": ARCHS[arch],
    }
    if tok.chat_template:
        meta["chat_template"] = tok.chat_template
    return meta


def _config(reader, arch: str, tensors: dict[str, tuple[int, ...]], path) -> GPTConfig:
    """Our config from the `ARCH.*` keys and the tensors' shapes; a value without a counterpart is one sentence."""

    def key(name: str, default: Any = None) -> Any:
        return field(reader, f"{arch}.{name}", default)

    n_embd, n_head = int(key("embedding_length")), int(key("attention.head_count"))
    kv = key("attention.head_count_kv", n_head)
    if isinstance(kv, list):
        raise NanoGPTError(
            f"{path}: {arch}.attention.head_count_kv varies by layer, which nanogpt has no counterpart for"
        )
    head_dim = int(key("attention.key_length", n_embd // n_head))
    rotary = key("rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise NanoGPTError(f"{path}: {arch}.rope.dimension_count = {rotary} (of {head_dim}) has no counterpart here")
    if "blk.0.attn_output.bias" in tensors or "blk.0.ffn_down.bias" in tensors:
        raise NanoGPTError(f"{path}: biases on attn_output or the MLP have no counterpart for {arch} here")
    gemma = arch == "gemma3"
    fields: dict[str, Any] = dict(
        vocab_size=tensors["token_embd.weight"][0],
        block_size=int(key("context_length")),
        n_layer=int(key("block_count")),
        n_head=n_head,
        n_embd=n_embd,
        n_kv_head=int(kv) if kv != n_head else None,
        head_dim=head_dim if head_dim * n_head != n_embd else None,
        bias=False,
        qkv_bias=True if "blk.0.attn_q.bias" in tensors else None,
        pos_encoding="rope",
        rope_theta=float(key("rope.freq_base", 10000.0)),
        norm="rmsnorm",
        norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        mlp="geglu" if gemma else "swiglu",
        mlp_hidden=int(key("feed_forward_length")),
        tie_embeddings="output.weight" not in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        **_rope_scaling(reader, arch, tensors, head_dim, path),
    )
    if gemma:
        window = key("attention.sliding_window")
        fields.update(
            embed_scale=True,
            norm_offset=True,
            post_norms=True,
            sliding_window=int(window) if window else None,
            window_pattern=GEMMA3_PATTERN if window else None,
            rope_local_theta=GEMMA3_LOCAL_THETA if window else None,
            logit_softcap=key("final_logit_softcapping"),
        )
    from nanogpt_cli.interop.families.base import default_width

    try:
        return default_width(GPTConfig(**fields))
    except ValueError as e:
        raise NanoGPTError(f"{path}: {e}") from None


def _rope_scaling(reader, arch: str, tensors: dict[str, tuple[int, ...]], head_dim: int, path) -> dict[str, Any]:
    """Our rope_* fields: linear and YaRN from `rope.scaling.*`, Llama 3's from the rope_freqs tensor (its factors
    must be what the standard Llama 3 settings give, which is what the converter writes)."""
    kind = field(reader, f"{arch}.rope.scaling.type", "none")
    out: dict[str, Any] = {}
    if kind in ("linear", "yarn"):
        out = {"rope_scaling": kind, "rope_factor": float(field(reader, f"{arch}.rope.scaling.factor"))}
        if kind == "yarn":
            out["rope_original_context"] = int(field(reader, f"{arch}.rope.scaling.original_context_length"))
    elif kind != "none":
        raise NanoGPTError(f"{path}: {arch}.rope.scaling.type = {kind!r} has no counterpart here")
    if "rope_freqs.weight" in tensors:
        out = _llama3_scaling(_rope_freqs(reader), reader, arch, head_dim, path)
    return out


def _rope_freqs(reader) -> np.ndarray:
    import gguf

    t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)


def _llama3_scaling(factors: np.ndarray, reader, arch: str, head_dim: int, path) -> dict[str, Any]:
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
    raise NanoGPTError(f"{path}: rope_freqs.weight holds factors that no Llama 3 RoPE scaling nanogpt knows gives")


def _weights(arch: str, config: GPTConfig, tensors: dict, names, path) -> dict[str, Any]:
    """Our state-dict tensors from llama.cpp's, for the names our model has: name -> a function of the dtype that
    reads it (dequantized to float32; llama-arch q/k rows reordered; Gemma's norm gains less 1)."""
    top = {"transformer.wte.weight": "token_embd.weight", "transformer.ln_f.weight": "output_norm.weight"}
    if "output.weight" in tensors:
        top["lm_head.weight"] = "output.weight"
    ours = {name: partial(_one, path, tensors[theirs], arch, name) for name, theirs in top.items()}
    heads = {"attn_q": config.n_head, "attn_k": config.kv_heads}
    for i in range(config.n_layer):
        for name, theirs in BLOCK.items():
            parts = theirs if isinstance(theirs, tuple) else (theirs,)
            if f"transformer.h.{i}.{name}" not in names or f"blk.{i}.{parts[0]}" not in tensors:
                continue
            found = [(tensors[f"blk.{i}.{part}"], heads.get(part.split(".")[0])) for part in parts]
            ours[f"transformer.h.{i}.{name}"] = partial(_joined, path, found, arch, name)
    return ours


def _gemma_gain(name: str) -> bool:
    """The converter stores Gemma's norm gains as 1 + w."""
    return "ln_" in name or name.endswith("_norm.weight")


def _one(path, t, arch: str, name: str, dtype=None):
    """One top-level tensor: a slice of rows at a time into dtype (the embedding is the largest of all)."""
    import torch

    from nanogpt_cli.interop.gguf_file import dequantized

    if arch == "gemma3" and _gemma_gain(name):
        return (dequantized(path, t, torch.float32) - 1.0).to(dtype)
    return dequantized(path, t, dtype)


def _joined(path, found: list, arch: str, name: str, dtype=None):
    """One block tensor of ours from llama.cpp's parts (concatenated along dim 0), in float32 then dtype."""
    import torch

    from nanogpt_cli.interop.gguf_file import _llama_rope_order, dequantized

    parts = []
    for t, heads in found:
        w = dequantized(path, t, torch.float32)
        if arch == "llama" and heads is not None:  # the converter's pair order for llama.cpp's rotation
            w = _llama_rope_order(w, heads, inverse=True)
        parts.append(w)
    w = torch.cat(parts) if len(parts) > 1 else parts[0]
    if arch == "gemma3" and _gemma_gain(name):
        w = w - 1.0
    return w.to(dtype)


def gguf_tokenizer(reader, path):
    """An HFTokenizer rebuilt from `tokenizer.ggml.*`: its tokenizer.json text, BOS/EOS, end of turn and template."""
    from nanogpt_cli.hf_tokenizer import HFTokenizer

    model = field(reader, "tokenizer.ggml.model")
    tokens = field(reader, "tokenizer.ggml.tokens")
    if tokens is None:
        raise NanoGPTError(f"{path} has no tokenizer.ggml.tokens, so nanogpt cannot encode text for it")
    types = field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if model == "gpt2":
        text = _byte_level_json(tokens, types, field(reader, "tokenizer.ggml.merges") or [], reader, path)
    elif model == "llama":
        scores = field(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
        text = _sentencepiece_json(tokens, types, scores, bool(field(reader, "tokenizer.ggml.add_space_prefix", True)))
    else:
        raise NanoGPTError(f"{path}: tokenizer.ggml.model = {model!r} has no counterpart here (gpt2 and llama do)")

    def token(key: str) -> str | None:
        i = field(reader, f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    eot = field(reader, "tokenizer.ggml.eot_token_id")
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


def _added(tokens: list[str], types: list[int]) -> list[dict[str, Any]]:
    """tokenizer.json's added tokens: llama.cpp's control tokens (special) and user-defined ones."""
    return [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False}
        | {"special": types[i] == 3}
        for i, t in enumerate(tokens)
        if types[i] in (3, 4)
    ]


def _byte_level_json(tokens, types, merges, reader, path) -> str:
    import tokenizers as tk

    from nanogpt_cli.interop.gguf_file import HF_PRE_TOKENIZERS, PRE_TOKENIZERS
    from nanogpt_cli.tokenizer import PATTERNS

    pre = field(reader, "tokenizer.ggml.pre", "default")
    regexes = {v: PATTERNS[k] for k, v in PRE_TOKENIZERS.items()} | {v: k for k, v in HF_PRE_TOKENIZERS.items()}
    byte_level = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("gpt-2", "default"):
        pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    elif pre == "smollm":  # GPT-2's split with each digit apart
        pre_tokenizer = tk.pre_tokenizers.Sequence(
            [tk.pre_tokenizers.Digits(individual_digits=True), tk.pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    elif pre in regexes:
        split = tk.pre_tokenizers.Split(tk.Regex(regexes[pre]), behavior="isolated")
        pre_tokenizer = tk.pre_tokenizers.Sequence([split, byte_level])
    else:
        raise NanoGPTError(f"{path}: tokenizer.ggml.pre = {pre!r} is a pre-tokenizer nanogpt does not know")
    vocab = {t: i for i, t in enumerate(tokens) if types[i] not in (3, 4)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre == "llama-bpe"))
    tok.pre_tokenizer = pre_tokenizer
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
