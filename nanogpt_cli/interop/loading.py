"""Loading a model for inference from any source: a run folder (its best weights, or its last with last=True),
a .safetensors file of ours, a Hugging Face folder, or hf:NAME. `sample`, `eval` and `export` share it.

    loaded = load_for_inference("checkpoints/shk")   # model on its device and dtype, tokenizer, metadata
    model, meta = load_model("hf:gpt2")               # the model alone, float32 on the CPU
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nanogpt_cli.config import GPTConfig, LoadSpec
from nanogpt_cli.device import resolve_device, resolve_inference_dtype, say_threads, set_threads
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.hf_tokenizer import TOKENIZER_DIR, TOKENIZER_TEXT
from nanogpt_cli.interop import hf
from nanogpt_cli.interop.source import GGUFFile, HFFolder, HFHub, LoRARun, Source, WeightsFile, parse_source
from nanogpt_cli.model import GPT
from nanogpt_cli.runs.checkpoint import load_weights
from nanogpt_cli.tokenizer import Tokenizer, tokenizer_from_description


def load_model(
    source: str | Path | Source,
    last: bool = False,
    device: str | torch.device = "cpu",
    quantize: str | None = None,
    group_size=32,
) -> tuple[GPT, dict]:
    """The model rebuilt from a source alone, and its metadata: build_model on the source parsed (a Source passes
    through as it is)."""
    model, meta = build_model(parse_source(source, last), quantize, group_size)
    return model.to(device), meta


def build_model(source: Source, quantize: str | None = None, group_size: int = 32) -> tuple[GPT, dict]:
    """The model of a parsed source in float32 on the CPU, and its metadata. A Hugging Face model is converted, and
    its metadata holds the config and our description of its tokenizer (see hf.py); a LoRA run comes merged into
    its base; a GGUF file's Q8_0 / Q4_0 blocks load as they are (quantize, group_size: the form they take)."""
    from nanogpt_cli.interop import gguf_in

    match source:
        case HFFolder() | HFHub():
            model, meta = hf.load_pretrained_meta(_hf_name(source))
            return model, {"config": model.config.to_dict(), **meta, "source": _hf_name(source)}
        case GGUFFile():
            return gguf_in.read_any_gguf(source.path, quantize, group_size)
        case LoRARun():
            return load_lora(source, merge=True)[0], _ours_meta(source)
        case WeightsFile():
            lazy = checked_weights(source.weights, _ours_meta(source))
            model = GPT(lazy.model.config)
            load_weights(model, source.weights)
            return model, lazy.meta
    raise AssertionError(f"unhandled source {source!r}")


def _hf_name(source: HFFolder | HFHub) -> str:
    """What hf.load_pretrained_meta reads: hf:NAME, or the folder."""
    return f"hf:{source.name}" if isinstance(source, HFHub) else str(source.folder)


def _ours_meta(source: WeightsFile) -> dict[str, Any]:
    """A weights file's metadata, with the folder a Hugging Face tokenizer's tokenizer.json sits in (beside it)."""
    return {**source.meta, TOKENIZER_DIR: str(source.weights.parent)}


def is_converted(source: str | Path | Source) -> bool:
    """hf:NAME, a Hugging Face folder or a GGUF file: a model that load_model converts (not one of our runs)."""
    if not isinstance(source, Source) and not str(source).startswith("hf:") and not Path(source).exists():
        return False  # names nothing: the loader's own error follows
    return isinstance(parse_source(source), HFFolder | HFHub | GGUFFile)


def tokenizer_of(meta: dict[str, Any], source: str | Path | Source = "") -> Tokenizer:
    """The tokenizer `load_model`'s metadata describes; a Hugging Face tokenizer from the tokenizer.json that came
    with it (beside the weights, in the model's folder, or inside a GGUF file)."""
    if "tokenizer" not in meta:
        raise NanoGPTError(f"{source} has no tokenizer in its metadata, so its text cannot be decoded")
    folder = meta.get(TOKENIZER_DIR)
    return tokenizer_from_description(meta["tokenizer"], Path(folder) if folder else None, meta.get(TOKENIZER_TEXT))


def load_lora(source: LoRARun, merge: bool) -> tuple[GPT, GPT | None]:
    """A LoRA run's adapters on its base, checked against the base's recorded hash: (the model with adapters,
    merged into plain layers when `merge`, and, unmerged, the base alone as loaded)."""
    import copy

    from nanogpt_cli.lora import LoRAConfig, add_lora, merge_lora, weights_hash

    path = source.weights
    try:
        model, _ = build_model(source.base)
    except NanoGPTError as e:
        raise NanoGPTError(f"{path} holds LoRA adapters, and their base could not be loaded: {e}") from None
    digest = weights_hash(model)
    if digest != source.base_sha256:
        raise NanoGPTError(
            f"{path} holds LoRA adapters for other base weights than {source.base} holds now (sha256 "
            f"{source.base_sha256[:12]}..., found {digest[:12]}...); it was changed since the adapters were trained"
        )
    plain = None if merge else copy.deepcopy(model)
    add_lora(model, LoRAConfig.from_dict(source.meta["lora"]))
    load_weights(model, path)
    model.requires_grad_(False)
    return (merge_lora(model) if merge else model), plain


@dataclass
class InferenceModel:
    """A checkpoint ready to run: the model cast to its inference dtype on its device, and its tokenizer."""

    model: GPT
    tokenizer: Tokenizer
    meta: dict[str, Any]  # the weights file's metadata (config, tokenizer, step, ...)
    device: torch.device
    dtype: torch.dtype
    source: Source | None = None  # where it was loaded from (None: a model built in memory)

    @property
    def block_size(self) -> int:
        return self.model.config.block_size


