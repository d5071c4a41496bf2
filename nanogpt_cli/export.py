"""Export a run for other tools: a Hugging Face folder (transformers, pipelines, lm-eval) or one GGUF file
(llama.cpp, ollama, LM Studio).

    export("checkpoints/shk", "hf", Path("exports/shk"))  # then AutoModelForCausalLM.from_pretrained("exports/shk")

A Hugging Face folder holds config.json, generation_config.json, model.safetensors, tokenizer.json and
tokenizer_config.json; gguf_file.py writes the GGUF file. Which stock architecture a run becomes is decided in
`hf.hf_kind`; a config that no stock architecture computes exactly is refused, never approximated. Everything is
built in a temporary folder (or file) beside the target and renamed into place, so a refusal or a crash leaves
nothing behind.
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
ORIGIN_KEY = "nanogpt_origin"  # in an exported config.json: the run, step and dataset the weights came from


@dataclass
class ExportResult:
    path: Path  # the folder (hf) or file (gguf) written
    format: str  # hf | gguf
    architecture: str  # the transformers class, or the GGUF architecture
    tokenizer: str  # gpt2 | char | byte | a trained tokenizer's name
    quant: str = "f32"  # gguf: the type of its matrices
    bytes: int = 0  # gguf: the file's size
    f32_bytes: int = 0  # gguf: the size the same file has in float32


def export(
    source: str | Path, fmt: str, out: str | Path, last: bool = False, force: bool = False, quant: str | None = None
) -> ExportResult:
    """Export a run folder or .safetensors checkpoint (or a Hugging Face folder / hf:NAME) to `out`. quant: the
    GGUF type of the matrices (gguf_file.QUANTS; default f32)."""
    if fmt not in FORMATS:
        raise NanoGPTError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if quant is not None and fmt != "gguf":
        raise NanoGPTError("--quant applies to --format gguf only")
    model, desc, origin = load_source(source, last)
    if fmt == "hf":
        return export_hf(model, desc, Path(out), force, origin)
    return export_gguf(model, desc, Path(out), force, quant or "f32")


def load_source(source: str | Path, last: bool = False) -> tuple[GPT, dict[str, Any], dict[str, Any]]:
    """Our model, its tokenizer description and where it came from (ORIGIN_KEY's value) from one of our
    checkpoints or a Hugging Face model."""
    from nanogpt_cli import __version__
    from nanogpt_cli.loading import load_model

    model, meta = load_model(source, last=last)
    if "tokenizer" not in meta:
        raise NanoGPTError(f"{source} has no tokenizer in its metadata, so it cannot be exported with one")
    path = Path(source)
    run = path if path.is_dir() else path.parent  # a weights file names its run folder
    origin = {"run": str(run), "source": str(source), "version": __version__}
    origin.update({k: meta[k] for k in ("step", "tokens", "dataset", "val_loss") if meta.get(k) is not None})
    return model, meta["tokenizer"], origin


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


def export_hf(
    model: GPT, desc: dict[str, Any], out: Path, force: bool = False, origin: dict[str, Any] | None = None
) -> ExportResult:
    """Write a folder that AutoModelForCausalLM, AutoTokenizer and pipeline("text-generation") load offline.
    origin: where the weights came from (run, step, ...), kept under ORIGIN_KEY in config.json for `info`."""
    transformers = hf.require("transformers")
    kind = hf.hf_kind(model.config)  # refusals first: nothing is written before every check has passed
    tok, eot = hf.tokenizers_object(desc)
    if desc["vocab_size"] > model.config.vocab_size:
        raise NanoGPTError(
            f"the tokenizer has {desc['vocab_size']:,} tokens but the model only {model.config.vocab_size:,}"
        )
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
        if origin:  # transformers keeps unknown keys as config attributes; `info` and `runs` read this one
            config[ORIGIN_KEY] = origin
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        # a padded head (vocab_size above the tokenizer's) never picks a token the tokenizer lacks, as in ours
        padding = list(range(desc["vocab_size"], model.config.vocab_size))
        generation = transformers.GenerationConfig(**special, **({"suppress_tokens": padding} if padding else {}))
        generation.save_pretrained(tmp)
        tok.save(str(tmp / "tokenizer.json"))
        # written here, not by save_pretrained: transformers 5 names its own backend class, which 4.x cannot load
        tokenizer_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": model.config.block_size,
            "clean_up_tokenization_spaces": False,
        }
        if eot is not None:
            tokenizer_config.update(bos_token=eot, eos_token=eot, unk_token=eot)
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n", encoding="utf-8")
        _replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return ExportResult(out, "hf", hf.ARCHS[kind][3], desc["name"])


# --- GGUF ---------------------------------------------------------------------------------------------


def export_gguf(model: GPT, desc: dict[str, Any], out: Path, force: bool = False, quant: str = "f32") -> ExportResult:
    """Write one GGUF file (see gguf_file.py) with float32, float16 or quantized matrices."""
    from nanogpt_cli import gguf_file

    hf.require("gguf")
    if quant not in gguf_file.QUANTS:
        raise NanoGPTError(f"--quant must be one of {', '.join(gguf_file.QUANTS)}, got {quant!r}")
    arch = gguf_file.gguf_arch(model.config)  # refusals first: nothing is written before every check has passed
    gguf_file.gguf_vocabulary(desc, model.config.vocab_size, hf.require("gguf"))
    if out.suffix != ".gguf":
        raise NanoGPTError(f"--out for --format gguf is a file ending in .gguf, got {out}")
    _check_target(out, force)
    tmp = _staging(out)
    try:
        gguf_file.write_gguf(model, desc, tmp, quant)
        size = tmp.stat().st_size
        _replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    # the size of the same file in float32: its size less the tensors as written plus the tensors at 4 bytes a value
    gguf = hf.require("gguf")
    tensors = gguf_file.gguf_tensors(model, arch)

    def padded(n: int) -> int:  # each tensor starts on a 32-byte boundary
        return gguf.GGUFWriter.ggml_pad(n, gguf.GGUF_DEFAULT_ALIGNMENT)

    written = sum(padded(gguf_file._quantize(t, quant, gguf)[0].nbytes) for t in tensors.values())
    f32 = size - written + sum(padded(t.nbytes) for t in tensors.values())
    return ExportResult(out, "gguf", arch, desc["name"], quant=quant, bytes=size, f32_bytes=f32)
