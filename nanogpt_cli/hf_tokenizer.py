"""Any Hugging Face `tokenizer.json` the `tokenizers` library reads, as one of our tokenizers: byte-level BPE
(GPT-2, Llama 3, Qwen, SmolLM), SentencePiece-style BPE with byte fallback and the ▁ space (Llama 2, TinyLlama,
Mistral, Gemma), and their added and special tokens.

    tok = read_hf_tokenizer("hf:HuggingFaceTB/SmolLM2-135M")   # or a folder holding tokenizer.json, or the file
    tok.encode("Hello"); tok.save_files(run_dir); HFTokenizer.load(desc, run_dir)

The vocabulary is the file itself: it is copied beside meta.json, into each run folder and into every export,
and the description (what meta.json and checkpoints store) names it only by its sha256. The description keeps
what tokenizer_config.json and generation_config.json say that encoding needs: the BOS/EOS tokens, whether a text
starts with BOS (add_bos_token; else the file's post-processor decides, as in transformers), and the ids that end
a reply (generation_config's eos_token_id, which may be a list, with the EOS token).

encode() is plain text (special-token strings are text, no BOS); encode_special() recognizes the added tokens in
rendered chat templates, as `apply_chat_template` does; `bos_id` is the token a text starts with, when the model
expects one. decode() is the library's; decode_bytes() gives each token's own bytes (a byte-fallback piece is one
byte), so a streaming decoder can hold a character split across tokens until it is complete. It leaves out what
the decoder does to the start of a whole text only (SentencePiece's Strip of the leading space), as a
continuation of a prompt keeps its space.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from nanogpt_cli.errors import NanoGPTError, first_line, require

HF_FILE = "tokenizer.json"  # the vocabulary, as the tokenizers library writes it: this file travels
CONFIG_FILE = "tokenizer_config.json"  # BOS/EOS tokens, add_bos_token, the chat template
GENERATION_FILE = "generation_config.json"  # eos_token_id: what ends a reply (an int or a list)
TEMPLATE_FILE = "chat_template.jinja"  # the chat template, as newer transformers save it
HUB_FILES = [HF_FILE, CONFIG_FILE, GENERATION_FILE, TEMPLATE_FILE, "special_tokens_map.json"]
# keys load_model adds to the metadata it returns (never saved): where a Hugging Face tokenizer's file is
TOKENIZER_DIR = "tokenizer_dir"  # the folder holding its tokenizer.json
TOKENIZER_TEXT = "tokenizer_json"  # or the file's text (a GGUF file carries it inside)
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class HFTokenizer:
    """A `tokenizers.Tokenizer` read from tokenizer.json, with the settings its config files give. It has
    tokenizer.Tokenizer's interface (that module builds it, so this one does not import it)."""

    kind = "hf"

    def __init__(
        self,
        text: str,
        name: str,
        settings: dict[str, Any],
        chat_template: str | None = None,
        folder: Path | None = None,
    ):
        tk = require("tokenizers", "hf", what="Hugging Face tokenizers")
        try:
            self._special = tk.Tokenizer.from_str(text)  # added tokens recognized in the text
            self._plain = tk.Tokenizer.from_str(text)  # special-token strings are text
        except Exception as e:  # the library raises its own Exception for a file it cannot read
            raise NanoGPTError(
                f"the tokenizer {name} is not a tokenizer.json the tokenizers library reads ({first_line(e)})"
            ) from None
        self._plain.encode_special_tokens = True
        self.text, self.name, self.chat_template = text, name, chat_template
        self.folder = folder  # where its tokenizer.json was read from, when it was read from a folder
        self.sha256 = hashlib.sha256(text.encode("utf-8")).hexdigest()
        self.settings = _complete(self._special, settings)
        if self.settings["add_bos_token"] is not None or self.settings["add_eos_token"] is not None:
            _set_post_processor(self._special, tk, self.settings)  # as transformers does with explicit flags
        self.bos_id, self.eot_id = self._prefix(), self.settings["eos_id"]
        self._bytes = _token_bytes(self._special)

    @property
    def vocab_size(self) -> int:
        return len(self._bytes)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return tuple(self.settings["stop_ids"])

    @property
    def special_strings(self) -> dict[str, str]:
        """What a chat template sees as bos_token, eos_token, unk_token and pad_token (those the tokenizer has)."""
        return {k: self.settings[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if self.settings[k]}

    def encode(self, text: str) -> list[int]:
        return self._plain.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        return [e.ids for e in self._plain.encode_batch(list(texts), add_special_tokens=False)]

    def encode_special(self, text: str) -> list[int]:
        """Like encode, but added and special tokens written in the text are their ids (a rendered template)."""
        return self._special.encode(text, add_special_tokens=False).ids

    def encode_document(self, text: str) -> list[int]:
        """What transformers' tokenizer(text) gives: the text with the post-processor's BOS and EOS."""
        return self._special.encode(text, add_special_tokens=True).ids

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        table = self._bytes
        return b"".join(table[i] for i in ids)

    def decode(self, ids: Iterable[int]) -> str:
        return self._special.decode(list(ids), skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size})"

    def token_text(self, tid: int) -> str | None:
        """The token's string in the vocabulary (Ġ for a space in byte-level BPE, ▁ in SentencePiece's)."""
        return self._special.id_to_token(tid)

    def token_id(self, token: str | None) -> int | None:
        return self._special.token_to_id(token) if token else None

    def added_tokens(self) -> dict[int, bool]:
        """The added tokens' ids, each with whether it is special (a control token, not text)."""
        return {i: t.special for i, t in self._special.get_added_tokens_decoder().items()}

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "vocab_size": self.vocab_size, "sha256": self.sha256} | {
            k: self.settings[k] for k in DESCRIBED
        }

    def save_files(self, folder: Path) -> None:
        """Write tokenizer.json into `folder` (which must exist): the bytes it was read from."""
        (Path(folder) / HF_FILE).write_text(self.text, encoding="utf-8")

    def _prefix(self) -> int | None:
        """The token the post-processor puts before a text (Llama's <s>), found by encoding a probe."""
        plain = self._special.encode("a", add_special_tokens=False).ids
        full = self._special.encode("a", add_special_tokens=True).ids
        start = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), 0)
        return full[start - 1] if start >= 1 else None

    @classmethod
    def load(cls, desc: dict[str, Any], folder: Path | None = None, text: str | None = None) -> HFTokenizer:
        """The tokenizer `describe()` described, from the tokenizer.json in `folder` (or its `text`), checked
        against the description's sha256."""
        where = f"{folder}" if folder is not None else "the file"
        if text is None:
            path = Path(folder) / HF_FILE if folder is not None else None
            if path is None or not path.is_file():
                raise NanoGPTError(
                    f"the {desc.get('name')} tokenizer is a Hugging Face tokenizer.json, and "
                    f"{where if folder is not None else 'its folder'} has no {HF_FILE}; copy it there from where "
                    "the data was prepared"
                )
            text = path.read_text(encoding="utf-8")
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        if digest != desc.get("sha256"):
            raise NanoGPTError(
                f"the {HF_FILE} in {where} is not the one the {desc.get('name')} tokenizer was described with "
                f"(sha256 {digest[:12]}..., expected {str(desc.get('sha256'))[:12]}...)"
            )
        settings = {k: desc.get(k) for k in DESCRIBED}
        return cls(text, desc["name"], settings, folder=Path(folder) if folder is not None else None)