def load_for_inference(spec: LoadSpec | str | Path, **options: Any) -> InferenceModel:
    """load_parsed from a LoadSpec, or a source and the spec's fields as keywords (device="cpu", dtype="float32",
    ...): the source parsed here, where it enters."""
    import dataclasses

    if not isinstance(spec, LoadSpec):
        spec = LoadSpec(str(spec), **options)
    elif options:
        spec = dataclasses.replace(spec, **options)
    return load_parsed(parse_spec(spec), spec)


def parse_spec(spec: LoadSpec) -> Source:
    """The spec's options checked before anything is read (a --quantize, --int4-group or --backend that is none is
    one sentence, whatever the source), then its source parsed: what load_parsed takes."""
    from nanogpt_cli.inference.backends import NAMES
    from nanogpt_cli.inference.backends.quantize import check_quantize

    try:
        check_quantize(spec.quantize, spec.group_size)
    except ValueError as e:
        raise NanoGPTError(str(e)) from None
    if spec.backend is not None and spec.backend not in NAMES:
        raise NanoGPTError(f"--backend must be one of {', '.join(NAMES)}, got {spec.backend!r}")
    return parse_source(spec.source, spec.last)


def load_parsed(source: Source, spec: LoadSpec) -> InferenceModel:
    """The one loader that sample, chat, eval, serve and inspect share: a parsed source, loaded as the spec says
    (parse_spec read its source and last into `source` and checked its options). The spec's threads are set first.
    Inference casts the weights once instead of autocasting every call; `auto` picks the dtype from the device and
    the size of the weights (device.py). quantize: int8 or int4 weights for the blocks' projections
    (backends/quantize.py), group_size the int4 groups' width; a GGUF export's Q8_0 or Q4_0 blocks load straight
    into that form. Our weights files and GGUF exports are read tensor by tensor into the finished form
    (materialize.py), never whole in float32. backend: the decode backend every engine on the model uses
    (inference/backends/)."""
    from nanogpt_cli.inference.backends import choose
    from nanogpt_cli.inference.backends.quantize import quantize_model
    from nanogpt_cli.interop.materialize import materialize

    if spec.threads is not None:  # the one place a command's threads are set; None keeps torch's
        set_threads(None if spec.threads == "auto" else spec.threads)
    dev = resolve_device(spec.device)
    if spec.quantize is not None and dev.type != "cpu":
        raise NanoGPTError(f"--quantize runs on a CPU only (torch's packed kernels), not on {dev}; use --device cpu")
    lazy = lazy_model(source, spec.quantize, spec.group_size)
    if lazy is None:  # a Hugging Face model or LoRA adapters: built whole, then cast
        model, meta = build_model(source, spec.quantize, spec.group_size)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    else:
        meta, weight_bytes = lazy.meta, lazy.weight_bytes
    tokenizer = tokenizer_of(meta, source)
    say_threads(dev)  # set_threads' automatic choice, once the model is there: it stays as it is
    cast = resolve_inference_dtype(spec.dtype, dev, weight_bytes)
    try:
        if lazy is None:
            model = model.to(dev).cast(cast).eval()
            if spec.quantize is not None:
                quantize_model(model, spec.quantize, spec.group_size)
        else:
            model = materialize(lazy, cast, spec.quantize, spec.group_size).to(dev).eval()
    except ValueError as e:
        raise NanoGPTError(str(e)) from None
    if spec.backend is not None:  # refused here in one sentence where it does not fit; the engines read it
        model.decode_backend = choose(model, spec.backend).name
    return InferenceModel(model, tokenizer, meta, dev, cast, source)


def lazy_model(source: Source, quantize: str | None, group_size: int):
    """A LazyModel (materialize.py) for a weights file of ours or a GGUF file; None for what load_model builds
    whole (a Hugging Face model, LoRA adapters on their base)."""
    from nanogpt_cli.interop import gguf_in

    match source:
        case GGUFFile():
            return gguf_in.lazy_any_gguf(source.path, quantize, group_size)
        case LoRARun() | HFFolder() | HFHub():
            return None
        case WeightsFile():
            return checked_weights(source.weights, _ours_meta(source))
    raise AssertionError(f"unhandled source {source!r}")


def checked_weights(path: Path, meta: dict):
    """A weights file of ours as a LazyModel on the meta device, once its header's tensors are the ones its config
    implies (names and shapes, the blocks counted before the model is built)."""
    from nanogpt_cli.interop.materialize import LazyModel, check_blocks, check_tensors, empty_model
    from nanogpt_cli.runs.checkpoint import TensorFile

    config = config_of(meta, path)
    file = TensorFile(path)
    found = file.shapes()
    if config.tie_embeddings:  # a tied head is the embedding: any copy is unread
        found.pop("lm_head.weight", None)
    check_blocks(str(path), config.n_layer, found)
    lazy = LazyModel(empty_model(config, str(path)), file.get, meta, str(path))
    expected = {k: tuple(v.shape) for k, v in lazy.model.state_dict().items()}
    if config.tie_embeddings:
        expected.pop("lm_head.weight")
    check_tensors(str(path), expected, found)
    return lazy


def config_of(meta: dict, path) -> GPTConfig:
    """The config in a file's metadata, or one sentence."""
    try:
        return GPTConfig.from_dict(meta["config"])
    except (TypeError, ValueError, KeyError) as e:
        raise NanoGPTError(f"{path} holds an invalid model config: {e}") from None
