"""The one name mapping between our weights and the Hugging Face families (families/, one record each), their
tokenizers, and loading a Hugging Face model (`hf:NAME` from the hub, or a local folder) as our GPT plus our
tokenizer.

    model = GPT.from_hf(GPT2LMHeadModel.from_pretrained("gpt2"));  hf_model = model.to_hf()
    model, tokenizer_desc = load_pretrained("path/to/hf_dir")  # any tokenizer.json: hf_tokenizer.py

Which family computes which of our configs exactly (`hf_kind`): the first in FAMILIES whose record declares every
field's value held; no family is named in this module. A model imported from a family exports back to it
(`prefer`), where that family holds the config. Importing: a model whose bias tensors are all zero becomes a model
without biases, one whose only non-zero biases are on q, k and v a model with --qkv-bias.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from nanogpt_cli import errors
from nanogpt_cli.config import ANY, GPTConfig, flag_value
from nanogpt_cli.errors import NanoGPTError, first_line
from nanogpt_cli.interop.families import FAMILIES, Biases
from nanogpt_cli.interop.families.base import rope_scaling_from_hf, rope_scaling_to_hf  # noqa: F401 (re-exported)
from nanogpt_cli.model import GPT

FAMILY_KEY = "hf_family"  # in a model's metadata: the family it was imported from
ARCHS = {  # model_type -> (top names, block names, block prefix, transformers class)
    kind: (f.top, f.block, f.prefix, f.hf_class) for kind, f in FAMILIES.items()
}


@contextlib.contextmanager
def quiet_transformers():
    """transformers' own progress bars and warnings ("Loading weights ...") off: our commands print one summary
    line, or one error sentence."""
    logging = require("transformers").utils.logging
    hub_logging = require("huggingface_hub").utils.logging  # its retry warnings; download bars stay
    verbosity, hub_verbosity, bars = (
        logging.get_verbosity(),
        hub_logging.get_verbosity(),
        logging.is_progress_bar_enabled(),
    )
    logging.set_verbosity_error()
    hub_logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        hub_logging.set_verbosity(hub_verbosity)
        if bars:
            logging.enable_progress_bar()


def require(module: str):
    """Import an optional dependency of the hf extra, or say in one sentence how to install it."""
    return errors.require(module, "hf")


# --- which architecture ---------------------------------------------------------------------------------


def hf_kind(c: GPTConfig, prefer: str | None = None) -> str:
    """The family (its model_type) that computes exactly what this config computes: the first in FAMILIES whose
    declaration holds it (families/: each says which fields and values it holds). prefer: the family the model
    came from, kept when it holds the config. Otherwise one sentence naming the closest family and the flags it
    needs: of the families that hold the most of the settings this config changes from the defaults (a model
    trained with --qk-norm is closest to one that has QK-norm), the one with the fewest flags to change."""
    if prefer in FAMILIES and FAMILIES[prefer].refuses(c) is None:
        return prefer
    for kind, family in FAMILIES.items():
        if family.refuses(c) is None:
            return kind
    default = GPTConfig()
    chosen = [f.name for f in dataclasses.fields(GPTConfig) if getattr(c, f.name) != getattr(default, f.name)]

    def distance(family) -> tuple[int, int]:
        takes = family.features.takes
        held = sum(takes[name].ok(getattr(c, name), c) for name in chosen)
        return -held, len(family.features.mismatches(c))

    closest = min(FAMILIES.values(), key=distance)  # the first in FAMILIES on a tie
    # the settings that made it the closest: those it holds that not every family does
    has = [
        flag_value(name, getattr(c, name))
        for name in chosen
        if closest.features.takes[name].ok(getattr(c, name), c)
        and not all(f.features.takes[name] is ANY for f in FAMILIES.values())
    ]
    which = f"{closest.hf_class}, which has {' '.join(has)}," if has else f"{closest.hf_class},"
    raise NanoGPTError(
        f"no stock Hugging Face architecture computes this model; the closest, {which} needs "
        f"{closest.features.needs(c)}"
    )


def _check_kind(hf_config) -> str:
    kind = getattr(hf_config, "model_type", None)
    if kind not in FAMILIES:
        names = ", ".join(FAMILIES)
        raise NanoGPTError(f"model_type {kind!r} has no counterpart in nanogpt (these convert: {names})")
    return kind


def config_from_hf(c, biases: Biases | bool) -> GPTConfig:
    """Our config for a transformers config; biases: which of the model's bias tensors are non-zero."""
    from nanogpt_cli.interop.families.base import default_width

    biases = biases if isinstance(biases, Biases) else Biases(other=biases)
    return default_width(FAMILIES[_check_kind(c)].config_in(c, biases))