# the settings a description keeps (the rest of it is name, kind, vocab_size and sha256)
DESCRIBED = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "add_bos_token",
    "add_eos_token",
    "eos_id",
    "stop_ids",
)


def _complete(backend, settings: dict[str, Any]) -> dict[str, Any]:
    """The settings with the ids filled in: EOS is the configured token, else generation_config's first end id,
    else <|endoftext|> when the vocabulary has it; the stop ids are EOS and generation_config's end ids."""
    out = {k: settings.get(k) for k in DESCRIBED}
    vocab = backend.get_vocab(with_added_tokens=True)
    ends = [i for i in (settings.get("stop_ids") or []) if isinstance(i, int)]
    eos = out["eos_token"]
    if eos is None and ends and backend.id_to_token(ends[0]) is not None:
        eos = backend.id_to_token(ends[0])
    if eos is None and "<|endoftext|>" in vocab:
        eos = "<|endoftext|>"
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        token = eos if key == "eos_token" else out[key]
        out[key] = token if token in vocab else None  # a token the vocabulary lacks is not one it can give
    out["eos_id"] = vocab.get(out["eos_token"]) if out["eos_token"] else None
    stops = ([out["eos_id"]] if out["eos_id"] is not None else []) + ends
    out["stop_ids"] = sorted(set(i for i in stops if backend.id_to_token(i) is not None))
    return out


