"""What a model source names, decided once where it enters: a run folder, a weights file of ours, a LoRA run over its
base, a Hugging Face folder, hf:NAME or a GGUF file. The loaders dispatch on the type; none of them reads the string.

    source = parse_source("shk")   # RunFolder: checkpoints/shk, its best weights
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanogpt_cli.errors import NanoGPTError

KINDS = "a run folder or a run's name, a .safetensors file, a .gguf file, a Hugging Face folder or hf:NAME"


@dataclass(frozen=True)
class Source:
    """A source as the user gave it (`given`: what messages and displays name it by)."""

    given: str

    def __str__(self) -> str:
        return self.given

    @property
    def location(self) -> str:
        """Where the model's own files are: a run's or a Hugging Face model's folder (its chat_template.jinja, say),
        else the source as given."""
        folder = getattr(self, "folder", None)
        return str(folder) if folder is not None else self.given


@dataclass(frozen=True)
class WeightsFile(Source):
    """A .safetensors file of ours (whole weights)."""

    weights: Path
    meta: dict[str, Any]  # its metadata (config, tokenizer, step, ...)


@dataclass(frozen=True)
class RunFolder(WeightsFile):
    """A run folder: its best weights, or its last (--last)."""

    folder: Path


@dataclass(frozen=True)
class LoRARun(WeightsFile):
    """A weights file (or run folder's) of LoRA adapters, loaded on the base it records."""

    base_sha256: str  # the base weights' hash when the adapters were trained (lora.weights_hash)

    @functools.cached_property
    def base(self) -> Source:
        """The base the run records, parsed with its own --last when it is first needed (serving adapters on a base
        compares hashes only, and needs no base on disk); one that names nothing is this run's sentence."""
        base = self.meta["base"]
        try:
            return parse_source(base["source"], base.get("last", False))
        except NanoGPTError as e:
            raise NanoGPTError(f"{self.weights} holds LoRA adapters, and their base could not be loaded: {e}") from None


@dataclass(frozen=True)
class HFFolder(Source):
    """A folder holding a transformers config.json (and its weights), read offline."""

    folder: Path


@dataclass(frozen=True)
class HFHub(Source):
    """hf:NAME: a model on the Hugging Face hub (or in its local cache)."""

    name: str


@dataclass(frozen=True)
class GGUFFile(Source):
    """A GGUF file: one that nanogpt exported, or llama.cpp's converter wrote."""

    path: Path


def parse_source(given: str | Path | Source, last: bool = False) -> Source:
    """The typed source that `given` names (a Source comes back as it is); a bare name is a run (or Hugging Face
    folder) in checkpoints/, as `nanogpt runs` lists it. last: a run folder's last weights instead of its best. What
    names nothing, or nothing a model loads from, is one sentence."""
    from nanogpt_cli.interop import gguf_file, hf
    from nanogpt_cli.runs.checkpoint import read_metadata
    from nanogpt_cli.runs.rundir import find_run, missing_source, resolve_weights

    if isinstance(given, Source):
        return given
    text = str(given)
    if text.startswith("hf:"):
        if not text[3:]:
            raise NanoGPTError("hf: needs a model name, such as hf:gpt2")
        return HFHub(text, text[3:])
    path = Path(find_run(text))
    if path.is_dir() and hf.is_hf_folder(path):
        return HFFolder(text, path)
    if path.is_file() and gguf_file.is_gguf(path):
        return GGUFFile(text, path)
    if not path.exists():
        raise NanoGPTError(missing_source(path))
    if path.is_file() and path.suffix != ".safetensors" and not _is_safetensors(path):
        raise NanoGPTError(f"{text} is not a model: a source is {KINDS}")
    try:
        weights = resolve_weights(path, last)
    except NanoGPTError as e:
        if not path.is_dir():
            raise
        raise NanoGPTError(f"{e}; a source is {KINDS}") from None
    meta = read_metadata(weights)
    folder = path if path.is_dir() else None
    if "lora" in meta:
        return LoRARun(text, weights, meta, meta["base"]["sha256"])
    if folder is not None:
        return RunFolder(text, weights, meta, folder)
    return WeightsFile(text, weights, meta)


def _is_safetensors(path: Path) -> bool:
    """A file whose first bytes are a safetensors header: a little-endian length, then a JSON object."""
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError:
        return False
    return len(head) == 9 and head[8:9] == b"{"
