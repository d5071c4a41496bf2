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

from nanogpt_cli.config import Dtype, GPTConfig
from nanogpt_cli.device import resolve_device, resolve_inference_dtype, say_threads
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.hf_tokenizer import TOKENIZER_DIR, TOKENIZER_TEXT
from nanogpt_cli.interop import hf
from nanogpt_cli.model import GPT
from nanogpt_cli.runs.checkpoint import load_weights, read_metadata
from nanogpt_cli.runs.rundir import find_run, resolve_weights
from nanogpt_cli.tokenizer import Tokenizer, tokenizer_from_description


def load_model(
    path: str | Path, last: bool = False, device: str | torch.device = "cpu", quantize: str | None = None, group_size=32
) -> tuple[GPT, dict]:
    """The model rebuilt from a checkpoint alone (its config is in the metadata), and that metadata. A Hugging
    Face model (hf:NAME, or a folder holding a transformers config.json) is converted, and its metadata holds
    the config and our description of its tokenizer (see hf.py). A bare run name is a run under checkpoints/."""
    path = find_run(path)
    if hf.is_hf_source(path):
        model, meta = hf.load_pretrained_meta(path)
        return model.to(device), {"config": model.config.to_dict(), **meta, "source": str(path)}
    from nanogpt_cli.interop import gguf_file, gguf_in

    if gguf_file.is_gguf(path):  # a GGUF file that nanogpt exported, or llama.cpp's converter wrote
        model, meta = gguf_in.read_any_gguf(path, quantize, group_size)  # our Q8_0 / Q4_0 blocks load as they are
        return model.to(device), meta
    path = resolve_weights(path, last)
    meta = read_metadata(path)
    meta[TOKENIZER_DIR] = str(path.parent)  # a Hugging Face tokenizer's tokenizer.json is beside the weights
    if "lora" in meta:
        return load_lora(path, meta, merge=True)[0].to(device), meta
    config = checked_weights(path, meta).model.config
    model = GPT(config)
    load_weights(model, path)
    return model.to(device), meta


def is_converted(source: str | Path) -> bool:
    """hf:NAME, a Hugging Face folder or a GGUF file: a model that load_model converts (not one of our runs)."""
    from nanogpt_cli.interop import gguf_file

    return hf.is_hf_source(source) or gguf_file.is_gguf(source)


def tokenizer_of(meta: dict[str, Any], source: str | Path = "") -> Tokenizer:
    """The tokenizer `load_model`'s metadata describes; a Hugging Face tokenizer from the tokenizer.json that came
    with it (beside the weights, in the model's folder, or inside a GGUF file)."""
    if "tokenizer" not in meta:
        raise NanoGPTError(f"{source} has no tokenizer in its metadata, so its text cannot be decoded")
    folder = meta.get(TOKENIZER_DIR)
    return tokenizer_from_description(meta["tokenizer"], Path(folder) if folder else None, meta.get(TOKENIZER_TEXT))


def load_lora(path: Path, meta: dict, merge: bool) -> tuple[GPT, GPT | None]:
    """A LoRA run's weights file (adapters only) on its base, which is loaded from where the run recorded it and
    checked against the recorded hash: (the model with adapters, merged into plain layers when `merge`, and,
    unmerged, the base alone as loaded)."""
    import copy

    from nanogpt_cli.lora import LoRAConfig, add_lora, merge_lora, weights_hash

    base = meta["base"]
    try:
        model, _ = load_model(base["source"], last=base.get("last", False))
    except NanoGPTError as e:
        raise NanoGPTError(f"{path} holds LoRA adapters, and their base could not be loaded: {e}") from None
    digest = weights_hash(model)
    if digest != base["sha256"]:
        raise NanoGPTError(
            f"{path} holds LoRA adapters for other base weights than {base['source']} holds now (sha256 "
            f"{base['sha256'][:12]}..., found {digest[:12]}...); it was changed since the adapters were trained"
        )
    plain = None if merge else copy.deepcopy(model)
    add_lora(model, LoRAConfig.from_dict(meta["lora"]))
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

    @property
    def block_size(self) -> int:
        return self.model.config.block_size


def load_for_inference(
    checkpoint: str | Path,
    last: bool = False,
    device: str = "auto",
    dtype: Dtype = Dtype.auto,
    quantize: str | None = None,
    group_size: int = 32,
    backend: str | None = None,
) -> InferenceModel:
    """The one loader that sample and eval share. Inference casts the weights once instead of autocasting
    every call; `auto` picks the dtype from the device and the size of the weights (device.py). quantize: int8
    or int4 weights for the blocks' projections (backends/quantize.py), group_size the int4 groups' width; a GGUF
    export's Q8_0 or Q4_0 blocks load straight into that form. Our weights files and GGUF exports are read tensor
    by tensor into the finished form (materialize.py), never whole in float32. backend: the decode backend every
    engine on the model uses (inference/backends/), refused before the weights are read where it is not one."""
    from nanogpt_cli.inference.backends import NAMES, choose
    from nanogpt_cli.inference.backends.quantize import check_quantize, quantize_model
    from nanogpt_cli.interop.materialize import materialize

    try:
        check_quantize(quantize, group_size)
    except ValueError as e:
        raise NanoGPTError(str(e)) from None
    if backend is not None and backend not in NAMES:
        raise NanoGPTError(f"--backend must be one of {', '.join(NAMES)}, got {backend!r}")
    dev = resolve_device(device)
    if quantize is not None and dev.type != "cpu":
        raise NanoGPTError(f"--quantize runs on a CPU only (torch's packed kernels), not on {dev}; use --device cpu")
    lazy = lazy_model(checkpoint, last, quantize, group_size)
    if lazy is None:  # a Hugging Face model or LoRA adapters: built whole, then cast
        model, meta = load_model(checkpoint, last=last, quantize=quantize, group_size=group_size)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    else:
        meta, weight_bytes = lazy.meta, lazy.weight_bytes
    tokenizer = tokenizer_of(meta, checkpoint)
    say_threads(dev)  # set_threads' automatic choice, once the model is there: it stays as it is
    cast = resolve_inference_dtype(dtype, dev, weight_bytes)
    try:
        if lazy is None:
            model = model.to(dev).cast(cast).eval()
            if quantize is not None:
                quantize_model(model, quantize, group_size)
        else:
            model = materialize(lazy, cast, quantize, group_size).to(dev).eval()
    except ValueError as e:
        raise NanoGPTError(str(e)) from None
    if backend is not None:  # refused here in one sentence where it does not fit; the engines read it
        model.decode_backend = choose(model, backend).name
    return InferenceModel(model, tokenizer, meta, dev, cast)


def lazy_model(checkpoint: str | Path, last: bool, quantize: str | None, group_size: int):
    """A LazyModel (materialize.py) for a weights file of ours or a GGUF file; None for what load_model builds
    whole (a Hugging Face model, LoRA adapters on their base)."""
    from nanogpt_cli.interop import gguf_file, gguf_in

    path = find_run(checkpoint)
    if hf.is_hf_source(path):
        return None
    if gguf_file.is_gguf(path):
        return gguf_in.lazy_any_gguf(path, quantize, group_size)
    path = resolve_weights(path, last)
    meta = read_metadata(path)
    meta[TOKENIZER_DIR] = str(path.parent)
    if "lora" in meta:
        return None
    return checked_weights(path, meta)


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