def _set_post_processor(backend, tk, settings: dict[str, Any]) -> None:
    """BOS and EOS around a text as add_bos_token / add_eos_token say (transformers' update_post_processor)."""
    bos, eos = settings["bos_token"], settings["eos_token"]
    add_bos, add_eos = bool(settings["add_bos_token"]) and bos, bool(settings["add_eos_token"]) and eos
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    specials = [(t, backend.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    backend.post_processor = tk.processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _token_bytes(backend) -> list[bytes]:
    """Each id's bytes as it continues a text: its string through the decoder's per-token steps (GPT-2's byte
    alphabet, ▁ -> space, <0xNN> -> the byte). Steps after a Fuse see the whole text (SentencePiece's Strip of the
    leading space) and are left out. A decoder of another kind: the library's decode of the token alone."""
    spec = json.loads(backend.to_str())
    decoder = spec.get("decoder") or {}
    steps = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder] if decoder else []
    added = {i for i in backend.get_added_tokens_decoder()}
    size = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    known = {"ByteLevel", "Replace", "ByteFallback", "Fuse", "Strip", "Metaspace"}
    if not steps or any(s.get("type") not in known for s in steps):
        return [backend.decode([i], skip_special_tokens=False).encode("utf-8") for i in range(size)]
    byte_of = {ch: b for b, ch in enumerate(byte_to_unicode())}
    table = []
    for i in range(size):
        token = backend.id_to_token(i)
        if token is None:
            table.append(b"")
        elif i in added and not _decoded_added(spec, token):
            table.append(token.encode("utf-8"))
        else:
            table.append(_one_token(token, steps, byte_of))
    return table


def _decoded_added(spec: dict[str, Any], token: str) -> bool:
    """Whether the decoder sees this added token too (a non-special added token, normalized, does)."""
    for t in spec.get("added_tokens", []):
        if t.get("content") == token:
            return not t.get("special") and t.get("normalized", True)
    return False


def _one_token(token: str, steps: list[dict[str, Any]], byte_of: dict[str, int]) -> bytes:
    for step in steps:
        kind = step["type"]
        if kind == "Fuse":
            break  # what follows sees the whole text
        if kind == "ByteLevel":
            return bytes(byte_of[c] for c in token) if all(c in byte_of for c in token) else token.encode("utf-8")
        if kind == "ByteFallback":
            m = _BYTE_PIECE.fullmatch(token)
            if m:
                return bytes([int(m.group(1), 16)])
        elif kind == "Replace" and "String" in step.get("pattern", {}):
            token = token.replace(step["pattern"]["String"], step["content"])
        elif kind == "Metaspace":
            token = token.replace(step.get("replacement", "▁"), " ")
        elif kind == "Strip":
            start, stop, content = step.get("start", 0), step.get("stop", 0), step.get("content", " ")
            while start and token.startswith(content):
                token, start = token[len(content) :], start - 1
            while stop and token.endswith(content):
                token, stop = token[: -len(content)], stop - 1
    return token.encode("utf-8")


# --- reading the files --------------------------------------------------------------------------------------


def hf_tokenizer_path(spec: str) -> Path | None:
    """The tokenizer.json that `spec` names (the file, or a folder holding one); None when it names none.
    tokenizer.py asks this after it has found no tokenizer trained here (whose folder has a tokenizer.json too)."""
    if not spec or spec.startswith("hf:"):
        return None
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".json":
        return path
    if (path / HF_FILE).is_file():
        return path / HF_FILE
    return None


def is_hf_spec(spec: str) -> bool:
    """hf:NAME, or a path to a Hugging Face tokenizer.json or its folder."""
    return spec.startswith("hf:") or hf_tokenizer_path(spec) is not None


def read_hf_tokenizer(spec: str) -> HFTokenizer:
    """The tokenizer `spec` names: hf:NAME (its files fetched from the hub, or its cache), a tokenizer.json, or
    a folder holding one; the config files beside it, when there, say BOS/EOS, end ids and the chat template."""
    if spec.startswith("hf:"):
        path = _from_hub(spec[3:]) / HF_FILE
        name = spec
    else:
        found = hf_tokenizer_path(spec)
        if found is None:
            raise NanoGPTError(f"{spec} is neither a tokenizer.json nor a folder holding one")
        path, name = found, found.parent.name if found.name == HF_FILE else found.stem
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise NanoGPTError(f"could not read {path} ({first_line(e)})") from None
    settings, template = read_tokenizer_settings(path.parent)
    return HFTokenizer(text, name or "hf", settings, template, path.parent)


def _from_hub(repo: str) -> Path:
    """The folder of the hub's tokenizer files of `repo`, through huggingface_hub (its cache when offline)."""
    if not repo:
        raise NanoGPTError("--tokenizer hf: needs a model name, such as hf:HuggingFaceTB/SmolLM2-135M")
    hub = require("huggingface_hub", "hf", what="tokenizers from the Hugging Face hub")
    try:
        folder = Path(hub.snapshot_download(repo, allow_patterns=HUB_FILES))
    except Exception as e:  # offline, a connection refused, a gated or missing repo: all mean "not here"
        raise NanoGPTError(
            offline_miss(f"hf:{repo}")
            or f"could not fetch the tokenizer of hf:{repo} from the Hugging Face hub (offline, misspelt, or "
            f"gated?): {type(e).__name__}; give the path of a tokenizer.json instead"
        ) from None
    if not (folder / HF_FILE).is_file():
        raise NanoGPTError(f"hf:{repo} has no {HF_FILE}, so nanogpt cannot read its tokenizer")
    return folder


def offline_miss(where: str) -> str | None:
    """The sentence for hf:NAME missing from the local cache while HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is
    set, when it is; None when downloads are allowed (then the hub's own failure says more)."""
    constants = require("huggingface_hub", "hf", what="models from the Hugging Face hub").constants
    if not constants.HF_HUB_OFFLINE:
        return None
    return (
        f"{where} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE (or "
        "TRANSFORMERS_OFFLINE) is set, so nanogpt cannot download it; unset it to fetch the model once"
    )


def read_tokenizer_settings(folder: Path) -> tuple[dict[str, Any], str | None]:
    """What tokenizer_config.json and generation_config.json in `folder` say (absent files say nothing), and the
    chat template (chat_template.jinja, else tokenizer_config.json's chat_template)."""
    config = _read_json(folder / CONFIG_FILE)
    generation = _read_json(folder / GENERATION_FILE)
    ends = generation.get("eos_token_id")
    ends = ends if isinstance(ends, list) else [ends] if isinstance(ends, int) else []
    settings = {
        "bos_token": _token_string(config.get("bos_token")),
        "eos_token": _token_string(config.get("eos_token")),
        "unk_token": _token_string(config.get("unk_token")),
        "pad_token": _token_string(config.get("pad_token")),
        "add_bos_token": config.get("add_bos_token") if isinstance(config.get("add_bos_token"), bool) else None,
        "add_eos_token": config.get("add_eos_token") if isinstance(config.get("add_eos_token"), bool) else None,
        "stop_ids": [i for i in ends if isinstance(i, int)],
    }
    return settings, chat_template_of(folder, config)


def chat_template_of(folder: Path, config: dict[str, Any] | None = None) -> str | None:
    """The chat template kept in a Hugging Face folder: chat_template.jinja, else tokenizer_config.json's
    chat_template (a text, or a list of named templates of which "default" is taken)."""
    jinja = Path(folder) / TEMPLATE_FILE
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise NanoGPTError(f"{jinja} is not UTF-8 text ({first_line(e)})") from None
    template = (config if config is not None else _read_json(Path(folder) / CONFIG_FILE)).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template.strip() else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise NanoGPTError(f"{path} is not readable JSON ({first_line(e)})") from None
    return value if isinstance(value, dict) else {}


def _token_string(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's dict with its content."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


@functools.cache
def byte_to_unicode() -> tuple[str, ...]:
    """GPT-2's printable stand-in for each byte 0..255, the alphabet byte-level BPE files (Hugging Face
    tokenizer.json, GGUF) spell tokens in: printable Latin-1 bytes stand for themselves, the rest are shifted
    to code points from 256 up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return tuple(out)