def hf_config_for(c: GPTConfig, kind: str, special: dict[str, int | None]) -> tuple[Any, dict[str, Any]]:
    """The transformers config for our config, and keys to add to its config.json for older transformers versions
    (4.x reads only the top-level RoPE keys; llama.cpp's GPT-2 converter wants n_ctx). special: bos/eos/pad ids."""
    return FAMILIES[kind].config_out(c, special)


# --- weights --------------------------------------------------------------------------------------------


def _mapping(config: GPTConfig, kind: str) -> dict[str, str | tuple[str, ...]]:
    """Every one of our state-dict names -> the Hugging Face name(s) it comes from."""
    top, block, prefix, _ = ARCHS[kind]
    names: dict[str, str | tuple[str, ...]] = dict(top)
    for i in range(config.n_layer):
        for ours, theirs in block.items():
            if isinstance(theirs, tuple):
                names[f"transformer.h.{i}.{ours}"] = tuple(f"{prefix}.{i}.{t}" for t in theirs)
            else:
                names[f"transformer.h.{i}.{ours}"] = f"{prefix}.{i}.{theirs}"
    if not config.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    return names


def _to_ours(kind: str, name: str, tensor: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    return FAMILIES[kind].to_ours(name, tensor, config)


def _to_theirs(kind: str, name: str, tensor: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    return FAMILIES[kind].to_theirs(name, tensor, config)


def peft_tensors(
    config: GPTConfig, kind: str, layers: dict[str, tuple[torch.Tensor, torch.Tensor]]
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Our LoRA adapters ({module name: (A (r, in), B (out, r))}) as a PEFT adapter's tensors for the `kind` model,
    and the exact paths of the modules they go on. A fused projection of ours that is several modules there
    (separate q/k/v_proj, gate/up_proj) gives each its rows of B and the same A: B_q A is the q rows of B A. The
    family orders B's rows as its weights' (its peft_rows, for fused rows ordered by head); a Conv1D family needs
    no transpose here, as PEFT keeps lora_A and lora_B as linear layers there too (fan_in_fan_out applies to the
    merge)."""
    names = _mapping(config, kind)
    tensors: dict[str, torch.Tensor] = {}
    targets: list[str] = []
    for module, (a, b) in layers.items():
        theirs = names[f"{module}.weight"]
        theirs = theirs if isinstance(theirs, tuple) else (theirs,)
        b = FAMILIES[kind].peft_rows(f"{module}.weight", b, config)  # fused rows a family orders by head
        sizes = _fused_sizes(config, module, b.size(0), len(theirs))
        for name, part in zip(theirs, b.split(sizes, dim=0)):
            path = name.removesuffix(".weight")
            tensors[f"base_model.model.{path}.lora_A.weight"] = a.float().contiguous().clone()
            tensors[f"base_model.model.{path}.lora_B.weight"] = part.float().contiguous().clone()
            targets.append(path)
    return tensors, targets


def _fused_sizes(config: GPTConfig, module: str, rows: int, parts: int) -> list[int]:
    """The rows of each part of one of our fused projections: q, k and v (nh, nkv, nkv heads), or equal parts."""
    if parts == 3 and module.endswith("attn.c_attn"):
        return [n * config.head_size for n in (config.n_head, config.kv_heads, config.kv_heads)]
    return [rows // parts] * parts


def _has_bias(state: dict[str, torch.Tensor], qkv: bool | None = None) -> bool:
    """Whether any bias is non-zero; qkv True: among q, k and v's only, False: among the others only."""

    def counted(name: str) -> bool:
        on_qkv = name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))
        return qkv is None or on_qkv == qkv

    biases = [t for name, t in state.items() if name.endswith(".bias") and counted(name)]
    return any(t.is_floating_point() and bool(t.any()) for t in biases)


def from_hf(hf_model, consume: bool = False) -> GPT:
    """Our GPT with the weights of a transformers model of one of the families (families/). Built on the meta
    device and filled tensor by tensor: a tensor whose layout is ours already (float32, no transform) is shared
    with hf_model, not copied, so training the result changes hf_model too. consume: hf_model is dropped after,
    so each of its tensors is taken out of it once used, and a transformed one (fused q/k/v, a transpose) frees
    its source at once: the peak is hf_model and one block's new tensors, not two models."""
    from nanogpt_cli.device import release_freed_memory
    from nanogpt_cli.interop.materialize import empty_model

    kind = _check_kind(hf_model.config)
    theirs = hf_model.state_dict()
    if isinstance(FAMILIES[kind].block["attn.c_attn.weight"], tuple):  # separate q, k and v: their biases apart
        biases = Biases(other=_has_bias(theirs, qkv=False), qkv=_has_bias(theirs, True))
    else:
        biases = Biases(other=_has_bias(theirs))
    config = config_from_hf(hf_model.config, biases)
    embedding, head = theirs.get(FAMILIES[kind].top["transformer.wte.weight"]), theirs.get("lm_head.weight")
    if config.tie_embeddings and head is not None and embedding is not None and not _same(head, embedding):
        raise NanoGPTError(
            "the model's config ties the output head to the embedding (tie_word_embeddings), and its weights hold "
            "an lm_head.weight of its own: set tie_word_embeddings to false in its config.json"
        )
    model = empty_model(config)
    wanted = dict(model.named_parameters())  # a tied head is one parameter, under the embedding's name
    files = _file_ranges() if consume else []
    with torch.no_grad():
        for name, source in _mapping(config, kind).items():
            if name not in wanted:
                continue  # a bias of theirs that is zero, or positions we compute (RoPE)
            sources = [theirs.pop(s) for s in (source if isinstance(source, tuple) else (source,)) if s in theirs]
            tensor = _converted(kind, name, source, sources, wanted[name], config)
            _set_param(model, name, tensor)
            if consume:
                _drop(hf_model, source)
                for s in sources:
                    if s.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr():
                        _drop_file_pages(s, files)
                del sources
            if name.endswith(".mlp.c_proj.weight"):
                release_freed_memory()  # a block's sources, freed, give their pages back
    if config.tie_embeddings:
        model.lm_head.weight = model.transformer.wte.weight
    assert not any(t.is_meta for t in model.state_dict().values()), "a tensor was left on the meta device"
    return model


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """One tensor, or two holding equal values."""
    if a.data_ptr() == b.data_ptr() and a.shape == b.shape:
        return True
    return a.shape == b.shape and bool(torch.equal(a, b))


def _converted(kind: str, name: str, source, sources: list, like: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    """Our tensor `name` from their tensors `sources` (those of the names `source` it has): theirs itself when
    float32 and kept as is, else a new one."""
    if len(sources) < (len(source) if isinstance(source, tuple) else 1):  # only biases may be absent (mlp_bias)
        if not name.endswith(".bias"):
            raise NanoGPTError(f"the Hugging Face model has no {source}, which its config implies")
        return torch.zeros(like.shape)
    parts = [t.detach().float() for t in sources]
    try:
        tensor = _to_ours(kind, name, parts[0] if len(parts) == 1 else torch.cat(parts, dim=0), config)
    except RuntimeError:  # parts that do not concatenate or reshape: shapes the config does not imply
        tensor = None
    if tensor is None or tensor.shape != like.shape:
        shapes = ", ".join(f"{tuple(t.shape)}" for t in parts)
        raise NanoGPTError(
            f"the Hugging Face model's {source} has shape {shapes}, which is not what its config implies for our "
            f"{name} {tuple(like.shape)}"
        )
    return tensor.contiguous()  # GPT-2's transposed Conv1D matrices: as copy_ into our Linear laid them out


def _set_param(model: GPT, name: str, tensor: torch.Tensor) -> None:
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    setattr(module, attr, torch.nn.Parameter(tensor, requires_grad=getattr(module, attr).requires_grad))


def _drop(hf_model, source) -> None:
    """Take the used tensors out of hf_model (an empty tensor in their place), so that one no tensor of ours
    shares is freed now."""
    for s in source if isinstance(source, tuple) else (source,):
        owner, _, attr = s.rpartition(".")
        module = hf_model.get_submodule(owner)
        if attr in module._parameters:
            module._parameters[attr] = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        elif attr in module._buffers:
            module._buffers[attr] = torch.empty(0)


def _file_ranges() -> list[tuple[int, int]]:
    """The address ranges this process maps from files (/proc/self/maps; none where it cannot be read)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[5].startswith("/"):
            start, end = fields[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


def _drop_file_pages(tensor: torch.Tensor, files: list[tuple[int, int]]) -> None:
    """A tensor that transformers mapped from its safetensors file and that nothing uses any more: its whole
    pages leave the resident set now (madvise DONTNEED; a private file mapping reads them again from the file if
    touched). The mapping itself lives as long as any tensor of the file, such as one our model shares, so
    freeing the tensor alone would keep every page it was read through."""
    import ctypes
    import os

    start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
    if not tensor.is_contiguous() or not any(a <= start and end <= b for a, b in files):
        return  # memory of its own (not a file's): freed with the tensor
    page = os.sysconf("SC_PAGE_SIZE")
    first, last = -(-start // page) * page, end // page * page  # only pages wholly inside the tensor
    if last > first:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), 4)  # 4: MADV_DONTNEED


def to_hf(model: GPT, special: dict[str, int | None] | None = None, prefer: str | None = None):
    """A transformers model computing what `model` computes (raises NanoGPTError when no stock one does).
    special: bos_token_id / eos_token_id / pad_token_id for its config (default: none); prefer: hf_kind's."""
    c = model.config
    kind = hf_kind(c, prefer)
    special = special or {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    hf_config, _ = hf_config_for(c, kind, special)
    transformers = require("transformers")
    hf_model = getattr(transformers, ARCHS[kind][3])(hf_config)
    ours = model.state_dict()
    if c.pos_encoding == "sinusoidal":  # the fixed table becomes GPT-2's learned one
        ours["transformer.wpe.weight"] = model.pos_table
    theirs = hf_model.state_dict()
    filled = set()
    with torch.no_grad():
        for name, target in _mapping(c, kind).items():
            if name not in ours:
                continue  # a bias we do not have: zeroed below
            tensor = _to_theirs(kind, name, ours[name].detach(), c)
            targets = target if isinstance(target, tuple) else (target,)
            for t, part in zip(targets, tensor.split([theirs[t].size(0) for t in targets], dim=0)):
                theirs[t].copy_(part)
                filled.add(t)
        for name, tensor in theirs.items():
            if name in filled or (c.tie_embeddings and name == "lm_head.weight"):
                continue
            assert name.endswith(".bias"), f"{name} of the {kind} model has no counterpart in ours"
            tensor.zero_()  # a model without biases is the same model with zero biases
    hf_model.eval()
    return hf_model


# --- tokenizers -----------------------------------------------------------------------------------------


def _gpt2_files() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """GPT-2's vocabulary (token string -> id) and merges, from the packaged files tiktoken's gpt2 is built from."""
    from nanogpt_cli.tokenizer import ASSETS_DIR

    vocab = json.loads((ASSETS_DIR / "encoder.json").read_text(encoding="utf-8"))
    lines = (ASSETS_DIR / "vocab.bpe").read_text(encoding="utf-8").split("\n")[1:]  # line 0 is a version comment
    merges = [tuple(line.split(" ")) for line in lines if line]
    return vocab, merges


def byte_alphabet() -> list[str]:
    """The printable character GPT-2's byte-level BPE writes for each byte value 0..255, read off the packaged
    GPT-2 vocabulary: its first 256 tokens are the single bytes."""
    from nanogpt_cli.tokenizer import build_tokenizer

    enc = build_tokenizer("gpt2").enc
    vocab, _ = _gpt2_files()
    by_id = {i: s for s, i in vocab.items() if i < 256}
    alphabet = [""] * 256
    for i in range(256):
        alphabet[enc.decode_single_token_bytes(i)[0]] = by_id[i]
    return alphabet


def tokenizers_object(desc: dict[str, Any]):
    """A `tokenizers.Tokenizer` with the same ids as our tokenizer described by `desc`, and its end-of-text token
    (or None). gpt2: GPT-2's byte-level BPE; char: a BPE with no merges over the characters, joined back by a Fuse
    decoder; byte: a BPE with no merges over GPT-2's byte alphabet. Other encodings: one sentence."""
    tk = require("tokenizers")
    name = desc["name"]
    if name == "gpt2":
        vocab, merges = _gpt2_files()
        tok = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=merges))
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tk.decoders.ByteLevel()
        tok.add_special_tokens([tk.AddedToken("<|endoftext|>", special=True)])
        return tok, "<|endoftext|>"
    if name == "byte":
        tok = tk.Tokenizer(tk.models.BPE(vocab={ch: b for b, ch in enumerate(byte_alphabet())}, merges=[]))
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = tk.decoders.ByteLevel()
        return tok, None
    if name == "char":
        tok = tk.Tokenizer(tk.models.BPE(vocab={ch: i for i, ch in enumerate(desc["chars"])}, merges=[]))
        tok.decoder = tk.decoders.Fuse()
        return tok, None
    if desc.get("kind") == "bpe":
        return _trained_bpe_object(desc, tk)
    raise NanoGPTError(
        f"the {name} tokenizer does not export: only gpt2, char, byte and trained vocabularies have an "
        "exact Hugging Face tokenizer here"
    )


def _trained_bpe_object(desc: dict[str, Any], tk):
    """A trained BPE as a byte-level `tokenizers` BPE: the ranks in GPT-2's byte alphabet, merges derived from the
    ranks, the split pattern, and `ignore_merges` (a piece that is a whole token is that token, as in tiktoken)."""
    from nanogpt_cli.tokenizer import EOT, PATTERNS, merges_from_ranks, spell_bytes, tokenizer_from_description

    ours = tokenizer_from_description(desc)
    vocab = {spell_bytes(t): i for i, t in enumerate(ours.ranks)}
    merges = [(spell_bytes(a), spell_bytes(b)) for a, b in merges_from_ranks(ours.ranks)]
    tok = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    if ours.pattern == PATTERNS["gpt2"]:  # the ByteLevel pre-tokenizer's own regex is GPT-2's
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = tk.pre_tokenizers.Sequence(
            [
                tk.pre_tokenizers.Split(tk.Regex(ours.pattern), behavior="isolated"),
                tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = tk.decoders.ByteLevel()
    tok.add_special_tokens(
        [
            tk.AddedToken(t, special=True, normalized=False)
            for t in sorted(ours.special_tokens, key=ours.special_tokens.get)
        ]
    )
    return tok, EOT if EOT in ours.special_tokens else None


def _describe_trained_bpe(backend, spec: dict[str, Any]) -> dict[str, Any] | None:
    """Our description of a byte-level BPE that `_trained_bpe_object` wrote (ids 0..255 the bytes in order, the
    ranks after them, special tokens last), or None when the tokenizer is not one."""
    from nanogpt_cli.tokenizer import PATTERNS, BPETokenizer, byte_to_unicode

    byte_of = {ch: b for b, ch in enumerate(byte_to_unicode())}
    added = {t.content: i for i, t in backend.get_added_tokens_decoder().items()}
    regular = sorted((i, t) for t, i in backend.get_vocab(with_added_tokens=False).items())
    if (
        [i for i, _ in regular] != list(range(len(regular)))
        or len(regular) < 256
        or any(not set(t) <= byte_of.keys() for _, t in regular)
    ):
        return None
    ranks = [bytes(byte_of[ch] for ch in t) for _, t in regular]
    if ranks[:256] != [bytes([b]) for b in range(256)]:
        return None
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        pattern = PATTERNS["gpt2"]
    elif pre.get("type") == "Sequence" and [p.get("type") for p in pre.get("pretokenizers", [])] == [
        "Split",
        "ByteLevel",
    ]:
        pattern = pre["pretokenizers"][0].get("pattern", {}).get("Regex")
    else:
        return None
    names = {v: k for k, v in PATTERNS.items()}
    return BPETokenizer("bpe", ranks, pattern, added, names.get(pattern)).describe()


def describe_hf_tokenizer(backend) -> dict[str, Any]:
    """Our tokenizer description for a `tokenizers.Tokenizer` (a fast tokenizer's backend_tokenizer): GPT-2's BPE,
    or a char or byte vocabulary as `tokenizers_object` writes them; anything else is one sentence."""
    from nanogpt_cli.tokenizer import build_tokenizer

    vocab = backend.get_vocab(with_added_tokens=True)
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    merges = model.get("merges") or []
    decoder = (spec.get("decoder") or {}).get("type")
    if model.get("type") == "BPE":
        gpt2_vocab, _ = _gpt2_files()
        if vocab == gpt2_vocab and len(merges) == 50000:
            return build_tokenizer("gpt2").describe()
        if not merges and len(vocab) == 256 and vocab == {ch: b for b, ch in enumerate(byte_alphabet())}:
            return {"name": "byte", "vocab_size": 256}
        trained = _describe_trained_bpe(backend, spec) if merges else None
        if trained is not None:
            return trained
        chars = "".join(sorted(vocab, key=vocab.get))
        if (
            not merges
            and decoder == "Fuse"
            and all(len(t) == 1 for t in vocab)
            and sorted(vocab.values()) == list(range(len(vocab)))
            and chars == "".join(sorted(chars))
        ):
            return {"name": "char", "vocab_size": len(chars), "chars": chars}
    raise NanoGPTError(
        "this Hugging Face tokenizer is neither GPT-2's BPE nor a char, byte or trained vocabulary "
        "exported by nanogpt, so nanogpt cannot encode text for it"
    )


# --- loading a Hugging Face model -------------------------------------------------------------------------


def is_hf_source(source: str | Path) -> bool:
    """hf:NAME, or a folder holding a transformers config.json (not one of our run folders)."""
    return str(source).startswith("hf:") or is_hf_folder(Path(source))


def is_hf_folder(path: Path) -> bool:
    """A folder holding a transformers config.json (with a model_type), not one of our run folders."""
    if not (path / "config.json").is_file() or ((path / "model.safetensors").is_file() and _is_ours(path)):
        return False
    try:
        return "model_type" in json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False


def _is_ours(path: Path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            return (f.metadata() or {}).get("format") == "nanogpt"
    except Exception:  # not a readable safetensors file: not ours either
        return False


def load_pretrained(source: str | Path) -> tuple[GPT, dict[str, Any]]:
    """Our GPT and our tokenizer description from `hf:NAME` (the hub, through from_pretrained) or a local folder
    (offline). Anything that cannot be loaded or converted is one sentence."""
    model, meta = load_pretrained_meta(source)
    return model, meta["tokenizer"]


def load_pretrained_meta(source: str | Path) -> tuple[GPT, dict[str, Any]]:
    """load_pretrained, with the metadata loading.load_model gives: the tokenizer's description; for a Hugging
    Face tokenizer the folder its tokenizer.json is in ("tokenizer_dir") and its chat template, when it has one."""
    transformers = require("transformers")
    source = str(source)
    online = source.startswith("hf:")
    name = source[3:] if online else source
    where = f"hf:{name}" if online else name
    if online and not name:
        raise NanoGPTError("hf: needs a model name, such as hf:gpt2")
    if not online and not Path(name).is_dir():
        raise NanoGPTError(f"{name} is not a folder holding a Hugging Face model")
    kwargs = {} if online else {"local_files_only": True}
    try:
        with quiet_transformers():
            hf_config = transformers.AutoConfig.from_pretrained(name, **kwargs)
    except OSError as e:
        if online:
            from nanogpt_cli.hf_tokenizer import offline_miss

            raise NanoGPTError(
                offline_miss(where)
                or f"could not load {where} from the Hugging Face hub (offline, misspelt, or gated?): {first_line(e)}"
            ) from None
        raise NanoGPTError(f"{where} holds no readable Hugging Face config.json ({first_line(e)})") from None
    except ValueError as e:
        raise NanoGPTError(f"{where}: {first_line(e)}") from None
    except Exception as e:  # a config.json whose values break transformers' own checks (a head count of 0)
        raise NanoGPTError(f"{where}'s config.json is not valid ({type(e).__name__}: {first_line(e)})") from None
    _check_kind(hf_config)
    if not online:
        check_folder(Path(name), hf_config, transformers)
    meta = _pretrained_tokenizer(transformers, name, where, kwargs)
    try:
        with quiet_transformers():
            hf_model, report = transformers.AutoModelForCausalLM.from_pretrained(
                name, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs
            )
    except Exception as e:  # transformers raises what its parts raise for a damaged file
        raise NanoGPTError(f"could not load the weights of {where} ({type(e).__name__}: {first_line(e)})") from None
    _check_report(where, report)
    model = from_hf(hf_model, consume=True)
    del hf_model
    meta[FAMILY_KEY] = hf_config.model_type  # an export of this model writes the same family back
    desc = meta["tokenizer"]
    if desc["vocab_size"] > model.config.vocab_size:
        raise NanoGPTError(
            f"{where} has {desc['vocab_size']:,} tokens but only {model.config.vocab_size:,} rows of embeddings"
        )
    return model, meta


def _check_report(where: str, report: dict[str, Any]) -> None:
    """transformers' loading report: a tensor of another shape than the config implies, one the config has no
    place for, or one it implies and the files lack (which transformers would leave random) is one sentence."""
    for name, has, wants in sorted(report.get("mismatched_keys") or ()):
        raise NanoGPTError(
            f"{where} does not match its config.json: {name} has shape {tuple(has)}, and the config implies "
            f"{tuple(wants)}"
        )
    for key, words in (
        ("missing_keys", "has no {}, which its config.json implies (it would be left random)"),
        ("unexpected_keys", "holds {}, which its config.json has no place for"),
    ):
        names = sorted(report.get(key) or ())
        if names:
            raise NanoGPTError(f"{where} does not match its config.json: it {words.format(names[0])}")


def check_folder(folder: Path, hf_config, transformers) -> None:
    """A local folder's safetensors headers against its config.json, before transformers builds the model: its
    blocks counted (a config of 100,000 layers is refused, not allocated) and each tensor's shape against the one
    the config implies (the model built on the meta device)."""
    from safetensors import SafetensorError, safe_open

    from nanogpt_cli.interop.materialize import check_blocks

    shapes: dict[str, tuple[int, ...]] = {}
    files = sorted(folder.glob("*.safetensors"))
    index = folder / "model.safetensors.index.json"  # sharded weights: only the files it lists are the model's
    if index.is_file():
        try:
            listed = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise NanoGPTError(
                f"{index} is not a readable weights index ({type(e).__name__}: {first_line(e)})"
            ) from None
        files = [f for f in files if f.name in listed]
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                shapes |= {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        except (SafetensorError, OSError, ValueError) as e:
            raise NanoGPTError(f"{file} is not a valid safetensors file ({first_line(e)})") from None
    layers = getattr(hf_config, "num_hidden_layers", None)
    if not shapes or not isinstance(layers, int):
        return  # no safetensors (transformers reports what it finds), or a config without a layer count
    check_blocks(f"{folder}", layers, shapes, r"(?:.*\.)?(?:layers|h)\.(\d+)\.")
    try:
        with torch.device("meta"), quiet_transformers():
            meta_model = transformers.AutoModelForCausalLM.from_config(hf_config)
    except Exception as e:  # a config.json transformers cannot build from
        raise NanoGPTError(
            f"{folder}'s config.json does not build a model ({type(e).__name__}: {first_line(e)})"
        ) from None
    expected = {k: tuple(v.shape) for k, v in meta_model.state_dict().items()}
    prefix = getattr(meta_model, "base_model_prefix", "")
    for name, shape in shapes.items():
        wants = expected.get(name, expected.get(f"{prefix}.{name}"))
        if wants is not None and wants != shape:
            raise NanoGPTError(
                f"{folder} does not match its config.json: {name} has shape {shape}, and the config implies {wants}"
            )


def _pretrained_tokenizer(transformers, name: str, where: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The tokenizer of a Hugging Face model: ours when it is GPT-2's or one nanogpt exported, else its own
    tokenizer.json (hf_tokenizer.py), with the folder that holds it and its chat template."""
    from nanogpt_cli.hf_tokenizer import HF_FILE, TOKENIZER_DIR, read_hf_tokenizer

    try:
        with quiet_transformers():
            tokenizer = transformers.AutoTokenizer.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as e:
        raise NanoGPTError(f"{where} has no tokenizer that loads ({first_line(e)})") from None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise NanoGPTError(f"{where} has only a slow tokenizer; nanogpt reads tokenizer.json")
    try:
        return {"tokenizer": describe_hf_tokenizer(backend)}
    except NanoGPTError:
        if not where.startswith("hf:") and not (Path(name) / HF_FILE).is_file():
            raise
    tok = read_hf_tokenizer(where if where.startswith("hf:") else name)
    meta = {"tokenizer": tok.describe(), TOKENIZER_DIR: str(tok.folder)}
    if tok.chat_template:
        meta["chat_template"] = tok.chat_template
    return meta
